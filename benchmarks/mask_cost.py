"""Cost of applying grammar masks to a batch of logits (llguidance bitmasks -> -inf), on the CPU or
CUDA, at a given vocabulary and batch size; compared with the sampler's own per-step work.

Usage: python benchmarks/mask_cost.py [--device cuda] [--vocab 128256] [--batch 64]"""

from __future__ import annotations

import argparse
import time

import torch

from tokenfleet.backends.torch.grammar_masks import apply_masks, mask_width


def timed(fn, device: str, repeats: int = 50) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    logits = torch.randn(args.batch, args.vocab, device=args.device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (args.batch, mask_width(args.vocab)), dtype=torch.int32)
    rows = list(range(args.batch))
    mask_ms = timed(lambda: apply_masks(logits.clone(), rows, bitmask), args.device)
    clone_ms = timed(lambda: logits.clone(), args.device)
    softmax_ms = timed(lambda: torch.log_softmax(logits, dim=-1), args.device)
    print(f"device {args.device}, batch {args.batch}, vocab {args.vocab}: apply_masks {mask_ms - clone_ms:.3f} ms "
          f"per step (a log_softmax of the same logits: {softmax_ms:.3f} ms)")


if __name__ == "__main__":
    main()
