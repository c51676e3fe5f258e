"""ModelConfig: validation of unsupported checkpoints, field defaults and forms, llama3 RoPE scaling."""

from __future__ import annotations

import json

import pytest
import torch

from tokenfleet.models.config import ModelConfig, RopeScaling, UnsupportedModelError
from tokenfleet.models.llama import rope_inv_freq

# A small, valid Llama config (GQA: 4 query heads over 2 KV heads).
BASE: dict = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
}

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def config(**changes) -> dict:
    return {**BASE, **changes}


# ---- unsupported checkpoints -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        pytest.param({"hidden_act": "gelu"}, "hidden_act", id="hidden_act-gelu"),
        pytest.param({"attention_bias": True}, "attention_bias", id="attention_bias"),
        pytest.param({"mlp_bias": True}, "mlp_bias", id="mlp_bias"),
        pytest.param({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type", id="rope-yarn"),
        pytest.param({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn", id="rope-yarn-legacy-type-key"),
        pytest.param({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn",
                     id="rope-yarn-rope_parameters"),
        pytest.param({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear", id="rope-linear"),
        pytest.param({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config",
                     id="quantized"),
        pytest.param({"sliding_window": 4096}, "sliding_window", id="sliding_window"),
        pytest.param({"num_key_value_heads": 3}, "num_key_value_heads", id="heads-not-multiple-of-kv-heads"),
        pytest.param({"architectures": ["GPT2LMHeadModel"]}, "architectures", id="gpt2"),
    ],
)
def test_unsupported_config_raises_naming_the_field(changes, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(config(**changes))


def test_unsupported_model_error_is_a_value_error():
    assert issubclass(UnsupportedModelError, ValueError)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict(config(hidden_act="gelu"))


def test_head_count_error_names_both_head_fields():
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_dict(config(num_attention_heads=4, num_key_value_heads=3))
    message = str(info.value)
    assert "num_attention_heads" in message and "num_key_value_heads" in message


@pytest.mark.parametrize(
    "field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
)
def test_missing_required_field_is_named(field):
    raw = config()
    del raw[field]
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"attention_bias": False, "mlp_bias": False}, id="biases-false"),
        pytest.param({"sliding_window": None}, id="sliding_window-null"),
        pytest.param({"sliding_window": 4096, "use_sliding_window": False}, id="sliding_window-disabled"),
        pytest.param({"rope_scaling": None}, id="rope_scaling-null"),
        pytest.param({"architectures": ["MistralForCausalLM"]}, id="mistral"),
        pytest.param({"quantization_config": None}, id="quantization_config-null"),
    ],
)
def test_supported_variants_are_accepted(changes):
    cfg = ModelConfig.from_dict(config(**changes))
    assert cfg.num_heads == 4 and cfg.num_kv_heads == 2


# ---- fields, defaults and forms ----------------------------------------------------------------


def test_rope_theta_from_top_level():
    cfg = ModelConfig.from_dict(config(rope_theta=500000.0))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling()


def test_rope_theta_from_rope_parameters_transformers5_form():
    cfg = ModelConfig.from_dict(config(rope_parameters={"rope_type": "default", "rope_theta": 100000.0}))
    assert cfg.rope_theta == 100000.0
    assert cfg.rope_scaling.rope_type == "default"


def test_rope_theta_defaults_to_10000():
    assert ModelConfig.from_dict(config()).rope_theta == 10000.0


def test_head_dim_defaults_to_hidden_over_heads_and_explicit_head_dim_wins():
    assert ModelConfig.from_dict(config()).head_dim == 64 // 4
    assert ModelConfig.from_dict(config(head_dim=32)).head_dim == 32


def test_kv_heads_default_to_attention_heads():
    raw = config()
    del raw["num_key_value_heads"]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.num_kv_heads == cfg.num_heads == 4


def test_core_fields_are_read():
    cfg = ModelConfig.from_dict(
        config(max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1)
    )
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (128, 64, 160, 2)
    assert cfg.max_position_embeddings == 4096
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings is True
    assert cfg.bos_token_id == 1
    # K and V, per layer and KV head, one element per head dimension.
    assert cfg.kv_bytes_per_token == 2 * 2 * 2 * 16


def test_eos_int_and_list_forms():
    assert ModelConfig.from_dict(config(eos_token_id=2)).eos_token_ids == (2,)
    assert ModelConfig.from_dict(config(eos_token_id=[2, 7, 9])).eos_token_ids == (2, 7, 9)
    assert ModelConfig.from_dict(config()).eos_token_ids == ()


def test_generation_config_eos_overrides_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config(eos_token_id=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [5, 6]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (5, 6)

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (9,)


def test_generation_config_without_eos_keeps_config_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config(eos_token_id=[2, 3])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None, "do_sample": False}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 3)


def test_from_dir_without_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config(eos_token_id=4, rope_theta=2e5)))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.eos_token_ids == (4,) and cfg.rope_theta == 2e5


