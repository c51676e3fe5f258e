"""The logits kernels (models.triton_logits) against torch: the exact top logits of ``llama.refine_top_logits`` and
``torch.argmax``. Without CUDA they run in Triton's interpreter (tests/conftest.py); scripts/gpu_check.sh runs this
file on the GPU."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.models import triton_logits
from tokenfleet.models.llama import refine_top_logits

pytestmark = pytest.mark.skipif(not triton_logits.available(), reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def head_and_hidden(vocab: int, hidden: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, hidden, generator=g).to(DEVICE, torch.bfloat16)
    h = torch.randn(rows, hidden, generator=g).to(DEVICE, torch.bfloat16)
    return head, h, (h @ head.T).float()  # the bf16 GEMM's logits: rounded, with ties


def check_refined(before: torch.Tensor, after: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor, k: int,
                  refined_rows: list[int]) -> None:
    """In each refined row exactly k positions changed or kept their place as a top-k of ``before`` (ties at the
    k-th value may pick any of them), each now the fp32 dot product; every other position, and every other row,
    untouched."""
    exact = hidden.float() @ head.float().T
    for row in range(before.shape[0]):
        if row not in refined_rows:
            assert torch.equal(after[row], before[row]), row
            continue
        moved = (after[row] != before[row]).nonzero().flatten()
        same = after[row] == before[row]
        # the refined positions: those whose value is now the exact one (the bf16 value can equal it by chance)
        hit = (after[row] - exact[row]).abs() <= 1e-4 * exact[row].abs().clamp(min=1.0)
        assert set(moved.tolist()) <= set(hit.nonzero().flatten().tolist())
        kth = before[row].topk(k).values[-1]
        chosen = [i for i in hit.nonzero().flatten().tolist() if before[row, i] >= kth]
        assert len(chosen) >= k  # k of the top-k now hold exact values
        assert bool(same[before[row] < kth].all())  # nothing below the k-th value was touched


@pytest.mark.parametrize("vocab,hidden", [(300, 64), (2048, 96), (5000, 200), (6145, 512)],
                         ids=["one-short-chunk", "one-full-chunk", "ragged", "chunk-plus-one"])
@pytest.mark.parametrize("k", [8, 3])
def test_refined_rows_hold_fp32_dot_products_at_their_top_k(vocab, hidden, k):
    head, h, logits = head_and_hidden(vocab, hidden, rows=3, seed=vocab + k)
    out = triton_logits.refine_top_logits_(logits.clone(), h, head, k)
    check_refined(logits, out, h, head, k, refined_rows=[0, 1, 2])


def test_without_ties_it_refines_what_torch_refines():
    """fp32 logits (no ties): the same k tokens as ``refine_top_logits``, the same values to the sums' order."""
    g = torch.Generator().manual_seed(5)
    head = torch.randn(4100, 80, generator=g).to(DEVICE)
    h = torch.randn(4, 80, generator=g).to(DEVICE)
    logits = h @ head.T + torch.randn(4, 4100, generator=g).to(DEVICE)  # off the exact values: every top-k moves
    ours = triton_logits.refine_top_logits_(logits.clone(), h, head, 8)
    theirs = refine_top_logits(logits.clone(), h, head, k=8)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-5)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_only_the_listed_or_flagged_rows_change():
    head, h, logits = head_and_hidden(3000, 64, rows=5, seed=1)
    rows = torch.tensor([3, 1], device=DEVICE)
    out = triton_logits.refine_top_logits_(logits.clone(), h, head, 8, rows=rows)
    check_refined(logits, out, h, head, 8, refined_rows=[1, 3])
    flags = torch.tensor([True, False, False, True, True], device=DEVICE)  # a CUDA graph's static flags
    out = triton_logits.refine_top_logits_(logits.clone(), h, head, 8, flags=flags)
    check_refined(logits, out, h, head, 8, refined_rows=[0, 3, 4])


def test_a_near_tie_that_bf16_rounding_flips_is_decided_by_the_exact_values():
    hidden = torch.ones(1, 2, dtype=torch.bfloat16, device=DEVICE)
    head = torch.full((3000, 2), -5.0, dtype=torch.bfloat16, device=DEVICE)
    head[2100] = 10.0
    head[2900] = torch.tensor([10.0, 10.0625])  # sum 20.0625: the exact winner, in another chunk
    rounded = (hidden @ head.T).float()
    assert rounded[0, 2100] == rounded[0, 2900]
    assert rounded.argmax(-1).item() == 2100
    refined = triton_logits.refine_top_logits_(rounded, hidden, head, 2)
    assert triton_logits.argmax_rows(refined).item() == 2900


@pytest.mark.parametrize("vocab", [7, 2048, 4097, 9000])
def test_argmax_is_torch_argmax_ties_and_all(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(DEVICE)
    logits[1] = 0.0  # every value tied: index 0
    logits[2] = float("-inf")  # all masked: index 0
    logits[3, vocab // 3] = logits[3, vocab - 1] = 50.0  # a tie across chunks: the first
    logits[4] = logits[4].round()  # many ties
    logits[5, vocab - 1] = 99.0  # the very last entry
    assert torch.equal(triton_logits.argmax_rows(logits), logits.argmax(dim=-1))
    logits[0, vocab // 2] = float("nan")  # a broken row: torch takes the NaN as the largest, so do these
    assert triton_logits.argmax_rows(logits)[0].item() == logits.argmax(dim=-1)[0].item() == vocab // 2


def test_empty_batches_and_strided_rows():
    logits = torch.randn(0, 100, device=DEVICE)
    assert triton_logits.argmax_rows(logits).shape == (0,)
    wide = torch.randn(3, 5000, device=DEVICE)
    view = wide[:, :4500]  # rows 5000 apart
    assert torch.equal(triton_logits.argmax_rows(view), view.argmax(dim=-1))


def test_the_first_use_on_a_device_checks_the_kernels_against_torch(monkeypatch):
    """``serves`` asks ``self_check`` once per device: a kernel that does not compile there (or disagrees) leaves
    torch serving, not every step failing."""
    assert triton_logits.self_check(torch.device(DEVICE))

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(triton_logits, "refine_top_logits_", broken)
    assert not triton_logits.self_check(torch.device(DEVICE))

    def short_of_memory(*args, **kwargs):  # not a verdict on the kernels: the caller sees it
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(triton_logits, "refine_top_logits_", short_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        triton_logits.self_check(torch.device(DEVICE))
