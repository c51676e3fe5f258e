"""Capacity arithmetic for a model on a GPU layout (``tokenfleet plan``): memory, KV budget,
resident tokens, roofline prefill and decode times, tokens/s per replica, replicas for a rate.

Units: bytes and seconds; "GB" in presets and flags is 10^9 bytes (vendors' unit). The roofline
takes the larger of the compute time (FLOPs / peak x efficiency) and the memory time (bytes /
HBM bandwidth x efficiency) per phase; tensor parallelism divides both; its two all-reduces of the
activations per layer over NVLink overlap a prefill's compute (the larger of the two counts) and add
to a decode step (small messages). It is a bound and a planning number, not a promise:
calibrate the efficiencies against a measured engine (``tokenfleet simulate calibrate``, later).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GB = 1e9
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    fp8_flops: float | None  # dense; None: no FP8 tensor cores (FP8 weights compute in bf16)
    nvlink_bytes_per_s: float  # per GPU, one direction

    def flops(self, dtype: str) -> float:
        return self.fp8_flops if dtype == "fp8" and self.fp8_flops else self.bf16_flops


GPUS = {
    "h100": GPU("H100 SXM 80GB", 80 * GB, 3.35e12, 989e12, 1979e12, 450e9),
    "h200": GPU("H200 141GB", 141 * GB, 4.8e12, 989e12, 1979e12, 450e9),
    "a100": GPU("A100 SXM 80GB", 80 * GB, 2.039e12, 312e12, None, 300e9),
}


@dataclass(frozen=True)
class Model:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @property
    def num_params(self) -> float:
        """Decoder weights: attention (q, o full; k, v by KV heads), SwiGLU MLP, embeddings in and out."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp) + 2 * self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, kv_dtype: str) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

    @classmethod
    def from_config(cls, path: str | Path) -> Model:
        """An HF ``config.json`` (Llama-family keys)."""
        c = json.loads(Path(path).read_text())
        heads = int(c["num_attention_heads"])
        return cls(name=c.get("_name_or_path") or Path(path).parent.name, num_layers=int(c["num_hidden_layers"]),
                   hidden_size=int(c["hidden_size"]), num_heads=heads,
                   num_kv_heads=int(c.get("num_key_value_heads", heads)),
                   head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                   intermediate_size=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]))


