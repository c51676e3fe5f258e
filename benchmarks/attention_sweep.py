"""Decode attention kernel tuning on the GPU: one request (or a few) over a long block table, as a batch-1
decode step of Llama-3.1-8B's geometry sees it inside a CUDA graph (the table is as wide as max_model_len).

Each variant (BLOCK_N keys per iteration, keys per split-K partition, warps, pipeline stages) is checked
against the torch reference first, then timed with ``triton.testing.do_bench`` (median). Prints the table
and a last line ``BEST block_n,partition,num_warps,num_stages`` (TOKENFLEET_ATTN_TUNING takes it).

    PYTHONPATH=$PWD python3 benchmarks/attention_sweep.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch


def main() -> None:
    from triton.testing import do_bench

    from tokenfleet.models.attention import PagedQueries, TorchPagedAttention
    from tokenfleet.models.triton_attention import TritonPagedAttention

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/reports")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1152)
    p.add_argument("--width", type=int, default=4112, help="table width in keys (max_model_len)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    dev, bs = torch.device("cuda"), 16
    width = -(-args.width // bs)
    blocks = args.batch * width + 8
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(args.kv_heads, blocks, bs, args.head_dim, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(args.batch, args.heads, args.head_dim, device=dev, generator=g, dtype=torch.bfloat16)
    table = torch.randperm(blocks, device=dev, generator=g)[: args.batch * width].view(args.batch, width)
    meta = PagedQueries(block_table=table, context_lens=torch.full((args.batch,), args.context, device=dev),
                        query_start=torch.arange(args.batch + 1, device=dev), num_tokens=args.batch, max_query_len=1)
    ref = TorchPagedAttention()(q, k, v, meta).float()
    kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * 2
    rows = []
    for block_n, partition, warps, stages in itertools.product((32, 64), (64, 128, 256, 512), (2, 4), (1, 3)):
        if partition % block_n:
            continue
        attend = TritonPagedAttention(block_n=block_n, partition=partition, num_warps=warps, num_stages=stages)
        try:
            out = attend(q, k, v, meta)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ms = do_bench(lambda: attend(q, k, v, meta), warmup=5, rep=20, return_mode="median")
        except Exception as e:  # a configuration the compiler refuses (shared memory, registers)
            rows.append({"block_n": block_n, "partition": partition, "num_warps": warps, "num_stages": stages,
                         "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"block_n": block_n, "partition": partition, "num_warps": warps, "num_stages": stages, "ms": ms,
                     "err": err, "gb_s": kv_bytes / ms / 1e6})
    ok = [r for r in rows if "ms" in r and r["err"] < 8e-3]
    ok.sort(key=lambda r: r["ms"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "attention-sweep.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    for r in ok[:12]:
        print(f"block_n {r['block_n']:3d} partition {r['partition']:4d} warps {r['num_warps']} stages {r['num_stages']}: "
              f"{r['ms'] * 1000:7.1f} us  {r['gb_s']:6.0f} GB/s  err {r['err']:.1e}")
    default = next((r for r in ok if (r["block_n"], r["partition"], r["num_warps"], r["num_stages"]) == (64, 256, 4, 3)), None)
    if default:
        print(f"default 64,256,4,3: {default['ms'] * 1000:.1f} us")
    best = ok[0]
    print(f"BEST {best['block_n']},{best['partition']},{best['num_warps']},{best['num_stages']}")


if __name__ == "__main__":
    main()
