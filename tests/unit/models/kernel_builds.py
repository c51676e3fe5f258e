"""The builds of csrc/paged_attention.c a test can ask for, and which code path each work item should take.

- ``native``: what this machine compiles with -march=native: the AVX-512 branch where the CPU has avx512f,
  avx512bw and avx512_bf16, else the portable C.
- ``avx512``: the same build, asked for as the AVX-512 branch on real instructions: skipped (with the reason) on a
  CPU without them.
- ``emulated-avx512``: the AVX-512 branch through SIMDe's portable intrinsics (csrc/simde_avx512.h; the simde-py
  package's headers), on any x86-64 CPU: the branch's logic is tested where the instructions are missing.
- ``portable``: -DTF_PORTABLE_ONLY, the plain C every machine can run.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from tokenfleet.models import native
from tokenfleet.models.attention import NativePagedAttention

AVX512_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
BUILDS = ("native", "avx512", "emulated-avx512", "portable")
ROWS_PER_ITEM, PACK_MIN_VECTORS = 32, 12  # paged_attention.c's work-item rows and packed-scores threshold


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_avx512_bf16() -> bool:
    return all(f in cpu_flags() for f in AVX512_FLAGS)


def simde_include() -> str | None:
    try:
        import simde_py
    except ImportError:
        return None
    return simde_py.get_include()


def attention_build(build: str, fp8: bool = False, dtype: torch.dtype = torch.bfloat16) -> NativePagedAttention:
    """The kernel of ``build``, or a skip saying why this machine cannot run it."""
    if native.compiler() is None:
        pytest.skip("no C compiler: only the torch reference runs here")
    defines: tuple[str, ...] = ()
    includes: tuple[str, ...] = ()
    if build == "avx512" and not has_avx512_bf16():
        missing = [f for f in AVX512_FLAGS if f not in cpu_flags()]
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the AVX-512 branch runs here only as emulated-avx512")
    if build == "emulated-avx512":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("the emulated AVX-512 build is for x86-64 machines")
        include = simde_include()
        if include is None:
            pytest.skip("simde-py (a dev dependency) is not installed: no SIMDe headers to emulate AVX-512 with")
        defines, includes = ("TF_EMULATE_AVX512",), (include,)
    if build == "portable":
        defines = ("TF_PORTABLE_ONLY",)
    lib = native.load("paged_attention", defines, includes)
    assert lib is not None, f"a compiler is present but the {build} build failed (see the log)"
    kernel = NativePagedAttention(lib, fp8=fp8, dtype=dtype)
    expected = {"native": "AVX-512 BF16" if has_avx512_bf16() else "portable C", "avx512": "AVX-512 BF16",
                "emulated-avx512": "AVX-512 BF16 emulated", "portable": "portable C"}[build]
    assert kernel.build == expected, f"{build} build reports {kernel.build!r}"
    return kernel


def expected_paths(kernel: NativePagedAttention, rows: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, window: int) -> dict[str, int]:
    """Work items per path the kernel should run for requests of ``rows`` query rows (csrc/paged_attention.c:
    items of up to 32 rows per request and KV head; the AVX-512 branch takes head_dim 64, blocks of a multiple of
    16 and no window; its packed scores serve items of at least 12 query vectors)."""
    counts = dict.fromkeys(NativePagedAttention.PATHS, 0)
    group = num_heads // num_kv_heads
    avx = (kernel.build != "portable C" and kernel.dtype == torch.bfloat16 and head_dim == 64 and block_size % 16 == 0
           and window == 0)
    for n in rows:
        for row1 in range(n, 0, -ROWS_PER_ITEM):
            vectors = (row1 - max(0, row1 - ROWS_PER_ITEM)) * group
            path = "portable" if not avx else "avx512-packed" if vectors >= PACK_MIN_VECTORS else "avx512-reduce"
            counts[path] += num_kv_heads
    return counts