MODELS = {  # Llama-3-class GQA geometries
    "llama3-8b": Model("Llama-3 8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama3-70b": Model("Llama-3 70B", 80, 8192, 64, 8, 128, 28672, 128256),
    "llama3-405b": Model("Llama-3 405B", 126, 16384, 128, 8, 128, 53248, 128256),
}


@dataclass(frozen=True)
class Layout:
    gpu: GPU
    tp: int = 1
    pp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    reserve_bytes: float = 0.0  # per replica: activations, CUDA graphs, fragmentation
    prefill_efficiency: float = 0.5  # share of peak FLOPs a prefill reaches
    decode_efficiency: float = 0.7  # share of HBM bandwidth a decode step reaches

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class Plan:
    """What ``plan`` reports for one replica (a TP x PP group of GPUs)."""

    weight_bytes_per_gpu: float
    kv_bytes_per_token: float
    kv_budget_bytes: float
    resident_tokens: int
    max_concurrent: int  # requests of ``context`` tokens that fit at once
    prefill_seconds: float  # one prompt of ``prompt_tokens``
    decode_step_seconds: float  # one step of ``batch`` requests at ``context``
    tokens_per_s: float  # batch / step time
    replicas_for_target: int | None

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def weight_bytes(model: Model, dtype: str, params: float | None = None) -> float:
    return (params if params is not None else model.num_params) * DTYPE_BYTES[dtype]


def kv_budget(model: Model, layout: Layout, weights: float | None = None) -> float:
    total = layout.num_gpus * layout.gpu.memory_bytes
    used = weight_bytes(model, layout.weight_dtype) if weights is None else weights
    return max(0.0, total - used - layout.reserve_bytes)


def resident_tokens(model: Model, layout: Layout, weights: float | None = None) -> int:
    return int(kv_budget(model, layout, weights) // model.kv_bytes_per_token(layout.kv_dtype))


def prefill_seconds(model: Model, layout: Layout, prompt_tokens: int) -> float:
    """Compute-bound in practice: 2 FLOPs per weight per token plus attention's quadratic term."""
    gpu, n = layout.gpu, layout.num_gpus
    attention = 2 * model.num_layers * prompt_tokens ** 2 * model.num_heads * model.head_dim  # QK^T and PV, causal
    flops = 2 * model.num_params * prompt_tokens + attention
    compute = flops / (n * gpu.flops(layout.weight_dtype) * layout.prefill_efficiency)
    memory = weight_bytes(model, layout.weight_dtype) / (n * gpu.hbm_bytes_per_s)
    return max(compute, memory, _allreduce_seconds(model, layout, prompt_tokens))  # TP comms overlap compute


def decode_step_seconds(model: Model, layout: Layout, batch: int, context: int) -> float:
    """Memory-bound in practice: every step reads the weights once and each request's KV."""
    gpu, n = layout.gpu, layout.num_gpus
    read = weight_bytes(model, layout.weight_dtype) + batch * context * model.kv_bytes_per_token(layout.kv_dtype)
    memory = read / (n * gpu.hbm_bytes_per_s * layout.decode_efficiency)
    compute = 2 * model.num_params * batch / (n * gpu.flops(layout.weight_dtype) * layout.prefill_efficiency)
    return max(memory, compute) + _allreduce_seconds(model, layout, batch)  # small messages: latency, not hidden


def _allreduce_seconds(model: Model, layout: Layout, tokens: int) -> float:
    """Two ring all-reduces of the activations per layer (attention and MLP outputs) under TP."""
    if layout.tp == 1:
        return 0.0
    volume = 2 * (layout.tp - 1) / layout.tp * tokens * model.hidden_size * DTYPE_BYTES["bf16"]
    return 2 * model.num_layers * volume / layout.gpu.nvlink_bytes_per_s


def replicas_for(target_tokens_per_s: float, per_replica_tokens_per_s: float) -> int:
    if per_replica_tokens_per_s <= 0:
        raise ValueError("a replica must produce tokens")
    return math.ceil(target_tokens_per_s / per_replica_tokens_per_s - 1e-9)


def plan(model: Model, layout: Layout, context: int = 4096, prompt_tokens: int = 3000, batch: int = 64,
         target_tokens_per_s: float | None = None, weights_bytes: float | None = None) -> Plan:
    weights = weight_bytes(model, layout.weight_dtype) if weights_bytes is None else weights_bytes
    tokens = resident_tokens(model, layout, weights)
    step = decode_step_seconds(model, layout, batch, context)
    rate = batch / step
    return Plan(
        weight_bytes_per_gpu=weights / layout.num_gpus,
        kv_bytes_per_token=model.kv_bytes_per_token(layout.kv_dtype),
        kv_budget_bytes=kv_budget(model, layout, weights),
        resident_tokens=tokens,
        max_concurrent=tokens // context,
        prefill_seconds=prefill_seconds(model, layout, prompt_tokens),
        decode_step_seconds=step,
        tokens_per_s=rate,
        replicas_for_target=replicas_for(target_tokens_per_s, rate) if target_tokens_per_s else None,
    )


# ---- the CLI ----------------------------------------------------------------------------------------------------
def add_command(sub: Any) -> None:
    p = sub.add_parser("plan", help="capacity arithmetic: memory, KV budget, concurrency, roofline speeds, replicas")
    p.add_argument("--model", default="llama3-70b",
                   help=f"a preset ({', '.join(MODELS)}) or an HF config.json")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--weight-dtype", default="fp8", choices=sorted(DTYPE_BYTES))
    p.add_argument("--kv-dtype", default="fp8", choices=sorted(DTYPE_BYTES))
    p.add_argument("--weights-gb", type=float, help="weight bytes per replica (default: parameters x dtype)")
    p.add_argument("--reserve-gb", type=float, default=10.0, help="per replica: activations, graphs, headroom")
    p.add_argument("--context", type=int, default=4096, help="tokens per resident request (prompt + output)")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64, help="requests per decode step")
    p.add_argument("--target-tps", type=float, help="aggregate output tokens/s to serve")
    p.add_argument("--prefill-efficiency", type=float, default=0.5)
    p.add_argument("--decode-efficiency", type=float, default=0.7)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(a: argparse.Namespace) -> int:
    model = MODELS[a.model] if a.model in MODELS else Model.from_config(a.model)
    layout = Layout(GPUS[a.gpu], a.tp, a.pp, a.weight_dtype, a.kv_dtype, a.reserve_gb * GB,
                    a.prefill_efficiency, a.decode_efficiency)
    weights = a.weights_gb * GB if a.weights_gb else None
    result = plan(model, layout, a.context, a.prompt_tokens, a.batch, a.target_tps, weights)
    if a.json:
        print(json.dumps({"model": model.name, "gpu": layout.gpu.name, "tp": layout.tp, "pp": layout.pp,
                          **result.as_dict()}, indent=2))
        return 0
    rows = [
        ("model", f"{model.name} ({model.num_params / 1e9:.1f} B parameters)"),
        ("layout", f"{layout.num_gpus} x {layout.gpu.name} (TP {layout.tp}, PP {layout.pp}), weights "
                   f"{layout.weight_dtype}, KV {layout.kv_dtype}"),
        ("weights per GPU", f"{result.weight_bytes_per_gpu / GB:.1f} GB"),
        ("KV per token", f"{result.kv_bytes_per_token / 1e3:.0f} KB"),
        ("KV budget", f"{result.kv_budget_bytes / GB:.0f} GB (after {a.reserve_gb:.0f} GB reserve)"),
        ("resident tokens", f"{result.resident_tokens:,}"),
        ("max concurrent", f"{result.max_concurrent:,} requests of {a.context:,} tokens"),
        ("prefill", f"{result.prefill_seconds * 1000:.0f} ms per {a.prompt_tokens:,}-token prompt"),
        ("decode step", f"{result.decode_step_seconds * 1000:.1f} ms at batch {a.batch} x {a.context:,} tokens"),
        ("tokens/s per replica", f"{result.tokens_per_s:,.0f}"),
    ]
    if result.replicas_for_target is not None:
        rows.append(("replicas", f"{result.replicas_for_target} for {a.target_tps:,.0f} tokens/s "
                                 f"({result.replicas_for_target * layout.num_gpus} GPUs)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
