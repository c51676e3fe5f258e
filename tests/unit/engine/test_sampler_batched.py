"""The sampler's vectorized parts: filters applied to a batch of rows with mixed parameters equal each row
filtered alone, unseeded rows of one batch draw independently, and the two-level inverse CDF picks exactly the
token a full cumulative sum would."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.test_sampler import CPU, kept, make_req
from tokenfleet.backends.torch.sampler import Sampler, filtered_probs
from tokenfleet.engine.sampling_params import SamplingParams


def test_batched_filters_equal_each_row_filtered_alone():
    from tokenfleet.backends.torch.sampler import filtered_probs_batch

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float32) * 2
    settings = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 3, 0.5, 0.0), (0.9, 0, 1.0, 0.2),
                (1.1, 10, 0.9, 0.05)]
    params = [SamplingParams(max_tokens=1, temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]
    batched = filtered_probs_batch(logits.clone(), params)
    for i, (t, k, p, m) in enumerate(settings):
        alone = filtered_probs(logits[i].clone(), t, k, p, m)
        assert kept(batched[i]) == kept(alone)
        torch.testing.assert_close(batched[i], alone)


def test_unseeded_rows_of_one_batch_draw_independently():
    flat = torch.zeros(4, 1000, dtype=torch.float32)
    reqs = [make_req(f"u{i}", temperature=1.0) for i in range(4)]
    tokens = Sampler(CPU).sample(flat.clone(), reqs).token_ids
    assert len(set(tokens)) == 4  # equal rows, one uniform each: a repeat has probability ~6e-6


def test_inverse_cdf_picks_the_token_whose_mass_holds_the_uniform():
    from tokenfleet.backends.torch.sampler import CDF_CHUNK, inverse_cdf

    vocab = 3 * CDF_CHUNK + 17  # not a multiple of the chunk
    probs = torch.zeros(5, vocab)
    probs[:, 5] = 0.25  # chunk 0
    probs[:, CDF_CHUNK + 1] = 0.25  # chunk 1, its second token
    probs[:, 3 * CDF_CHUNK + 16] = 0.5  # the last token, in the padded chunk
    uniforms = torch.tensor([0.0, 0.24, 0.26, 0.5, 0.999])
    assert inverse_cdf(probs, uniforms).tolist() == [5, 5, CDF_CHUNK + 1, vocab - 1, vocab - 1]
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(4, vocab, generator=g)
    u = torch.rand(4, generator=g)
    expected = torch.searchsorted(dense.double().cumsum(-1), (u.double() * dense.double().sum(-1))[:, None], right=True)
    assert inverse_cdf(dense, u).tolist() == expected.squeeze(1).tolist()


def _native_sampler():
    from tokenfleet.backends.torch.sampler import NativeTemperatureSampler

    sampler = NativeTemperatureSampler.load()
    if sampler is None:
        pytest.skip("no C compiler: the native sampling kernel cannot be built")
    return sampler


def test_native_draw_is_the_torch_inverse_cdf_draw():
    from tokenfleet.backends.torch.sampler import filtered_probs_batch, inverse_cdf

    draw = _native_sampler()
    g = torch.Generator().manual_seed(11)
    vocab = 3 * 256 + 100  # a partial last chunk
    logits = torch.randn(400, vocab, generator=g) * 3
    logits[::7, :: 3] = float("-inf")  # masked tokens in some rows
    temps = [0.3, 0.7, 1.0, 1.6]
    params = [SamplingParams(max_tokens=1, temperature=temps[i % 4]) for i in range(400)]
    uniforms = torch.rand(400, generator=g)
    ours = draw(logits, params, uniforms)
    probs = filtered_probs_batch(logits.clone(), params).double()
    expected = inverse_cdf(probs.float(), uniforms)
    cdf = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
    for row in (ours != expected).nonzero().flatten().tolist():  # only where the uniform sits on a boundary
        t = int(ours[row])
        assert abs(cdf[row, t - 1] - uniforms[row]) < 1e-5 or abs(cdf[row, t] - uniforms[row]) < 1e-5
    assert int((ours == expected).sum()) >= 396
    assert not bool(torch.isinf(logits.gather(1, ours[:, None])).any())  # never a masked token


def test_native_draw_follows_the_tempered_distribution():
    draw = _native_sampler()
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))  # the last token masked (-inf)
    n = 20000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(max_tokens=1, temperature=0.5)] * n
    counts = torch.bincount(draw(logits.expand(n, -1), params, uniforms), minlength=4).double() / n
    expected = torch.tensor([0.25, 0.09, 0.04, 0.0]) / 0.38  # p^(1/T), renormalized
    assert counts[3] == 0
    torch.testing.assert_close(counts, expected.double(), atol=0.015, rtol=0)


def test_native_draw_refuses_a_row_with_nothing_to_draw_and_the_sampler_falls_back():
    draw = _native_sampler()
    logits = torch.full((2, 300), float("-inf"))
    logits[1, 7] = 0.0
    params = [SamplingParams(max_tokens=1, temperature=1.0)] * 2
    assert draw(logits, params, torch.tensor([0.5, 0.5])).tolist() == [-1, 7]
    nan_row = torch.zeros(1, 300)
    nan_row[0, 3] = float("nan")
    assert draw(nan_row, params[:1], torch.tensor([0.5])).tolist() == [-1]


def test_filtered_rows_take_the_torch_path_and_keep_their_filters():
    logits = torch.zeros(3, 1000)
    logits[:, :5] = 5.0  # top_k=5 keeps only these
    reqs = [make_req(f"k{i}", temperature=1.0, top_k=5) for i in range(3)]
    for _ in range(20):
        assert all(t < 5 for t in Sampler(CPU).sample(logits.clone(), reqs).token_ids)


def test_logprobs_of_a_batch_equal_each_row_s_alone():
    """Requested logprobs are computed for every row that wants them at once (one read-back per step): the chosen
    token's logprob and rank and the top ones equal what the row alone gives, whatever the other rows ask."""
    from tokenfleet.backends.torch.sampler import token_logprobs

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 80, generator=g, dtype=torch.float32) * 3
    asks = [2, None, 0, 5, 1]
    reqs = [make_req(f"l{i}", temperature=0.0, logprobs=n) for i, n in enumerate(asks)]
    out = Sampler(CPU).sample(logits.clone(), reqs)
    raw = torch.log_softmax(logits, dim=-1)
    for i, n in enumerate(asks):
        assert out.token_ids[i] == int(logits[i].argmax())
        if n is None:
            assert out.logprobs[i] is None
        else:
            assert out.logprobs[i] == token_logprobs(raw[i], out.token_ids[i], n)
            assert len(out.logprobs[i].top) == n
