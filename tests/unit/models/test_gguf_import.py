"""The imported default model (GGUF -> HF folder): contents, readability by transformers, reuse, atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tokenfleet.models.config import ModelConfig
from tokenfleet.models.gguf_import import (
    DEFAULT_MODEL_NAME,
    IMPORT_VERSION,
    GGUFSource,
    default_source,
    ensure_default_model,
    import_gguf,
    is_imported,
    model_dir,
)

NUM_LAYERS = 30
HIDDEN = 576
PER_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- config.json ----------------------------------------------------------------------------------


def test_config_has_the_issue_geometry_and_top_level_rope_theta(default_model_dir):
    config = read_json(default_model_dir / "config.json")
    assert config["rope_theta"] == 100000.0  # top level, for readers that ignore rope_parameters
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == NUM_LAYERS
    assert config["hidden_size"] == HIDDEN
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True


def test_config_has_no_quantization_and_no_machine_path(default_model_dir):
    text = (default_model_dir / "config.json").read_text()
    config = json.loads(text)
    assert "quantization_config" not in config
    assert "_name_or_path" not in config and "_model_name_or_path" not in config
    assert str(default_model_dir) not in text
    assert str(Path.home()) not in text
    assert not [k for k, v in config.items() if isinstance(v, str) and v.startswith("/")]


def test_our_config_reader_accepts_it(default_model_dir):
    cfg = ModelConfig.from_dir(default_model_dir)
    assert cfg.rope_theta == 100000.0
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_scaling.rope_type == "default"
    assert cfg.eos_token_ids == (2,)  # <|im_end|>


# ---- tokenizer files -------------------------------------------------------------------------------


def test_tokenizer_config_names_gpt2_tokenizer_and_has_a_chat_template(default_model_dir):
    tok_config = read_json(default_model_dir / "tokenizer_config.json")
    assert tok_config["tokenizer_class"] == "GPT2Tokenizer"
    template = tok_config["chat_template"]
    assert isinstance(template, str) and "<|im_start|>" in template and "messages" in template
    assert tok_config["eos_token"] == "<|im_end|>"


# ---- weights -----------------------------------------------------------------------------------------


def test_safetensors_are_tied_fp32_and_complete(default_model_dir):
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(name).get_dtype() for name in names}
        embed_shape = f.get_slice("model.embed_tokens.weight").get_shape()
    assert "lm_head.weight" not in names  # tied to the embedding
    assert dtypes == {"F32"}
    assert embed_shape == [49152, HIDDEN]
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{suffix}" for i in range(NUM_LAYERS) for suffix in PER_LAYER
    }
    assert names == expected


# ---- transformers reads the folder ---------------------------------------------------------------


def test_transformers_auto_config_loads_it_with_rope_theta_100000(default_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(default_model_dir))
    assert config.model_type == "llama"
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.rope_parameters.get("rope_type", "default") == "default"
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    assert config.tie_word_embeddings is True


def test_transformers_auto_tokenizer_loads_it_and_agrees_with_ours(default_model_dir):
    from transformers import AutoTokenizer

    from tokenfleet.api.chat_template import render_chat
    from tokenfleet.models.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_dir))
    ours = Tokenizer(default_model_dir)
    assert hf.eos_token == "<|im_end|>"
    text = "Once upon a time, in a land far away: 42 naïve cafés!"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    hf_prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert hf_prompt == render_chat(ours, messages)


def test_tokenizer_gives_the_ids_llama_cpp_gives_digits_split_one_by_one(default_model_dir):
    # llama.cpp's own tokenizer on the same GGUF (tests/data/smollm2_llama_cpp_tokens.json): transformers rebuilds
    # the tokenizer without the model's individual-digit split, which turns "\n\n1" into "\n", "\n", "1"
    from tokenfleet.models.tokenizer import Tokenizer

    ours = Tokenizer(default_model_dir)
    cases = read_json(Path(__file__).resolve().parents[2] / "data" / "smollm2_llama_cpp_tokens.json")["cases"]
    assert len(cases) >= 5 and any("\n\n1" in c["text"] for c in cases)
    for case in cases:
        assert ours.encode(case["text"]) == case["ids"], case["text"][:60]
    assert ours.encode("2024") == [ours.encode(d)[0] for d in "2024"]


# ---- reuse -----------------------------------------------------------------------------------------------


def test_ensure_default_model_reuses_the_import(default_model_dir):
    weights = default_model_dir / "model.safetensors"
    config = default_model_dir / "config.json"
    before = (weights.stat().st_mtime_ns, config.stat().st_mtime_ns)
    first = ensure_default_model()
    second = ensure_default_model()
    assert first == second == default_model_dir
    assert (weights.stat().st_mtime_ns, config.stat().st_mtime_ns) == before


def test_default_model_lives_in_the_cache_under_its_name(default_model_dir):
    source = default_source()
    assert source.name == DEFAULT_MODEL_NAME
    assert source.path.suffix == ".gguf" and source.path.is_file()
    assert model_dir(source.name) == default_model_dir
    assert is_imported(default_model_dir)


def test_model_dir_follows_tokenfleet_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENFLEET_CACHE_DIR", str(tmp_path))
    assert model_dir("some-model") == tmp_path / "models" / "some-model"


# ---- import_gguf atomicity (with a broken GGUF: fails fast, before any real conversion) ------------


@pytest.fixture
def broken_source(tmp_path) -> GGUFSource:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 7)
    return GGUFSource(name="broken", path=path)


def _fake_imported_folder(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True)
    files = {"config.json": '{"old": true}', "model.safetensors": "old weights", "tokenizer.json": "{}",
             "tokenfleet_source.json": json.dumps({"import_version": IMPORT_VERSION})}
    for name, content in files.items():
        (folder / name).write_text(content)
    return files


def test_failed_import_leaves_no_destination_and_no_temp_dir(tmp_path, broken_source):
    dest = tmp_path / "models" / "broken"
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        import_gguf(broken_source, dest)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # the temporary work folder is gone too


def test_failed_overwrite_keeps_the_previous_import(tmp_path, broken_source):
    dest = tmp_path / "models" / "broken"
    files = _fake_imported_folder(dest)
    with pytest.raises(Exception):  # noqa: B017
        import_gguf(broken_source, dest, overwrite=True)
    assert {p.name: p.read_text() for p in dest.iterdir()} == files
    assert [p.name for p in dest.parent.iterdir()] == ["broken"]


def test_import_of_an_imported_folder_is_a_no_op(tmp_path, broken_source):
    dest = tmp_path / "models" / "broken"
    files = _fake_imported_folder(dest)
    assert import_gguf(broken_source, dest) == dest  # never reads the (broken) source
    assert {p.name: p.read_text() for p in dest.iterdir()} == files


def test_a_folder_an_older_import_wrote_is_imported_again(tmp_path, broken_source):
    dest = tmp_path / "models" / "broken"
    _fake_imported_folder(dest)
    (dest / "tokenfleet_source.json").write_text(json.dumps({"gguf": "x.gguf"}))  # before import versions
    assert not is_imported(dest)
    with pytest.raises(Exception):  # noqa: B017 - it reads the (broken) source: a new import was attempted
        import_gguf(broken_source, dest)
    assert (dest / "config.json").read_text() == '{"old": true}'  # and a failed one keeps what was there


# ---- kept quantized (models import --keep-quantized, or the name NAME-gguf) -------------------------


def test_a_kept_quantized_import_holds_the_gguf_instead_of_safetensors(monkeypatch, tmp_path):
    from tokenfleet.models import gguf_import

    gguf = tmp_path / "small.gguf"
    gguf.write_bytes(b"GGUF quantized blocks")

    def fake_convert(source: GGUFSource, out: Path) -> None:  # what _convert writes, without transformers
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            (out / name).write_text("{}")
        gguf_import._write_marker(source, out)

    monkeypatch.setattr(gguf_import, "_convert", fake_convert)
    monkeypatch.setitem(gguf_import.SOURCES, "tiny", lambda: GGUFSource("tiny", gguf))
    source = gguf_import.source("tiny-gguf")
    assert source.name == "tiny-gguf" and source.keep_quantized and gguf_import.source("tiny", True) == source
    folder = import_gguf(source, tmp_path / "models" / source.name)
    assert sorted(f.name for f in folder.iterdir()) == ["config.json", "model.gguf", "tokenfleet_source.json",
                                                        "tokenizer.json"]
    assert (folder / "model.gguf").read_bytes() == gguf.read_bytes()
    assert is_imported(folder) and gguf_import.folder_quantization(folder) == "gguf"
    plain = import_gguf(gguf_import.source("tiny"), tmp_path / "models" / "tiny")
    assert is_imported(plain) and gguf_import.folder_quantization(plain) == ""
    (folder / "model.gguf").unlink()
    assert not is_imported(folder)  # the weights are gone: imported again on next use
    with pytest.raises(LookupError):
        gguf_import.source("nothing-gguf")
