#!/usr/bin/env python3
"""Compile the engine's Triton kernels for Hopper (sm_90a) on a machine without a GPU; print their resources.

The GPU machines are lent rarely and briefly; a kernel that does not compile for the real target would cost such a
session its minutes, while Triton's interpreter (the CPU tests) never compiles anything. Triton brings its own
ptxas and cuobjdump, so the whole path from the kernel source to a Hopper cubin runs here: each variant the engine
launches (both benchmark geometries' shapes, the settings' defaults, the opt-in paths) is compiled and its
registers, spills (local memory) and shared memory are read from the cubin. A spill or a register count at the
limit (255) is where a kernel's time may go before it ever runs.

    python scripts/triton_sm90.py [--only NAME_SUBSTRING] [--json OUT]

Exit status 1 if any variant fails to compile. Divisibility hints (16) are given where launches get them (every
pointer; strides and sizes that are multiples of 16 in these shapes), as a real launch would specialize.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # kernels defined for the interpreter never compile
    sys.exit("scripts/triton_sm90.py compiles for the GPU: run it without TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tokenfleet.models import triton_attention, triton_linear, triton_logits, triton_ops  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@dataclass
class Variant:
    name: str
    fn: object
    types: dict[str, str]  # runtime arguments: "*bf16", "i32", "fp32", ...
    consts: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3
    aligned: set[str] = field(default_factory=set)  # integer arguments that are multiples of 16 here


def attention(geometry: str, *, partition: int, fused: bool = False, fp8: bool = False, work: bool = False,
              tokens: int = 4, block_n: int = 64, warps: int = 0, stages: int = 3) -> Variant:
    """``warps`` 0: what the kernel's launch picks for the tile's rows (tokens x 4 heads) and cache (its stages too)."""
    group, head_dim = (4, 128) if geometry == "8b" else (3, 64)
    if not warps:
        attend = triton_attention.TritonPagedAttention(block_n=block_n, num_warps=4, num_stages=stages)
        warps, stages = attend.launch_shape(tokens * 4, fp8)
    cache = "*u8" if fp8 else "*bf16"
    types = {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "ks_ptr": "*fp32" if fp8 else cache,
             "vs_ptr": "*fp32" if fp8 else cache, "out_ptr": "*bf16", "table_ptr": "*i64", "ctx_ptr": "*i64",
             "qstart_ptr": "*i64", "sm_scale": "fp32", "window": "i32", "stride_qt": "i32", "stride_qh": "i32",
             "stride_kh": "i32", "stride_kb": "i32", "stride_ks": "i32", "stride_ot": "i32", "stride_oh": "i32",
             "stride_table": "i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
             "num_kv_heads": "i32", "num_parts": "i32", "work_req_ptr": "*i64", "work_tile_ptr": "*i64",
             "counter_ptr": "*i32"}
    consts = dict(GROUP=group, GROUP_PAD=4, TOKENS=tokens, HEAD_DIM=head_dim, HEAD_PAD=head_dim, BLOCK_SIZE=16,
                  BLOCK_N=block_n, FP32_DOT=False, INTERPRETED=False, PARTITION=partition, FP8_KV=fp8, PV=2,
                  WORK=work, FUSED_MERGE=fused)
    label = (f"attention {geometry} " + ("work-list" if work else f"split {partition}" if partition else
                                        "prefix-prefill" if tokens > 4 else "unsplit")
             + (" fused-merge" if fused else "") + (" fp8-kv" if fp8 else "") + f" [{block_n},{warps},{stages}]")
    return Variant(label, triton_attention.paged_attention_kernel, types, consts, warps, stages,
                   {"stride_qt", "stride_qh", "stride_kh", "stride_kb", "stride_ks", "stride_ot", "stride_oh"})


def specs(attention_warps: int = 0) -> list[Variant]:
    out = []
    w = attention_warps
    for geometry in ("8b", "smollm2"):
        out += [attention(geometry, partition=256, warps=w), attention(geometry, partition=256, fused=True, warps=w),
                attention(geometry, partition=64, warps=w), attention(geometry, partition=256, stages=2, warps=w),
                attention(geometry, partition=0, warps=w), attention(geometry, partition=256, fp8=True, warps=w),
                attention(geometry, partition=0, work=True, tokens=32, warps=w),
                attention(geometry, partition=0, work=True, tokens=32, fp8=True, warps=w),
                attention(geometry, partition=0, tokens=32, warps=w),  # a prefill chunk over a cached prefix
                attention(geometry, partition=0, tokens=32, fp8=True, warps=w)]
        group, head_dim = (4, 128) if geometry == "8b" else (3, 64)
        out.append(Variant(f"attention merge {geometry}", triton_attention._merge_partitions,
                           {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "out_ptr": "*bf16",
                            "ctx_ptr": "*i64", "qstart_ptr": "*i64", "window": "i32", "num_kv_heads": "i32",
                            "num_parts": "i32", "stride_ot": "i32", "stride_oh": "i32"},
                           dict(GROUP=group, GROUP_PAD=4, TOKENS=4, HEAD_DIM=head_dim, HEAD_PAD=head_dim, BLOCK_N=64,
                                PARTITION=256, INTERPRETED=False), 4, 3, {"stride_ot", "stride_oh"}))
    hidden, heads, kv_heads = 4096, 32, 8
    for fp8 in (False, True):
        out.append(Variant(f"rope + kv write 8b{' fp8-kv' if fp8 else ''}", triton_ops._rope_store_kv_kernel,
                           {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                            "slot_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16",
                            "k_cache_ptr": "*u8" if fp8 else "*bf16", "v_cache_ptr": "*u8" if fp8 else "*bf16",
                            "ks_ptr": "*fp32" if fp8 else "*bf16", "vs_ptr": "*fp32" if fp8 else "*bf16",
                            "stride_qkv": "i32", "stride_cache_head": "i32"},
                           dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=128, HEADS_PAD=32, FP8_KV=fp8,
                                ROW=144 if fp8 else 128), 4, 3, {"stride_qkv", "stride_cache_head"}))
    out += [Variant("add + rms norm 8b", triton_ops._add_rms_norm_kernel,
                    {"res_ptr": "*bf16", "delta_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "hidden": "i32",
                            "eps": "fp32"}, dict(HAS_DELTA=True, BLOCK=hidden), 4, 3, {"hidden"}),
            Variant("silu * up 8b", triton_ops._silu_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32"},
                    dict(BLOCK=2048), 4, 3, {"inter"}),
            Variant("fp8 activation quantize 8b", triton_ops._quantize_fp8_kernel,
                    {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "cols": "i32"},
                    dict(BLOCK=16384), 16, 3, {"cols"})]
    for rows, flags in ((False, False), (True, False), (False, True)):
        tag = "rows" if rows else "flags" if flags else "all"
        out.append(Variant(f"logits top-k chunks ({tag})", triton_logits._chunk_top_kernel,
                           {"logits_ptr": "*fp32", "row_ids_ptr": "*i64" if rows else "*fp32", "val_ptr": "*fp32",
                            "idx_ptr": "*i32", "vocab": "i32", "stride_l": "i32", "num_chunks": "i32"},
                           dict(K=8, BLOCK_K=8, CHUNK_SIZE=triton_logits.CHUNK, HAS_ROW_IDS=rows), 4, 3,
                           {"vocab", "stride_l"}))
        out.append(Variant(f"logits refine 8b ({tag})", triton_logits._refine_top_kernel,
                           {"logits_ptr": "*fp32", "hidden_ptr": "*bf16", "head_ptr": "*bf16",
                            "row_ids_ptr": "*i64" if rows else "*fp32", "flags_ptr": "*i1" if flags else "*fp32",
                            "val_ptr": "*fp32", "idx_ptr": "*i32", "stride_l": "i32", "stride_h": "i32",
                            "stride_w": "i32", "num_candidates": "i32"},
                           dict(HIDDEN=hidden, K=8, BLOCK_K=8, BLOCK_C=512, BLOCK_H=256, HAS_ROW_IDS=rows,
                                HAS_FLAGS=flags), 4, 3, {"stride_l", "stride_h", "stride_w"}))
    out += [Variant("argmax chunks", triton_logits._chunk_max_kernel,
                    {"logits_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32", "vocab": "i32", "stride_l": "i32",
                     "num_chunks": "i32"}, dict(CHUNK_SIZE=triton_logits.CHUNK), 4, 3, {"vocab", "stride_l"}),
            Variant("argmax pick", triton_logits._pick_max_kernel,
                    {"val_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64", "num_chunks": "i32"},
                    dict(BLOCK_C=64), 4, 3)]
    # the 8B layers, the 8B LM head (bf16 path only: FP8 models keep it in bf16 for cuBLAS), SmolLM2's qkv (K = 576:
    # not a multiple of block_k); one row as a batch-1 launch gets it (Triton makes an int argument of 1 a constant)
    for n, k, layer, rows in ((6144, 4096, "8b qkv", 0), (6144, 4096, "8b qkv", 1), (4096, 4096, "8b o_proj", 0),
                              (28672, 4096, "8b gate_up", 0), (4096, 14336, "8b down", 0),
                              (128256, 4096, "8b lm_head", 0), (960, 576, "smollm2 qkv", 0)):
        for fp8 in ((False,) if "lm_head" in layer else (True, False)):
            consts = dict(N=n, K=k, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, EVEN_K=k % 256 == 0, FP32_DOT=False,
                          HAS_SCALE=fp8, **({"rows": 1} if rows else {}))
            types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "scale_ptr": "*fp32" if fp8 else "*bf16",
                     "out_ptr": "*bf16", "rows": "i32", "stride_x": "i32", "stride_o": "i32"}
            out.append(Variant(f"few-rows matmul {layer} {'fp8' if fp8 else 'bf16'}{' (1 row)' if rows else ''}",
                               triton_linear._fp8_weight_matmul_kernel, types, consts, 4, 4,
                               {"stride_x", "stride_o"} if k % 16 == 0 else set()))
    return out


def compile_variant(v: Variant, folder: Path) -> dict:
    fn = v.fn
    names = fn.arg_names  # type: ignore[attr-defined]
    signature = {a: ("constexpr" if a in v.consts else v.types[a]) for a in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if a not in v.consts and (v.types[a].startswith("*") or a in v.aligned)}
    started = time.time()
    kernel = triton.compile(ASTSource(fn, signature, v.consts, attrs), target=TARGET,
                            options=dict(num_warps=v.num_warps, num_stages=v.num_stages))
    cubin = folder / f"{abs(hash(v.name))}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    # global -> shared copies by width: how wide the tiles' loads are vectorized (16 bytes at best)
    copies = collections.Counter(int(n, 16) for n in re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], "
                                                                 r"(0x[0-9a-f]+)", kernel.asm["ptx"]))
    usage = subprocess.run([str(CUOBJDUMP), "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    found = {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    return {"name": v.name, "registers": found.get("REG"), "stack": found.get("STACK"), "local": found.get("LOCAL"),
            "shared": max(found.get("SHARED", 0), kernel.metadata.shared), "warps": v.num_warps,
            "stages": v.num_stages, "async_copy_bytes": dict(sorted(copies.items())),
            "seconds": round(time.time() - started, 1)}


def spills(row: dict) -> bool:
    return bool(row["local"] or row["stack"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="variants whose name contains this")
    p.add_argument("--json", default="", help="write the table here too")
    p.add_argument("--attention-warps", type=int, default=0, help="force the attention kernel's warps (0: what its "
                   "launch picks)")
    args = p.parse_args()
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp  # a fresh compile each run, not a cached one
        for v in specs(args.attention_warps):
            if args.only not in v.name:
                continue
            try:
                row = compile_variant(v, Path(tmp))
            except Exception as e:  # noqa: BLE001 - the report lists every failure
                failed.append(v.name)
                print(f"FAILED  {v.name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
                continue
            rows.append(row)
            spill = " SPILLS" if spills(row) else ""
            print(f"{row['name']:48s} regs {row['registers']:3d}  stack {row['stack']:4d} B  local {row['local']:4d} B"
                  f"  shared {row['shared']:6d} B  ({row['warps']} warps, {row['stages']} stages, {row['seconds']} s)"
                  f"  async copies {row['async_copy_bytes']}{spill}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"target": "sm_90a", "triton": triton.__version__, "rows": rows,
                                               "failed": failed}, indent=1))
    print(f"{len(rows)} compiled, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
