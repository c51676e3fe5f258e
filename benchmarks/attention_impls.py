"""Decode-attention implementations on CPU, measured side by side (why models/attention.py is what it is).

For D decoding requests with L tokens of context each (GQA 9 query / 3 KV heads, head_dim 64,
bf16, 16-token blocks), one layer:
  token_major  KV as [slots, kv_heads, hd]; gather tokens, permute, batched matmuls
  block_major  KV as [kv_heads, blocks, block_size, hd]; index_select whole blocks, batched
               matmuls without permute copies (what the engine uses)
  bf16_scores  block_major with bf16 scores (the engine before its scores were fp32: rounded scores moved greedy
               decoding off the fp32 path)
  reference    TorchPagedAttention: block_major with fp32 scores/softmax/P.V (the pure-torch path)
  native       NativePagedAttention: csrc/paged_attention.c, blocks read in place, fp32 math (the
               engine's bf16 CPU path when a C compiler is present)
  sdpa         block_major gather + torch SDPA with q_len=1 (enable_gqa)

    .venv/bin/python benchmarks/attention_impls.py [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tokenfleet.models import native
from tokenfleet.models.attention import NativePagedAttention, PagedQueries, TorchPagedAttention

KVH, G, HD, BS, NUM_BLOCKS = 3, 3, 64, 16, 4096


def bench(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dt = torch.bfloat16
    torch.manual_seed(0)
    k_tok = torch.randn(NUM_BLOCKS * BS, KVH, HD, dtype=dt)
    v_tok = torch.randn(NUM_BLOCKS * BS, KVH, HD, dtype=dt)
    k_blk = k_tok.view(NUM_BLOCKS, BS, KVH, HD).permute(2, 0, 1, 3).contiguous()
    v_blk = v_tok.view(NUM_BLOCKS, BS, KVH, HD).permute(2, 0, 1, 3).contiguous()
    print(f"threads={torch.get_num_threads()}  ms per layer")
    names = ["token_major", "bf16_scores", "reference", "native", "sdpa"]
    lib = native.load("paged_attention")
    native_kernel = NativePagedAttention(lib) if lib is not None else None
    print(f"{'D':>3} {'L':>5} | " + " ".join(f"{n:>11}" for n in names))
    for d, length in ((1, 320), (8, 320), (32, 320), (64, 320), (32, 1024)):
        nb = length // BS
        tables = torch.randperm(NUM_BLOCKS)[: d * nb].view(d, nb)
        flat = tables.flatten()
        pos = torch.arange(length)
        slots = tables[:, pos // BS] * BS + pos % BS
        q = torch.randn(d, KVH * G, HD, dtype=dt)
        bias = torch.zeros(1, d, 1, length)

        def token_major():
            keys = k_tok[slots].permute(0, 2, 3, 1)
            values = v_tok[slots].transpose(1, 2)
            s = torch.matmul(q.view(d, KVH, G, HD), keys).float() * HD**-0.5 + bias.view(d, 1, 1, length)
            return torch.matmul(torch.softmax(s, -1).to(dt), values)

        def block_major():
            keys = k_blk.index_select(1, flat).view(KVH, d, length, HD)
            values = v_blk.index_select(1, flat).view(KVH, d, length, HD)
            qh = q.view(d, KVH, G, HD).transpose(0, 1)
            s = torch.matmul(qh, keys.transpose(-1, -2)).float() * HD**-0.5 + bias
            return torch.matmul(torch.softmax(s, -1).to(values.dtype), values)

        meta = PagedQueries(tables, torch.full((d,), length), torch.arange(d + 1), d, 1)

        def reference():
            return TorchPagedAttention()(q, k_blk, v_blk, meta)

        def native_call():
            return native_kernel(q, k_blk, v_blk, meta) if native_kernel is not None else None

        def sdpa():
            keys = k_blk.index_select(1, flat).view(KVH, d, length, HD).transpose(0, 1)
            values = v_blk.index_select(1, flat).view(KVH, d, length, HD).transpose(0, 1)
            return F.scaled_dot_product_attention(q.view(d, KVH * G, 1, HD), keys, values, enable_gqa=True)

        times = [bench(token_major), bench(block_major), bench(reference), bench(native_call), bench(sdpa)]
        print(f"{d:>3} {length:>5} | " + " ".join(f"{t:>11.2f}" for t in times))


if __name__ == "__main__":
    main()
