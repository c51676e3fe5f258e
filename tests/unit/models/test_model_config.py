from __future__ import annotations

import json

import pytest
import torch

from tokenfleet.models.config import ModelConfig, UnsupportedModelError
from tokenfleet.models.llama import rope_inv_freq

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
    ],
)
def test_unsupported_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict({**BASE, **change})


def test_missing_required_field_is_named():
    raw = dict(BASE)
    del raw["hidden_size"]
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        ModelConfig.from_dict(raw)


def test_rope_theta_forms_and_defaults():
    assert ModelConfig.from_dict({**BASE, "rope_theta": 5e5}).rope_theta == 5e5
    assert ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}).rope_theta == 1e5
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.rope_theta == 10000.0 and cfg.head_dim == 16 and cfg.rope_scaling.rope_type == "default"


def test_generation_config_eos_overrides(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 7)


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=2048, num_attention_heads=16, rope_theta=500000.0, rope_scaling=scaling,
                            max_position_embeddings=131072)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    ours = rope_inv_freq(ModelConfig.from_dict({
        **BASE, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
        "rope_theta": 500000.0, "rope_scaling": scaling,
    }))
    assert ours.shape == expected.shape
    assert torch.allclose(ours, expected.float())
