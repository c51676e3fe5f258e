"""bf16 logits: the top candidates of a row are recomputed in fp32 from the hidden state."""

from __future__ import annotations

import torch

from tokenfleet.models.llama import REFINED_LOGITS, refine_top_logits


def test_top_logits_become_fp32_dot_products_and_the_rest_stay():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2000, 64, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    rounded = (hidden @ rows.T).float()  # what the bf16 GEMM gives: rounded to bf16
    exact = hidden.float() @ rows.float().T
    refined = refine_top_logits(rounded, hidden, rows)
    top = rounded.topk(REFINED_LOGITS, dim=-1).indices
    torch.testing.assert_close(refined.gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
    untouched = torch.ones_like(rounded, dtype=torch.bool).scatter(1, top, False)
    assert torch.equal(refined[untouched], rounded[untouched])
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))  # greedy picks follow the exact logits


def test_a_near_tie_that_bf16_rounding_flips_is_decided_by_the_exact_values():
    # Two candidates 0.03 apart at a logit of ~20: both round to the same bf16 value (step 0.125).
    hidden = torch.ones(1, 2, dtype=torch.bfloat16)
    rows = torch.tensor([[10.0, 10.0], [10.0, 10.0], [-5.0, 0.0]], dtype=torch.bfloat16)
    rows[1, 1] = 10.0625  # sum 20.0625: exact winner
    rounded = (hidden @ rows.T).float()
    assert rounded[0, 0] == rounded[0, 1]  # the GEMM cannot tell them apart: argmax picks token 0
    refined = refine_top_logits(rounded, hidden, rows, k=2)
    assert refined.argmax(-1).item() == 1
