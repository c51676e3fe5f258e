"""The GGUF served as it ships (registry ``quantization: gguf``): the default model's Q4_1 layers and Q8_0 embedding and
LM head kept quantized, against the same weights dequantized by the import (the fp32 safetensors folder). The values
are equal, so the two differ only in the order their sums are taken: the logits agree to fp32 rounding and greedy
answers are the same. Gemma 3's mix of Q8_0, Q5_0, Q4_K and Q6_K (its Q, K and V of one layer in different types)
is served the same way."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.model.helpers import greedy, make_core, run_to_completion
from tokenfleet.models.ggml_quant import QuantTensor
from tokenfleet.models.gguf_import import GGUF_FILE, IMPORT_VERSION, folder_quantization, is_imported
from tokenfleet.models.loader import load_model
from tokenfleet.models.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


def kept_quantized(imported: Path, out: Path) -> Path:
    """What `models import --keep-quantized` writes, from an imported folder: its config and tokenizer, and its GGUF
    as model.gguf (a link: the test does not copy the file)."""
    out.mkdir()
    for f in imported.iterdir():
        if f.name not in ("model.safetensors", "tokenfleet_source.json"):
            shutil.copyfile(f, out / f.name)
    source = json.loads((imported / "tokenfleet_source.json").read_text())["gguf"]
    os.symlink(source, out / GGUF_FILE)
    (out / "tokenfleet_source.json").write_text(json.dumps({"gguf": source, "import_version": IMPORT_VERSION,
                                                            "quantization": "gguf"}))
    return out


@pytest.fixture(scope="module")
def gguf_dir(default_model_dir, tmp_path_factory) -> Path:
    return kept_quantized(default_model_dir, tmp_path_factory.mktemp("gguf") / "smollm2-135m-instruct-gguf")


def test_the_folder_is_a_kept_quantized_import(gguf_dir):
    assert is_imported(gguf_dir) and folder_quantization(gguf_dir) == "gguf"


def test_the_weights_stay_quantized_and_the_logits_match_the_dequantized_model(default_model_dir, gguf_dir,
                                                                              monkeypatch):
    monkeypatch.setenv("TOKENFLEET_QUANT_ACTIVATIONS", "float")  # the values equal: only the sums' order differs
    cpu = torch.device("cpu")
    quant = load_model(gguf_dir, torch.float32, cpu, quantization="gguf")
    assert all(check.passed for check in quant.kernel_checks)
    w = quant.weights
    assert isinstance(w.embed, QuantTensor) and w.embed.kind == "Q8_0" and w.lm_head is w.embed  # tied, quantized
    assert {layer.qkv.kind for layer in w.layers} == {"Q4_1"}
    held = sum(t.nbytes for t in (w.embed, *(m for layer in w.layers for m in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                               layer.down))))
    assert held <= 1.2 * (gguf_dir / GGUF_FILE).stat().st_size  # the file's bytes, not ~3x them
    core_q = make_core(gguf_dir, quantization="gguf")
    core_f = make_core(default_model_dir)
    tokenizer = Tokenizer(default_model_dir)
    arrivals = {0: [(f"p{i}", tokenizer.encode(p), greedy(12)) for i, p in enumerate(PROMPTS)]}
    assert run_to_completion(core_q, arrivals) == run_to_completion(core_f, arrivals)


@pytest.mark.timeout(600)
def test_int8_activations_on_decode_steps_agree_with_the_float_path_teacher_forced(default_model_dir, gguf_dir):
    """The default (TOKENFLEET_QUANT_ACTIVATIONS=int8): decode-sized steps multiply the Q4_1 / Q8_0 weights with
    activations quantized per 32 values, as llama.cpp does. Teacher-forced on test_fp8_accuracy's text prefilled
    INT8_ROWS tokens a step (every step on that path), against the same file with float activations."""
    from tests.model.test_fp8_accuracy import TEXT, perplexity, teacher_forced
    from tests.model.test_int8_accuracy import agree
    from tokenfleet.models.quant_linear import INT8_ROWS

    prompt = Tokenizer(default_model_dir).encode(TEXT)
    core = make_core(gguf_dir, quantization="gguf", max_prefill_chunk=INT8_ROWS)
    linear = core.runner.model.linear
    assert linear.int8_activations or linear.native is None  # the portable build has no int8 path
    int8 = teacher_forced(core, prompt)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TOKENFLEET_QUANT_ACTIVATIONS", "float")
        floats = teacher_forced(make_core(gguf_dir, quantization="gguf", max_prefill_chunk=INT8_ROWS), prompt)
    print(f"on {len(int8)} positions: top-1 agreement {agree(floats, int8):.1%}; perplexity float activations "
          f"{perplexity(floats):.3f}, int8 {perplexity(int8):.3f}")
    # measured here: 91.2 % (181 positions), perplexity 21.678 against 21.684: a 135M model's near-ties flip
    assert agree(floats, int8) >= 0.85
    assert perplexity(int8) <= 1.01 * perplexity(floats)


@pytest.mark.nightly  # ~25 s: Gemma's GGUF parsed and its kernels checked twice; its tensors are read in the suite
def test_gemma3_mixed_types_are_served_quantized_with_the_dequantized_models_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_QUANT_ACTIVATIONS", "float")
    from tokenfleet.models.ggml_quant import QuantRows
    from tokenfleet.models.gguf_import import GEMMA3_MODEL_NAME, ensure_model

    imported = ensure_model(GEMMA3_MODEL_NAME)
    folder = kept_quantized(imported, tmp_path / "gemma3-270m-gguf")
    core_q = make_core(folder, quantization="gguf")
    layers = core_q.runner.model.weights.layers
    assert any(isinstance(layer.qkv, QuantRows) for layer in layers)  # V in Q8_0 beside Q, K in Q5_0
    assert {getattr(layer.down, "kind", None) for layer in layers} >= {"Q4_K", "Q6_K"}
    tokenizer = Tokenizer(imported)
    arrivals = {0: [(f"p{i}", tokenizer.encode(p), greedy(8)) for i, p in enumerate(PROMPTS[:2])]}
    assert run_to_completion(core_q, arrivals) == run_to_completion(make_core(imported), arrivals)


@pytest.mark.nightly  # Gemma's GGUF, a prompt past its 512-token window: ~40 s
def test_gemma3_windows_over_quantized_weights_answer_as_the_dequantized_model(tmp_path, monkeypatch):
    """Gemma 3's sliding-window layers over its GGUF kept quantized: a chat past the window, prefilled whole and in
    128-token chunks, answers as the dequantized model does (float activations: the same weight values)."""
    from tests.model.test_gemma3_parity import CHATS
    from tokenfleet.api.chat_template import render_chat
    from tokenfleet.models.gguf_import import GEMMA3_MODEL_NAME, ensure_model

    monkeypatch.setenv("TOKENFLEET_QUANT_ACTIVATIONS", "float")
    imported = ensure_model(GEMMA3_MODEL_NAME)
    folder = kept_quantized(imported, tmp_path / "gemma3-270m-gguf")
    tokenizer = Tokenizer(imported)
    prompt = tokenizer.encode(render_chat(tokenizer, CHATS[-1]))
    dense = make_core(imported, num_blocks=256)
    assert len(prompt) > max(dense.runner.model.config.layer_windows)
    arrivals = {0: [("long", prompt, greedy(8))]}
    want = run_to_completion(dense, arrivals)
    assert run_to_completion(make_core(folder, quantization="gguf", num_blocks=256), arrivals) == want
    chunked = make_core(folder, quantization="gguf", num_blocks=256, max_prefill_chunk=128)
    assert run_to_completion(chunked, arrivals) == want


@pytest.mark.nightly  # three engines and a draft model; the suite keeps the plain quantized engine's answers
def test_quantized_weights_keep_the_answers_with_prefix_hits_chunked_prefill_and_speculation(default_model_dir, gguf_dir,
                                                                                          monkeypatch):
    """The engine's features over quantized weights: a second run of the same prompts (prefix-cache hits), prompts
    prefilled 4 tokens a step, and draft-model speculation (the model's first 10 layers, still quantized, verified by
    the whole model) all answer as the plain dequantized model does."""
    import json

    monkeypatch.setenv("TOKENFLEET_QUANT_ACTIVATIONS", "float")
    tokenizer = Tokenizer(default_model_dir)
    long = [" ".join([p] * 6) for p in PROMPTS]  # several 16-token blocks: a second run hits the prefix cache
    arrivals = {0: [(f"p{i}", tokenizer.encode(p), greedy(10)) for i, p in enumerate(long)]}
    want = run_to_completion(make_core(default_model_dir), arrivals)
    cached = make_core(gguf_dir, quantization="gguf", max_prefill_chunk=4)
    assert run_to_completion(cached, arrivals) == want
    again = {0: [(f"again-{rid}", prompt, params) for rid, prompt, params in arrivals[0]]}
    assert run_to_completion(cached, again) == {f"again-{k}": v for k, v in want.items()}
    assert cached.snapshot().num_prefix_hit_tokens > 0
    draft = json.dumps({"decoding_type": "DraftTarget", "max_draft_len": 4, "speculative_model": "self",
                        "adaptive": False, "draft_layers": 10})
    speculating = make_core(gguf_dir, quantization="gguf", speculative_config=draft)
    assert run_to_completion(speculating, arrivals) == want
    assert speculating.snapshot().num_spec_proposed_tokens > 0
