from __future__ import annotations

import json

from safetensors import safe_open

from tokenfleet.models.gguf_import import ensure_default_model


def test_imported_folder_is_a_plain_hf_llama(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    geometry = {k: config[k] for k in (
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "tie_word_embeddings", "rope_theta")}
    assert geometry == {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0,
    }
    assert "quantization_config" not in config and "_name_or_path" not in config
    tok_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "GPT2Tokenizer" and "<|im_start|>" in tok_config["chat_template"]
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert "lm_head.weight" not in names
        assert f.get_tensor("model.embed_tokens.weight").dtype.is_floating_point


def test_transformers_reads_it_the_same_way(default_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(str(default_model_dir)).rope_parameters["rope_theta"] == 100000.0
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    assert tok.eos_token == "<|im_end|>"


def test_second_call_reuses_the_import(default_model_dir):
    weights = default_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_default_model() == default_model_dir
    assert weights.stat().st_mtime_ns == before
