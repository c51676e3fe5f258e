"""Greedy answers do not depend on load: the same request answers the same alone and beside 31 others, on every
weight format, but where its own top two tokens are a near-tie at the step it leaves the other run (steps of other
sizes take other kernel paths, whose sums round in another order: only a near-tie can turn on that).

Quantized records decode with int8 activations by default (TOKENFLEET_QUANT_ACTIVATIONS=int8) only on steps of up to
INT8_ROWS rows, so their answers do change with the number of requests beside them (docs/models.md,
`tokenfleet doctor`); with TOKENFLEET_QUANT_ACTIVATIONS=float and float32 they do not, which is what is held here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.model.helpers import greedy, make_core
from tests.model.test_gguf_served import kept_quantized
from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.request_spec import RequestSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "correctness_prompts.json"
MAX_TOKENS = 16
NEAR = {"float32": 0.05, "bfloat16": 0.3}  # a top-2 logprob gap below this is a near-tie (test_correctness_gate)
FILLER = ["Write a short poem about autumn leaves.", "List five animals that live in the ocean.",
          "Explain what a rainbow is.", "Give me three tips for better sleep.", "What is a prime number?",
          "Describe a busy market in the morning.", "How do plants drink water?", "Tell me a fact about the moon."]


def prompts(tokenizer) -> list[list[int]]:
    chats = [p["chat"] for p in json.loads(DATA.read_text())["prompts"] if "chat" in p][:8]
    return [tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": c}])) for c in chats]


def run(core, batch: list[list[int]], logprobs: bool = False) -> list[tuple[list[int], list[float]]]:
    """All of ``batch`` at once, greedy: each request's tokens and each step's top-2 margin."""
    for i, ids in enumerate(batch):
        core.add_request(RequestSpec(ids, greedy(MAX_TOKENS, logprobs=2 if logprobs else None), request_id=str(i)))
    out: dict[str, tuple[list[int], list[float]]] = {str(i): ([], []) for i in range(len(batch))}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.top[0][1] - lp.top[1][1] for lp in o.logprobs or [])
    return [out[str(i)] for i in range(len(batch))]


def divergences(core) -> tuple[list[tuple[int, float]], int]:
    """(the first differing step and the alone run's margin there, per request that differs), requests compared."""
    asked = prompts(core.tokenizer)
    alone = [run(core, [ids], logprobs=True)[0] for ids in asked]
    others = [core.tokenizer.encode(render_chat(core.tokenizer, [{"role": "user", "content": f"{c} ({k})"}]))
              for k in range(3) for c in FILLER][: 32 - len(asked)]
    beside = run(core, [*asked, *others])[: len(asked)]
    found = []
    for (tokens, margins), (batched, _) in zip(alone, beside, strict=True):
        if tokens != batched:
            at = next((i for i, (a, b) in enumerate(zip(tokens, batched, strict=False)) if a != b),
                      min(len(tokens), len(batched)))  # or where one of them ended
            found.append((at, margins[min(at, len(margins) - 1)]))
    return found, len(asked)


def check(core, dtype: str) -> None:
    found, compared = divergences(core)
    print(f"{dtype}: {compared - len(found)}/{compared} identical alone and beside 31 others; divergences "
          f"(step, margin): {found}")
    assert all(margin < NEAR[dtype] for _, margin in found), found
    assert len(found) <= compared // 4, found  # near-ties are rare; most answers must not move at all


def test_the_default_path_answers_the_same_alone_and_beside_31_others(default_model_dir):
    core = make_core(default_model_dir, dtype="auto", num_blocks=2048)
    check(core, core.kv_layout().dtype)


@pytest.mark.nightly  # the default suite holds the default path (above) and the GGUF (below)
def test_float32_answers_the_same_alone_and_beside_31_others(default_model_dir):
    check(make_core(default_model_dir, dtype="float32", num_blocks=2048), "float32")


@pytest.mark.parametrize("quantization", ["gguf", pytest.param("int8", marks=pytest.mark.nightly)])
def test_quantized_weights_with_float_activations_answer_the_same_alone_and_beside_31_others(
        default_model_dir, tmp_path, monkeypatch, quantization):
    monkeypatch.setenv("TOKENFLEET_QUANT_ACTIVATIONS", "float")
    folder = kept_quantized(default_model_dir, tmp_path / "gguf") if quantization == "gguf" else default_model_dir
    check(make_core(folder, dtype="float32", quantization=quantization, num_blocks=2048), "float32")


def test_bf16_prefill_in_the_kernel_or_in_sdpa_answers_the_same(default_model_dir):
    """models.prefill_attention sends bf16 prefill chunks to the native kernel or to SDPA by which is faster on the
    machine; the other machine kind takes the other path, so both are held here: the same greedy answers (a long
    prompt too, chunked, and a prefix hit) but at near-ties of the kernel path's own margins."""
    core = make_core(default_model_dir, dtype="bfloat16", num_blocks=2048, max_num_batched_tokens=256)
    attention = core.runner.model.attention
    if not hasattr(attention, "prefill_reason"):
        pytest.skip("no native attention kernel here: prefill chunks go to SDPA on every machine")
    asked = prompts(core.tokenizer)
    long = core.tokenizer.encode(render_chat(core.tokenizer, [{"role": "user", "content": " ".join(FILLER * 6)}]))
    batch = [*asked, long, long[:-3]]  # > 256 tokens: chunked, with context; the second shares the first's prefix
    answers = {}
    for in_kernel in (True, False):
        attention.handles_prefill = in_kernel
        answers[in_kernel] = [run(core, [ids], logprobs=True)[0] for ids in batch]
    found = []
    for (tokens, margins), (other, _) in zip(answers[True], answers[False], strict=True):
        if tokens != other:
            at = next((i for i, (a, b) in enumerate(zip(tokens, other, strict=False)) if a != b), len(tokens))
            found.append((at, margins[min(at, len(margins) - 1)]))
    print(f"bf16 prefill kernel vs SDPA: {len(batch) - len(found)}/{len(batch)} identical; divergences {found}")
    assert all(margin < NEAR["bfloat16"] for _, margin in found), found
    assert len(found) <= len(batch) // 4, found