def test_from_dir_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


def test_from_dir_validates_too(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config(mlp_bias=True)))
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        ModelConfig.from_dir(tmp_path)


# ---- llama3 RoPE scaling ----------------------------------------------------------------------


def test_llama3_rope_scaling_is_parsed():
    cfg = ModelConfig.from_dict(config(rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING)))
    assert cfg.rope_scaling == RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


def _transformers_llama3_inv_freq(hidden_size: int, num_heads: int, scaling: dict, theta: float) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(
        hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        rope_theta=theta, rope_scaling=dict(scaling), max_position_embeddings=131072,
    )
    assert hf_config.rope_parameters["rope_type"] == "llama3"  # transformers did take the scaling
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    assert attention_factor == 1.0
    return inv_freq.float()


@pytest.mark.parametrize(
    ("hidden_size", "num_heads", "scaling"),
    [
        pytest.param(4096, 32, LLAMA3_SCALING, id="llama3.1-8b"),
        pytest.param(2048, 32, {**LLAMA3_SCALING, "factor": 32.0}, id="llama3.2-1b"),
    ],
)
def test_llama3_inv_freq_matches_transformers(hidden_size, num_heads, scaling):
    expected = _transformers_llama3_inv_freq(hidden_size, num_heads, scaling, 500000.0)
    ours = rope_inv_freq(ModelConfig.from_dict(config(
        hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=8,
        rope_theta=500000.0, rope_scaling=dict(scaling),
    )))
    assert ours.shape == expected.shape == (hidden_size // num_heads // 2,)
    assert torch.allclose(ours, expected, rtol=1e-6, atol=0.0)
    # The scaling did something: the lowest frequencies are divided by the factor.
    unscaled = rope_inv_freq(ModelConfig.from_dict(config(
        hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=8, rope_theta=500000.0,
    )))
    assert torch.allclose(ours[-1], unscaled[-1] / scaling["factor"])
    assert torch.equal(ours[0], unscaled[0])


def test_llama3_from_transformers5_rope_parameters_matches_transformers():
    """A config as transformers 5 writes it: theta and scaling both inside ``rope_parameters``."""
    from transformers import LlamaConfig

    hf_config = LlamaConfig(
        vocab_size=128, hidden_size=4096, intermediate_size=160, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING),
        max_position_embeddings=131072,
    )
    raw = hf_config.to_dict()
    raw.pop("rope_theta", None)
    raw.pop("rope_scaling", None)
    assert raw["rope_parameters"]["rope_type"] == "llama3"
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.rope_type == "llama3"
    expected = _transformers_llama3_inv_freq(4096, 32, LLAMA3_SCALING, 500000.0)
    assert torch.allclose(rope_inv_freq(cfg), expected, rtol=1e-6, atol=0.0)


def test_default_rope_inv_freq_is_the_textbook_formula():
    cfg = ModelConfig.from_dict(config(rope_theta=100000.0))
    dim = cfg.head_dim
    expected = 1.0 / (100000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    assert torch.allclose(rope_inv_freq(cfg).double(), expected, rtol=1e-6)
