"""Where a bf16 prefill chunk's attention runs on a CPU, decided from what the CPU does with it.

Two choices compute the same thing (each query row sees its prompt's keys up to itself, scores, softmax and P.V
accumulated in fp32): the native paged kernel (csrc/paged_attention.c, every row of a step in one call, keys read from
the cache, AVX-512 fp32 FMAs) and torch's SDPA per prefill chunk (its CPU flash attention: bf16 tiles through
oneDNN's brgemm, which runs on AMX where the CPU has it). Which is faster depends on the machine: on the 2-core AMD
EPYCs the native kernel was 1.6-3.3x SDPA (benchmarks/prefill_attention.py), on a 2-core Intel Xeon with AMX SDPA is
1.3x the kernel at a 256-token prompt and 3.2x at 2,048. Decode rows stay in the native kernel either way.

``choose``: a short measurement (~30 ms: a 512-token prompt, a 256-token chunk after 768 tokens of context, in the
model's geometry, alternating), SDPA when it is at least FAST_RATIO times the kernel's speed over both, cached per
machine (CPU model, flags, threads, torch) and geometry in ``<cache>/prefill-attention.json``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from tokenfleet import envs
from tokenfleet.models.attention import NativePagedAttention, PagedQueries, _gather, _prefill_attention
from tokenfleet.models.auto_dtype import cpu_model_and_flags, machine_key, read_cache, write_cache

FAST_RATIO = 1.1  # SDPA must beat the kernel by this much to take the prefill chunks
CASES = ((0, 512), (768, 256))  # (context before the chunk, chunk tokens)
REPEATS = 3

log = structlog.get_logger()


@dataclass(frozen=True)
class PrefillChoice:
    in_kernel: bool  # True: the native kernel attends prefill chunks too; False: SDPA per chunk
    kernel_ms: float  # the measured cases' total, each case's best of REPEATS
    sdpa_ms: float
    source: str = "measured"  # or "cached"

    @property
    def reason(self) -> str:
        where = "native kernel" if self.in_kernel else "SDPA"
        return (f"prefill attention in the {where}: kernel {self.kernel_ms:.2f} ms, SDPA {self.sdpa_ms:.2f} ms over "
                f"a 512-token prompt and a 256-token chunk after 768 ({self.source})")


def measure(attend: NativePagedAttention, num_heads: int, num_kv_heads: int, head_dim: int,
            block_size: int) -> tuple[float, float]:
    """(kernel ms, SDPA ms) over CASES, each case's best of REPEATS, the two alternating."""
    g = torch.Generator().manual_seed(7)
    blocks = -(-max(context + rows for context, rows in CASES) // block_size)
    k_cache = torch.randn(num_kv_heads, blocks, block_size, head_dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_kv_heads, blocks, block_size, head_dim, generator=g).to(torch.bfloat16)
    kernel_ms = sdpa_ms = 0.0
    for context, rows in CASES:
        q = torch.randn(rows, num_heads, head_dim, generator=g).to(torch.bfloat16)
        kernel_s, sdpa_s = _time_case(attend, q, k_cache, v_cache, context, block_size)
        kernel_ms += kernel_s * 1e3
        sdpa_ms += sdpa_s * 1e3
    return kernel_ms, sdpa_ms


def _time_case(attend: NativePagedAttention, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               context: int, block_size: int) -> tuple[float, float]:
    """Best seconds of the kernel and of SDPA for the chunk ``q`` after ``context`` tokens (blocks 0, 1, ...)."""
    rows = q.shape[0]
    length = context + rows
    ids = torch.arange(-(-length // block_size))
    meta = PagedQueries(block_table=ids[None], context_lens=torch.tensor([length]),
                        query_start=torch.tensor([0, rows]), num_tokens=rows, max_query_len=rows)

    def sdpa() -> None:
        keys = _gather(k_cache, ids, q.dtype)[:, :length]
        values = _gather(v_cache, ids, q.dtype)[:, :length]
        _prefill_attention(q, keys, values, context)

    best = [float("inf"), float("inf")]
    for _ in range(REPEATS + 1):  # the first round warms both up
        for i, fn in enumerate((lambda: attend(q, k_cache, v_cache, meta), sdpa)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def choose(attend: NativePagedAttention, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, *,
           cache: Path | None = None, timer: Callable[..., tuple[float, float]] = measure) -> PrefillChoice:
    """Whether ``attend`` keeps the prefill chunks (the module docstring's rule), measured or cached."""
    name, flags = cpu_model_and_flags()
    path = cache or envs.cache_dir() / "prefill-attention.json"
    key = machine_key(name, " ".join(sorted(flags)), attend.build, f"{num_heads}/{num_kv_heads}x{head_dim}/{block_size}")
    stored = read_cache(path).get(key)
    if isinstance(stored, dict):
        try:
            choice = dataclasses.replace(PrefillChoice(**stored), source="cached")
        except TypeError:  # another version's fields: measure again
            pass
        else:
            _log(choice)
            return choice
    kernel_ms, sdpa_ms = timer(attend, num_heads, num_kv_heads, head_dim, block_size)
    choice = PrefillChoice(in_kernel=not sdpa_ms * FAST_RATIO <= kernel_ms, kernel_ms=round(kernel_ms, 3),
                           sdpa_ms=round(sdpa_ms, 3))
    write_cache(path, key, {f.name: getattr(choice, f.name) for f in dataclasses.fields(choice) if f.name != "source"})
    _log(choice)
    return choice


def _log(choice: PrefillChoice) -> None:
    log.info("prefill_attention", where="kernel" if choice.in_kernel else "sdpa", kernel_ms=choice.kernel_ms,
             sdpa_ms=choice.sdpa_ms, source=choice.source)

