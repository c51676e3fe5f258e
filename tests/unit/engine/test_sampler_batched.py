"""The sampler's vectorized parts: filters applied to a batch of rows with mixed parameters equal each row
filtered alone, unseeded rows of one batch draw independently, and the two-level inverse CDF picks exactly the
token a full cumulative sum would."""

from __future__ import annotations

import torch

from tests.unit.engine.test_sampler import CPU, kept, make_req
from tokenfleet.engine.sampler import Sampler, filtered_probs
from tokenfleet.engine.sampling_params import SamplingParams


def test_batched_filters_equal_each_row_filtered_alone():
    from tokenfleet.engine.sampler import filtered_probs_batch

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
    from tokenfleet.engine.sampler import CDF_CHUNK, inverse_cdf

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
