"""What ``--dtype auto`` serves on a device, decided from what the device can do, and why.

The rule (``choose_dtype``):

- a GPU, or FP8 weights (16-bit activations): bfloat16;
- a CPU whose flags list neither AVX512-BF16 nor AMX-BF16: float32 (torch's bf16 matmul is emulated there, ~1
  GFLOP/s on a Zen 3 against ~70 in fp32: `benchmarks/reports/2026-11-28-cpu-dtype-speed.md`);
- gguf and int8 records on a CPU with those instructions: bfloat16 where the native quantized matmul has its bf16
  path (``NativeQuantMatmul.has_bf16``: our own kernel, so the flags settle it), float32 otherwise;
- other records on a CPU with those instructions: a short measurement settles it (``measure_rates``: the model's
  gate/up matmul at 64 and 512 rows in both dtypes, ~0.3 s), bfloat16 when it is at least FAST_RATIO times fp32's
  rate at both sizes, else float32. The result is cached per machine (CPU model, flags, threads, torch) and model
  geometry in ``<cache>/auto-dtype.json``, so a restart does not measure again.

Greedy answers in bf16 may differ from fp32's only where the fp32 reference's top two tokens are near-ties (the
correctness gate, tests/integration/test_correctness_gate.py, holds the served default to that): a property of the
model, not of the dtype's speed, so it does not enter the choice.

A fleet serves one record's numerics: the worker that first resolves ``auto`` for a record pins its choice there
(cluster.registry ``ModelRecord.numerics``); the others serve the pinned dtype and say at registration when it is
not their own fastest (services.worker)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenfleet import envs
from tokenfleet.files import write_atomically

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names for native bf16 dot products
FAST_RATIO = 1.25  # bf16 must beat fp32 by this much at every measured size to be chosen
MEASURE_ROWS = (64, 512)  # a batch of decodes, a prefill chunk
MEASURE_SECONDS = 0.05  # per dtype and size, after a warm-up call
SOURCES = ("asked", "device", "flags", "kernel", "measured", "cached", "record")


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved dtype with its reason. ``source``: asked (not auto), device (GPU), flags (the CPU's flags settled
    it), kernel (the native quantized matmul's build settled it), measured (now), cached (an earlier measurement on
    this machine), record (the model record's pin, from the fleet's first worker). ``rates``: GFLOP/s per
    ``dtype@rows`` where measured."""

    dtype: str
    reason: str
    source: str
    rates: dict[str, float] = dataclasses.field(default_factory=dict)
    machine: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source {self.source!r} is not one of {', '.join(SOURCES)}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> DtypeChoice:
        data = json.loads(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def log_fields(self) -> dict[str, object]:
        return {"dtype": self.dtype, "source": self.source, "reason": self.reason, "rates_gflops": self.rates}


def cpu_model_and_flags(cpuinfo: str | None = None) -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags from /proc/cpuinfo (("", {}) where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor(), frozenset()
    name, flags = "", frozenset[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return name, flags


def measure_rates(hidden: int, intermediate: int, rows: tuple[int, ...] = MEASURE_ROWS,
                  seconds: float = MEASURE_SECONDS) -> dict[str, float]:
    """GFLOP/s of ``F.linear`` [rows, hidden] x [intermediate, hidden]^T per ``dtype@rows``, on torch's current
    threads (the worker's, when called from the builder)."""
    rates = {}
    for m in rows:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, hidden).to(dtype)
            w = torch.randn(intermediate, hidden).to(dtype)
            torch.nn.functional.linear(x, w)  # warm-up: oneDNN builds its kernel for the shape
            n, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds or n < 2:
                torch.nn.functional.linear(x, w)
                n += 1
            rates[f"{_short(dtype)}@{m}"] = round(2 * m * hidden * intermediate * n / elapsed / 1e9, 1)
    return rates


def choose_dtype(requested: str, device: torch.device, quantization: str = "", hidden: int = 576,
                 intermediate: int = 1536, *, cache: Path | None = None, cpuinfo: str | None = None,
                 measure: Callable[[int, int], dict[str, float]] = measure_rates,
                 native_bf16: Callable[[], bool] | None = None) -> DtypeChoice:
    """``requested``, or for "auto" the fastest dtype here (the module docstring's rule). ``cache``: the cache
    file (default ``<cache dir>/auto-dtype.json``); ``cpuinfo``, ``measure`` and ``native_bf16``: the machine's
    facts, replaceable in tests."""
    if requested != "auto":
        return DtypeChoice(requested, "asked for", "asked")
    if device.type != "cpu":
        return DtypeChoice("bfloat16", f"{device.type}: bf16 tensor cores", "device")
    if quantization == "fp8":
        return DtypeChoice("bfloat16", "fp8 weights multiply 16-bit activations", "flags")
    name, flags = cpu_model_and_flags(cpuinfo)
    has = [f for f in BF16_FLAGS if f in flags]
    if flags and not has:
        return DtypeChoice("float32", "no AVX512-BF16 or AMX-BF16 on this CPU: torch's bf16 matmul is emulated",
                           "flags", machine=name)
    if quantization in ("gguf", "int8"):
        fast = (native_bf16 or _native_quant_bf16)()
        return DtypeChoice("bfloat16" if fast else "float32",
                           "the native quantized matmul's AVX512-BF16 path" if fast else
                           "the native quantized matmul has no bf16 path here", "kernel", machine=name)
    path = cache or envs.cache_dir() / "auto-dtype.json"
    key = _cache_key(name, flags, hidden, intermediate)
    cached = read_cache(path).get(key)
    if cached is not None:
        return dataclasses.replace(DtypeChoice.from_json(cached), source="cached")
    rates = measure(hidden, intermediate)
    ratios = [rates[f"bf16@{m}"] / max(rates[f"fp32@{m}"], 1e-9) for m in MEASURE_ROWS]
    fast = all(r >= FAST_RATIO for r in ratios)
    shown = ", ".join(f"{r:.2f}x at {m} rows" for r, m in zip(ratios, MEASURE_ROWS, strict=True))
    flags_named = "/".join(f.upper().replace("_", "-") for f in has) or "no flags read"
    choice = DtypeChoice("bfloat16" if fast else "float32",
                         f"{flags_named}: bf16 matmul {shown} fp32's" +
                         ("" if fast else f" (bf16 needs >= {FAST_RATIO}x at every size)"),
                         "measured", rates, name)
    write_cache(path, key, choice.to_json())
    return choice


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def _native_quant_bf16() -> bool:
    from tokenfleet.models.quant_linear import native_quant_matmul

    kernel = native_quant_matmul()
    return kernel is not None and kernel.has_bf16


def machine_key(*parts: str) -> str:
    """A cache key for a choice measured on this machine: ``parts`` (the CPU's model and flags, the model's geometry...)
    with torch's threads and version."""
    text = "\x00".join([*parts, str(torch.get_num_threads()), torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _cache_key(name: str, flags: frozenset[str], hidden: int, intermediate: int) -> str:
    return machine_key(name, " ".join(sorted(flags)), f"{hidden}x{intermediate}")


def read_cache(path: Path) -> dict:
    """A choices cache file's entries ({} when missing or unreadable: the choice is measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, key: str, value: object) -> None:
    """Add ``key``: ``value`` to a choices cache file (atomically; a read-only cache is skipped: the next start
    measures again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**read_cache(path), key: value}
        write_atomically(path, json.dumps(data, sort_keys=True, indent=1).encode(), 0o644)
    except OSError:
        return
