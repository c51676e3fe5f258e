"""`tokenfleet models random`: a folder with random weights in a model's shape and that model's tokenizer, which the
engine loads and serves like any checkpoint (the GPU machines' end-to-end runs, where the real weights cannot go)."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from tests.model.helpers import greedy, make_core, run_to_completion
from tokenfleet.models.random_checkpoint import write_random_checkpoint
from tokenfleet.models.tokenizer import Tokenizer


def test_a_random_checkpoint_has_the_model_s_shape_and_tokenizer_and_serves(default_model_dir, tmp_path):
    out = write_random_checkpoint(default_model_dir, tmp_path / "random", seed=3, num_layers=2)
    real = json.loads((default_model_dir / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == real["hidden_size"]
    assert (out / "tokenizer.json").read_bytes() == (default_model_dir / "tokenizer.json").read_bytes()
    assert (out / "chat_template.jinja").exists()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
    assert "lm_head.weight" not in names  # tied, as the model's
    assert q.dtype == torch.bfloat16 and q.shape == (real["num_attention_heads"] * real["head_dim"], real["hidden_size"])
    assert 0.015 < q.float().std().item() < 0.025
    tokenizer = Tokenizer(out)
    prompt = tokenizer.encode("Hello there")
    assert prompt == Tokenizer(default_model_dir).encode("Hello there")
    tokens = run_to_completion(make_core(out, dtype="bfloat16"), {0: [("r", prompt, greedy(5, ignore_eos=True))]})["r"]
    assert len(tokens) == 5 and all(0 <= t < real["vocab_size"] for t in tokens)
    assert tokenizer.decode(tokens) == Tokenizer(default_model_dir).decode(tokens)  # the real model's text
