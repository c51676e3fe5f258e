"""Decode-attention implementations on CPU, measured side by side (why models/attention.py is what it is).

For D decoding requests with L tokens of context each (GQA 9 query / 3 KV heads, head_dim 64,
bf16, 16-token blocks), one layer:
  token_major  KV as [slots, kv_heads, hd]; gather tokens, permute, batched matmuls
  block_major  KV as [kv_heads, blocks, block_size, hd]; index_select whole blocks, batched
               matmuls without permute copies (what the engine uses)
  engine       the engine's own _decode_attention (block_major, as shipped)
  fp32         block_major with K/V/Q upcast to fp32
  sdpa         block_major gather + torch SDPA with q_len=1 (enable_gqa)

    .venv/bin/python benchmarks/attention_impls.py [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tokenfleet.models.attention import ForwardBatch, _decode_attention

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
    names = ["token_major", "block_major", "engine", "fp32", "sdpa"]
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

        def block_major(upcast: bool = False):
            keys = k_blk.index_select(1, flat).view(KVH, d, length, HD)
            values = v_blk.index_select(1, flat).view(KVH, d, length, HD)
            qh = q.view(d, KVH, G, HD).transpose(0, 1)
            if upcast:
                keys, values, qh = keys.float(), values.float(), qh.float()
            s = torch.matmul(qh, keys.transpose(-1, -2)).float() * HD**-0.5 + bias
            return torch.matmul(torch.softmax(s, -1).to(values.dtype), values)

        batch = ForwardBatch(
            positions=pos, slot_mapping=pos, logits_indices=pos, num_decode=d, decode_block_ids=flat, decode_bias=bias
        )

        def engine():
            return _decode_attention(q, k_blk, v_blk, batch)

        def sdpa():
            keys = k_blk.index_select(1, flat).view(KVH, d, length, HD).transpose(0, 1)
            values = v_blk.index_select(1, flat).view(KVH, d, length, HD).transpose(0, 1)
            return F.scaled_dot_product_attention(q.view(d, KVH * G, 1, HD), keys, values, enable_gqa=True)

        times = [bench(token_major), bench(block_major), bench(engine), bench(lambda: block_major(True)), bench(sdpa)]
        print(f"{d:>3} {length:>5} | " + " ".join(f"{t:>11.2f}" for t in times))


if __name__ == "__main__":
    main()
