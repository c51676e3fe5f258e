"""Model configuration read from an HF ``config.json``, validated up front: the Llama family, and
Gemma 3 (``Gemma3ForCausalLM``) with its interleaved sliding-window and global layers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfleet.kvcache.layout import KVGroup, kv_groups

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
GEMMA3 = "Gemma3ForCausalLM"
SUPPORTED_ARCHITECTURES = (*LLAMA_ARCHITECTURES, GEMMA3)
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature this engine does not implement; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling; ``rope_type == "default"`` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    architecture: str = "LlamaForCausalLM"
    # Gemma 3: each layer's attention ("sliding_attention" | "full_attention"), the window, and the
    # RoPE base of the sliding layers (rope_theta is the global layers')
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    rope_local_theta: float = 0.0

    @property
    def is_gemma3(self) -> bool:
        return self.architecture == GEMMA3

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token at 1 byte per element; multiply by the element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer: its sliding window, or 0 for full attention; () when every layer is full."""
        if "sliding_attention" not in self.layer_types:
            return ()
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in self.layer_types)

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """How the layers share block tables (tokenfleet.kvcache.layout.kv_groups)."""
        return kv_groups(self.layer_windows or (0,) * self.num_layers)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} has no config.json")
        raw = json.loads(path.read_text())
        generation = Path(model_dir) / "generation_config.json"
        if generation.exists():
            gen = json.loads(generation.read_text())
            if gen.get("eos_token_id") is not None:
                raw = {**raw, "eos_token_id": gen["eos_token_id"]}
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if GEMMA3 in (raw.get("architectures") or ()):
            return _gemma3(raw)
        _check_supported(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


def _gemma3(raw: dict[str, Any]) -> ModelConfig:
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "head_dim", "sliding_window", "layer_types"):
        if field not in raw:
            raise UnsupportedModelError(f"config.json lacks the required field {field!r}")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"hidden_activation={raw['hidden_activation']!r}: only gelu_pytorch_tanh (GeGLU)")
    for field in ("final_logit_softcapping", "attn_logit_softcapping", "attention_bias", "use_bidirectional_attention",
                  "quantization_config"):
        if raw.get(field):
            raise UnsupportedModelError(f"{field}={raw[field]!r} is not supported")
    if int(raw.get("query_pre_attn_scalar", raw["head_dim"])) != int(raw["head_dim"]):
        raise UnsupportedModelError(f"query_pre_attn_scalar={raw['query_pre_attn_scalar']}: only head_dim is supported")
    rope = raw.get("rope_parameters") or {}
    local, full = rope.get("sliding_attention", {}), rope.get("full_attention", {})
    if any(r.get("rope_type", "default") != "default" for r in (local, full)):
        raise UnsupportedModelError(f"rope_parameters={rope}: only default RoPE is supported for Gemma 3")
    eos = raw.get("eos_token_id")
    num_heads = int(raw["num_attention_heads"])
    window = int(raw["sliding_window"])
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw["head_dim"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32_768)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        rope_scaling=RopeScaling(),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        architecture=GEMMA3,
        layer_types=tuple(raw["layer_types"]),
        sliding_window=window,
        rope_local_theta=float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))),
    )


def _check_supported(raw: dict[str, Any]) -> None:
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if not any(a in LLAMA_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(f"architectures={archs}: supported are {SUPPORTED_ARCHITECTURES}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
    for field in ("attention_bias", "mlp_bias"):
        if raw.get(field):
            raise UnsupportedModelError(f"{field}=true is not supported")
    if int(raw.get("pretraining_tp", 1)) != 1:
        raise UnsupportedModelError(f"pretraining_tp={raw['pretraining_tp']}: only 1 is supported")
    if raw.get("sliding_window") and raw.get("use_sliding_window", True):
        raise UnsupportedModelError(f"sliding_window={raw['sliding_window']} is not supported")
    if raw.get("quantization_config"):
        raise UnsupportedModelError("quantization_config is set: quantized checkpoints are not supported")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if field not in raw:
            raise UnsupportedModelError(f"config.json lacks the required field {field!r}")
    rope_type = _rope_dict(raw).get("rope_type", _rope_dict(raw).get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_scaling.rope_type={rope_type!r}: supported are {SUPPORTED_ROPE_TYPES}")


def _rope_dict(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes rope_parameters; older configs write rope_scaling (possibly null).
    return dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})


def _rope_theta(raw: dict[str, Any]) -> float:
    if "rope_theta" in raw:
        return float(raw["rope_theta"])
    return float(_rope_dict(raw).get("rope_theta", 10000.0))


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling:
    rope = _rope_dict(raw)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rope["factor"]),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
    )
