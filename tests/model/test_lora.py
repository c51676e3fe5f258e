"""LoRA adapters in the engine (default model, fp32): adapters made deterministically with `peft` (rank 16 on every
linear layer), served several at once in one batch, each request's output equal to what PEFT's merged model gives
greedily; an adapter's prefixes are cached apart from the base model's; bad adapters are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.model.helpers import assert_no_leak, greedy, make_core, run_to_completion
from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.request_spec import RequestSpec

PROMPTS = ["Name three fruits.", "What is the capital of France?", "Write a line about the sea."]


def make_adapter(base_dir, folder, merged_dir, seed: int) -> None:
    """A rank-16 LoRA on every linear layer with small random weights (PEFT's own init would leave B = 0, a no-op),
    saved as a PEFT folder, and the merged model saved as an HF folder (with the base's tokenizer)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                      lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    model.merge_and_unload().save_pretrained(merged_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (base_dir / f).exists():
            shutil.copy(base_dir / f, merged_dir / f)


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i in range(2):
        folder, merged = root / f"a{i}", root / f"merged{i}"
        make_adapter(default_model_dir, folder, merged, seed=i)
        out[f"a{i}"] = (folder, merged)
    return out


def prompt_of(core, text):
    return core.tokenizer.encode(render_chat(core.tokenizer, [{"role": "user", "content": text}]))


def test_adapters_in_one_batch_match_their_merged_models(default_model_dir, adapters):
    core = make_core(default_model_dir)
    for name, (folder, _) in adapters.items():
        core.runner.load_adapter(name, str(folder))
    prompts = [prompt_of(core, t) for t in PROMPTS]
    expected = {}
    for name, (_, merged) in adapters.items():
        ref = make_core(merged)
        for i, p in enumerate(prompts):
            expected[f"{name}-{i}"] = run_to_completion(ref, {0: [("r", p, greedy(16))]})["r"]
    base_expected = {f"base-{i}": run_to_completion(core, {0: [("b", p, greedy(16))]})["b"] for i, p in enumerate(prompts)}
    # every request at once: both adapters and the base model in the same steps
    ids = {}
    for i, p in enumerate(prompts):
        for name in (*adapters, ""):
            rid = f"{name or 'base'}-{i}"
            core.add_request(RequestSpec(p, greedy(16), request_id=rid, adapter=name))
            ids[rid] = []
    while core.has_unfinished():
        for o in core.step():
            ids[o.request_id] += o.new_token_ids
    assert {k: v for k, v in ids.items() if not k.startswith("base")} == expected
    assert {k: v for k, v in ids.items() if k.startswith("base")} == base_expected
    assert any(expected[f"a0-{i}"] != base_expected[f"base-{i}"] for i in range(len(prompts)))  # adapters matter
    assert_no_leak(core.scheduler.block_manager)


def test_an_adapters_prefix_cache_is_its_own(default_model_dir, adapters):
    core = make_core(default_model_dir)
    core.runner.load_adapter("a0", str(adapters["a0"][0]))
    prompt = prompt_of(core, "Tell me about bicycles, in detail, with examples. " * 3)
    run_to_completion(core, {0: [("base", prompt, greedy(2))]})
    core.add_request(RequestSpec(prompt, greedy(2), request_id="lora", adapter="a0"))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert outs[-1].num_cached_tokens == 0  # the base model's blocks are not this adapter's KV
    core.add_request(RequestSpec(prompt, greedy(2), request_id="lora2", adapter="a0"))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert outs[-1].num_cached_tokens > 0  # its own are


def test_bad_adapters_and_unknown_names_are_refused(default_model_dir, adapters, tmp_path):
    core = make_core(default_model_dir)
    with pytest.raises(ValueError, match="not loaded"):
        core.add_request(RequestSpec([1, 2, 3], greedy(2), adapter="nope"))
    with pytest.raises(ValueError, match="not a PEFT adapter"):
        core.runner.load_adapter("x", str(tmp_path))
    bad = tmp_path / "dora"
    shutil.copytree(adapters["a0"][0], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        core.runner.load_adapter("x", str(bad))
    from safetensors.torch import load_file, save_file

    nan = tmp_path / "nan"
    shutil.copytree(adapters["a0"][0], nan)
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="NaN"):  # it would spread to every row of a step
        core.runner.load_adapter("x", str(nan))


def test_an_adapter_matches_peft_generating_with_it_unmerged(default_model_dir, adapters):
    """Independent of our merge: PEFT's own model, the adapter kept apart (its LoRA layers run as PEFT runs
    them), greedy `generate` in fp32, against the engine serving the same PEFT folder."""
    import peft
    import transformers

    folder, _ = adapters["a1"]
    core = make_core(default_model_dir)
    core.runner.load_adapter("a1", str(folder))
    base = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, torch_dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    assert not any("merged" in type(m).__name__.lower() for m in reference.modules())
    for i, text in enumerate(PROMPTS):
        prompt = prompt_of(core, text)
        core.add_request(RequestSpec(prompt, greedy(16), request_id=f"p{i}", adapter="a1"))
        ours: list[int] = []
        while core.has_unfinished():
            for o in core.step():
                ours += o.new_token_ids
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                     pad_token_id=base.generation_config.eos_token_id)
        theirs = out[0, len(prompt):].tolist()
        assert ours and ours == theirs[:len(ours)] and len(theirs) - len(ours) <= 1, (text, ours, theirs)  # (+ EOS)


def test_an_adapter_over_gguf_weights_kept_quantized_matches_its_merged_model(default_model_dir, adapters, tmp_path,
                                                                            monkeypatch):
    """LoRA over a quantized base (registry ``quantization: gguf``): the base's Q4_1 blocks multiplied as the model
    holds them, the adapter's A and B in fp32 beside them. With float activations the base's values are the
    dequantized model's, so each request answers as PEFT's merged model (and the base as the plain model)."""
    from tests.model.test_gguf_served import kept_quantized
    from tokenfleet.models.ggml_quant import QuantTensor

    monkeypatch.setenv("TOKENFLEET_QUANT_ACTIVATIONS", "float")
    core = make_core(kept_quantized(default_model_dir, tmp_path / "gguf"), quantization="gguf")
    folder, merged = adapters["a0"]
    core.runner.load_adapter("a0", str(folder))
    assert isinstance(core.runner.model.weights.layers[0].qkv, QuantTensor)  # no dense copy of the base made
    prompts = [prompt_of(core, t) for t in PROMPTS[:2]]
    arrivals = {0: [(f"a0-{i}", p, greedy(12)) for i, p in enumerate(prompts)]}
    ref = make_core(merged)
    want = {rid: run_to_completion(ref, {0: [(rid, p, params)]})[rid] for rid, p, params in arrivals[0]}
    got: dict[str, list[int]] = {}
    for rid, p, params in arrivals[0]:
        core.add_request(RequestSpec(p, params, request_id=rid, adapter="a0"))
        core.add_request(RequestSpec(p, params, request_id=f"base-{rid}"))
        got[rid], got[f"base-{rid}"] = [], []
    while core.has_unfinished():
        for o in core.step():
            got[o.request_id] += o.new_token_ids
    assert {k: v for k, v in got.items() if not k.startswith("base")} == want
    plain = make_core(default_model_dir)
    assert {k: v for k, v in got.items() if k.startswith("base")} == {
        f"base-{rid}": run_to_completion(plain, {0: [(rid, p, params)]})[rid] for rid, p, params in arrivals[0]}
