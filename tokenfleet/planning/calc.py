"""Capacity arithmetic for a model on a GPU layout (``tokenfleet plan``): memory, KV budget,
resident tokens, roofline prefill and decode times, tokens/s per replica, replicas for a rate
(the command itself: ``tokenfleet.cli.plan``).

Units: bytes and seconds; "GB" in presets and flags is 10^9 bytes (vendors' unit). The roofline
takes the larger of the compute time (FLOPs / peak x efficiency) and the memory time (bytes /
HBM bandwidth x efficiency) per phase; tensor parallelism divides both; its two all-reduces of the
activations per layer over NVLink overlap a prefill's compute (the larger of the two counts) and add
to a decode step (small messages). It is a bound and a planning number, not a promise:
calibrate the efficiencies against a measured engine (``tokenfleet simulate calibrate``, later).

Sliding-window attention (Gemma 3: five local layers to one global): a local layer's query sees at
most the last ``window`` keys, itself included, so per request it keeps and reads at most ``window``
tokens of KV while a global layer keeps the whole context. KV of a request at context C is
``per_layer_token_bytes x (global_layers x C + sliding_layers x min(C, window))``; memory, decode
reads, attention FLOPs and KV transfers all count it this way.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GB = 1e9
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
# Weight formats (``Layout.weight_dtype``): the dtypes, and "gguf", a GGUF file's own block types kept as they ship
# (``Layout.weight_bytes_per_param`` from the file: planning.gguf_size; without one, ``GGUF_DEFAULT_BITS``).
WEIGHT_DTYPES = (*DTYPE_BYTES, "gguf")
# Without a file, a "gguf" model is taken as Q4_K_M, llama.cpp's usual 4-bit mix: Q4_K (4.5 bits a weight) for most
# matrices, Q6_K (6.5625) for some V and down projections and the output; about 4.85 bits a weight on a Llama-class
# model. A real file can differ much: the shipped small models keep an 8-bit embedding that is a third (SmolLM2 135M:
# 5.7 bits a weight in all) or two thirds (Gemma 3 270M: 7.4) of their weights.
GGUF_DEFAULT_BITS = 4.85
INT8_SCALE_BYTES = 2.0 / 32  # "int8" weights (the torch engine's): an fp16 scale per 32 values (GGML's Q8_0 blocks)


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


def attention_pairs(start: int, num_new_tokens: int, window: int | None = None) -> int:
    """(query, key) pairs of computing positions ``start`` .. ``start + num_new_tokens - 1`` causally;
    with a ``window`` each query sees at most that many keys, itself included."""

    def upto(end: int) -> int:  # pairs of the queries at positions 0 .. end - 1
        if window is None or end <= window:
            return end * (end + 1) // 2
        return window * (window + 1) // 2 + (end - window) * window

    return upto(start + num_new_tokens) - upto(start)


def attended_keys(start: int, num_new_tokens: int, window: int | None = None) -> int:
    """Distinct keys those queries read: the whole context after them, or with a ``window`` its last
    ``num_new_tokens + window - 1`` positions (one decode token: ``min(context, window)``)."""
    end = start + num_new_tokens
    return end if window is None else min(end, num_new_tokens + window - 1)


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
    sliding_window: int | None = None  # keys a sliding-window layer's query sees (and its KV per request)
    num_sliding_layers: int = 0  # of num_layers; the others attend to (and keep) the whole context
    tie_word_embeddings: bool = False  # the output projection is the input embedding

    def __post_init__(self) -> None:
        if not 0 <= self.num_sliding_layers <= self.num_layers:
            raise ValueError(f"{self.name}: {self.num_sliding_layers} sliding layers of {self.num_layers}")
        if self.num_sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"{self.name}: sliding layers need a positive window, got {self.sliding_window}")

    @property
    def num_global_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def window(self) -> int | None:
        """The sliding window, or None when no layer has one."""
        return self.sliding_window if self.num_sliding_layers else None

    @property
    def num_params(self) -> float:
        """Decoder weights: attention (q, o full; k, v by KV heads), gated MLP, embeddings in and out
        (once when tied)."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embeddings = (1 if self.tie_word_embeddings else 2) * self.vocab_size * self.hidden_size
        return self.num_layers * (attention + mlp) + embeddings

    @property
    def num_output_channels(self) -> int:
        """Rows of every weight matrix ([out, in]): the per-channel scales a quantized copy keeps."""
        attention = self.head_dim * (self.num_heads + 2 * self.num_kv_heads) + self.hidden_size
        mlp = 2 * self.intermediate_size + self.hidden_size
        return self.num_layers * (attention + mlp) + (1 if self.tie_word_embeddings else 2) * self.vocab_size

    def kv_bytes_per_layer_token(self, kv_dtype: str) -> float:
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

    def kv_layer_tokens(self, context: int) -> int:
        """Tokens of KV one request of ``context`` tokens keeps, summed over layers."""
        window = self.window
        local = context if window is None else min(context, window)
        return self.num_global_layers * context + self.num_sliding_layers * local

    def kv_bytes(self, context: int, kv_dtype: str) -> float:
        """KV of one request of ``context`` tokens (what it keeps, and what a decode step reads of it)."""
        return self.kv_layer_tokens(context) * self.kv_bytes_per_layer_token(kv_dtype)

    def kv_bytes_per_token(self, kv_dtype: str, context: int | None = None) -> float:
        """K and V of one token over all layers, averaged over a request of ``context`` tokens. None:
        as if every layer kept every token (full attention; exact for models without a window)."""
        if context is None:
            return self.num_layers * self.kv_bytes_per_layer_token(kv_dtype)
        if context < 1:
            raise ValueError(f"context must be positive, got {context}")
        return self.kv_bytes(context, kv_dtype) / context

    def attention_flops(self, pairs: int, window_pairs: int | None = None) -> float:
        """QK^T and PV over all layers: ``pairs`` per global layer, ``window_pairs`` (default: the same)
        per sliding-window layer."""
        local = pairs if window_pairs is None else window_pairs
        return 4 * self.num_heads * self.head_dim * (self.num_global_layers * pairs + self.num_sliding_layers * local)

    @classmethod
    def from_config(cls, path: str | Path) -> Model:
        """An HF ``config.json``: Llama-family keys, and Gemma 3's (a multimodal one's ``text_config``)."""
        outer = json.loads(Path(path).read_text())
        c = outer.get("text_config") or outer
        heads, layers = int(c["num_attention_heads"]), int(c["num_hidden_layers"])
        window, num_sliding = _sliding_layers(c, layers)
        return cls(name=outer.get("_name_or_path") or Path(path).parent.name, num_layers=layers,
                   hidden_size=int(c["hidden_size"]), num_heads=heads,
                   num_kv_heads=int(c.get("num_key_value_heads", heads)),
                   head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                   intermediate_size=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]),
                   sliding_window=window, num_sliding_layers=num_sliding,
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", _is_gemma3(outer, c))))


