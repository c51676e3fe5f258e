"""A checkpoint folder with random weights in another model's shape, with that model's tokenizer and chat template.

For machines the real weights cannot reach (the GPU machines have no network and take 64 MiB of files): the
tokenizer files are small, so ``tokenfleet models random FOLDER OUT`` there gives ``tokenfleet up --model OUT`` a
model that serves text with the real vocabulary and the real geometry, for speed runs (``benchmarks/gpu_serve.py``'s end-to-end
load). The weights are N(0, 0.02), norms one, as ``loader.random_model``; the names are HF's Llama names, which
the loader reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenfleet.models.config import ModelConfig

# what travels besides the weights: everything a served model reads but the tensors
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja", "special_tokens_map.json")


def write_random_checkpoint(like: Path, out: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                            num_layers: int = 0) -> Path:
    """``out``: ``like``'s config, tokenizer and chat template, with random weights (Llama family) in ``dtype``.
    ``num_layers`` > 0 overrides the layer count (a smaller model of the same width, for tests)."""
    like, out = Path(like), Path(out)
    raw = json.loads((like / "config.json").read_text())
    if num_layers:
        raw["num_hidden_layers"] = num_layers
    config = ModelConfig.from_dict(raw)
    if config.is_gemma3:
        raise ValueError("random checkpoints are written for Llama-family models only")
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (like / name).exists() and name != "config.json":
            shutil.copy2(like / name, out / name)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    gen = torch.Generator().manual_seed(seed)
    c = config

    def rand(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * 0.02).to(dtype)

    def ones() -> torch.Tensor:
        return torch.ones(c.hidden_size, dtype=dtype)

    tensors = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size), "model.norm.weight": ones()}
    kv = c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
            p + "self_attn.q_proj.weight": rand(c.num_heads * c.head_dim, c.hidden_size),
            p + "self_attn.k_proj.weight": rand(kv, c.hidden_size), p + "self_attn.v_proj.weight": rand(kv, c.hidden_size),
            p + "self_attn.o_proj.weight": rand(c.hidden_size, c.num_heads * c.head_dim),
            p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size),
        })
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "tokenfleet": f"random seed {seed}"})
    return out
