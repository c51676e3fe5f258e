"""Load a Llama-family HF folder (config.json + *.safetensors) into ``LlamaWeights``."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from tokenfleet.models.attention import select_attention
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.layer_ops import select_layer_ops
from tokenfleet.models.linear import LinearKernel, select_linear
from tokenfleet.models.llama import LayerWeights, LlamaModel, LlamaWeights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: supported are {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    config = ModelConfig.from_dir(model_dir)
    tensors = _read_safetensors(Path(model_dir))
    linear = select_linear(dtype, device)
    weights = _build_weights(config, tensors, dtype, device, linear)
    return LlamaModel(config, weights, dtype, device, linear, select_attention(dtype, device),
                      select_layer_ops(config, dtype, device))


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors


def _build_weights(
    config: ModelConfig, t: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, linear: LinearKernel
) -> LlamaWeights:
    def take(name: str) -> torch.Tensor:
        if name not in t:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        return t[name].to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=linear.prepare(torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])),
                o_proj=linear.prepare(take(p + "self_attn.o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=linear.prepare(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                down=linear.prepare(take(p + "mlp.down_proj.weight")),
            )
        )
    embed = take("embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in t:
        if not config.tie_word_embeddings:
            raise ValueError("checkpoint lacks lm_head.weight and tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = take("lm_head.weight")
    return LlamaWeights(embed=embed, layers=layers, norm=take("norm.weight"), lm_head=linear.prepare(lm_head),
                        lm_head_rows=lm_head)