def _is_gemma3(outer: dict[str, Any], c: dict[str, Any]) -> bool:
    return c.get("model_type") in ("gemma3_text", "gemma3") or any(
        a.startswith("Gemma3") for a in outer.get("architectures") or ())


def _sliding_layers(c: dict[str, Any], num_layers: int) -> tuple[int | None, int]:
    """(window, sliding layers): from ``layer_types`` when listed, else Gemma 3's pattern (every Nth
    layer global, N = ``sliding_window_pattern``, 6 by default). Other configs' ``sliding_window``
    (Qwen2's unused one, say) is not read: without a layer list it does not say which layers slide."""
    window = c.get("sliding_window")
    if not window:
        return None, 0
    if "layer_types" in c:
        return int(window), sum(t == "sliding_attention" for t in c["layer_types"])
    pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern")
    if pattern is None and c.get("model_type") in ("gemma3_text", "gemma3"):
        pattern = 6
    if not pattern:
        return None, 0
    return int(window), num_layers - num_layers // int(pattern)


MODELS = {  # Llama-3-class GQA geometries; Gemma 3 (text decoder only) from its HF configs
    "llama3-8b": Model("Llama-3 8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama3-70b": Model("Llama-3 70B", 80, 8192, 64, 8, 128, 28672, 128256),
    "llama3-405b": Model("Llama-3 405B", 126, 16384, 128, 8, 128, 53248, 128256),
    # sliding window on 5 of every 6 layers (the 6th, 12th, ... are global); tied embeddings; the
    # multimodal sizes' vocabulary has 64 image tokens more
    "gemma3-270m": Model("Gemma 3 270M", 18, 640, 4, 1, 256, 2048, 262144, 512, 15, True),
    "gemma3-1b": Model("Gemma 3 1B", 26, 1152, 4, 1, 256, 6912, 262144, 512, 22, True),
    "gemma3-4b": Model("Gemma 3 4B", 34, 2560, 8, 4, 256, 10240, 262208, 1024, 29, True),
    "gemma3-12b": Model("Gemma 3 12B", 48, 3840, 16, 8, 256, 15360, 262208, 1024, 40, True),
    "gemma3-27b": Model("Gemma 3 27B", 62, 5376, 32, 16, 128, 21504, 262208, 1024, 52, True),
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
    # weight bytes per parameter when known better than the dtype says: a GGUF file's own tensor types
    # (planning.gguf_size.gguf_bytes_per_param); None: ``bytes_per_param(model, weight_dtype)``
    weight_bytes_per_param: float | None = None

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    def weight_bytes(self, model: Model) -> float:
        """The model's weights in this layout's format, over all its GPUs."""
        return weight_bytes(model, self.weight_dtype, per_param=self.weight_bytes_per_param)


@dataclass(frozen=True)
class Plan:
    """What ``plan`` reports for one replica (a TP x PP group of GPUs)."""

    weight_bytes_per_gpu: float
    kv_bytes_per_token: float  # averaged over a request of ``context`` tokens (sliding layers keep their window)
    kv_budget_bytes: float
    resident_tokens: int  # at ``context`` tokens per request
    max_concurrent: int  # requests of ``context`` tokens that fit at once
    full_kv_bytes_per_token: float  # if every layer kept the whole context (a model without a window: the same)
    full_max_concurrent: int  # ... and the requests that would fit then
    prefill_seconds: float  # one prompt of ``prompt_tokens``
    decode_step_seconds: float  # one step of ``batch`` requests at ``context``
    tokens_per_s: float  # batch / step time
    replicas_for_target: int | None

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def bytes_per_param(model: Model, dtype: str) -> float:
    """Weight bytes per parameter in ``dtype`` (``WEIGHT_DTYPES``): its size; "int8" adds its block scales
    (``INT8_SCALE_BYTES`` a parameter: 34 bytes per 32 values); "gguf" without a file is ``GGUF_DEFAULT_BITS``."""
    if dtype == "gguf":
        return GGUF_DEFAULT_BITS / 8
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"weight dtype {dtype!r}: one of {', '.join(WEIGHT_DTYPES)}")
    if dtype == "int8":
        return DTYPE_BYTES[dtype] + INT8_SCALE_BYTES
    return DTYPE_BYTES[dtype]


def weight_bytes(model: Model, dtype: str, params: float | None = None, per_param: float | None = None) -> float:
    """``params`` (default: the model's) at ``per_param`` bytes each (default: ``bytes_per_param``)."""
    n = params if params is not None else model.num_params
    return n * (per_param if per_param is not None else bytes_per_param(model, dtype))


def kv_budget(model: Model, layout: Layout, weights: float | None = None) -> float:
    total = layout.num_gpus * layout.gpu.memory_bytes
    used = layout.weight_bytes(model) if weights is None else weights
    return max(0.0, total - used - layout.reserve_bytes)


def resident_tokens(model: Model, layout: Layout, weights: float | None = None, context: int | None = None) -> int:
    """Tokens of KV that fit, requests being ``context`` tokens long (None: every layer keeps every token)."""
    return int(kv_budget(model, layout, weights) // model.kv_bytes_per_token(layout.kv_dtype, context))


def prefill_seconds(model: Model, layout: Layout, prompt_tokens: int) -> float:
    """Compute-bound in practice: 2 FLOPs per weight per token plus attention's quadratic term."""
    gpu, n = layout.gpu, layout.num_gpus
    pairs = attention_pairs(0, prompt_tokens)
    flops = 2 * model.num_params * prompt_tokens + model.attention_flops(
        pairs, attention_pairs(0, prompt_tokens, model.window))
    compute = flops / (n * gpu.flops(layout.weight_dtype) * layout.prefill_efficiency)
    memory = layout.weight_bytes(model) / (n * gpu.hbm_bytes_per_s)
    return max(compute, memory, _allreduce_seconds(model, layout, prompt_tokens))  # TP comms overlap compute


def decode_step_seconds(model: Model, layout: Layout, batch: int, context: int) -> float:
    """Memory-bound in practice: every step reads the weights once and each request's KV."""
    gpu, n = layout.gpu, layout.num_gpus
    read = layout.weight_bytes(model) + batch * model.kv_bytes(context, layout.kv_dtype)
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
    weights = layout.weight_bytes(model) if weights_bytes is None else weights_bytes
    tokens = resident_tokens(model, layout, weights, context)
    step = decode_step_seconds(model, layout, batch, context)
    rate = batch / step
    return Plan(
        weight_bytes_per_gpu=weights / layout.num_gpus,
        kv_bytes_per_token=model.kv_bytes_per_token(layout.kv_dtype, context),
        kv_budget_bytes=kv_budget(model, layout, weights),
        resident_tokens=tokens,
        max_concurrent=tokens // context,
        full_kv_bytes_per_token=model.kv_bytes_per_token(layout.kv_dtype),
        full_max_concurrent=resident_tokens(model, layout, weights) // context,
        prefill_seconds=prefill_seconds(model, layout, prompt_tokens),
        decode_step_seconds=step,
        tokens_per_s=rate,
        replicas_for_target=replicas_for(target_tokens_per_s, rate) if target_tokens_per_s else None,
    )
