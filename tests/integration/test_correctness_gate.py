"""What the serving path answers, checked against a reference engine run in the same test.

The default path: `tokenfleet up` on its defaults (the default model; the dtype `auto` picks on this machine, named
in the worker's `dtype auto` log line: float32 on a CPU without AVX512-BF16 or AMX, bfloat16 where bf16 measured
faster), the gateway and the official openai client, greedy, on thirteen short factual and instruction prompts of 6
to 555 prompt tokens (chat and raw completions, tests/data/correctness_prompts.json). The reference: the same engine
in this process in float32 on the torch reference kernels. In fp32 the first 16 tokens must be identical on all but
one, and a divergence may only start where the reference's top-2 logits are within 0.05 of each other; in bf16 a
divergence may only start at a near-tie of the reference (below), on at most three. The Japan question (the README's:
its answer leads by >= 0.97 at every token in fp32, in bf16 with the native kernels and with the torch kernels) must
be answered with Tokyo.

The bf16 path with the native CPU kernels (`up --dtype bfloat16`): every kernel must have passed its check at load and
the native attention must be what serves; against the fp32 reference engine, a divergence may only start at a
near-tie. bf16 rounds every activation to 8 bits of mantissa, and implementations that round in another order move
a near-tie's margin by up to ~0.2 (the France question's first token leads by 0.082 in fp32, by 0.086 with the
native bf16 kernels on an AMD EPYC and by 0.25 with the torch reference kernels in bf16), so "near" is 0.3 here; a
wrong kernel changes answers where the model is sure.

Gemma 3 on raw completions (fp32): the prompt is tokenized as its tokenizer does by default (with ``<bos>``), and the
greedy continuations equal transformers' on five prompts.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import openai
import pytest
import torch

from tests.integration.conftest import start_up
from tests.model.helpers import make_core
from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams

PROMPTS = json.loads((Path(__file__).resolve().parents[1] / "data" / "correctness_prompts.json").read_text())["prompts"]
MAX_TOKENS = 16


def serve_all(url: str, model: str) -> dict[str, str]:
    """Each prompt alone (one request at a time, as the reference runs them), greedy."""
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    texts = {}
    for p in PROMPTS:
        if "chat" in p:
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p["chat"]}],
                                                   temperature=0, max_tokens=MAX_TOKENS)
            texts[p["id"]] = reply.choices[0].message.content or ""
        else:
            done = client.completions.create(model=model, prompt=p["completion"], temperature=0, max_tokens=MAX_TOKENS)
            texts[p["id"]] = done.choices[0].text
    return texts


@functools.cache
def reference(model_dir: Path, dtype: str) -> dict[str, dict]:
    """The same engine in this process on the torch reference kernels: tokens, text and each step's top-2 margin."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENFLEET_KERNELS", "torch")
        core = make_core(model_dir, dtype=dtype, num_blocks=1024)
    tok = core.tokenizer
    out = {}
    for p in PROMPTS:
        ids = tok.encode(render_chat(tok, [{"role": "user", "content": p["chat"]}])) if "chat" in p else \
            tok.encode_prompt(p["completion"])
        core.add_request(RequestSpec(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2), request_id=p["id"]))
        tokens: list[int] = []
        margins: list[float] = []
        while core.has_unfinished():
            for o in core.step():
                tokens += o.new_token_ids
                margins += [lp.top[0][1] - lp.top[1][1] for lp in o.logprobs or []]
        out[p["id"]] = {"prompt_tokens": len(ids), "tokens": tokens, "margins": margins, "text": tok.decode(tokens)}
    return out


def divergences(served: dict[str, str], ref: dict[str, dict], model_dir: Path) -> dict[str, tuple[int, float]]:
    """prompt id -> (index of the first token where the served text leaves the reference's, the reference's top-2
    margin there)."""
    from tokenfleet.models.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    found = {}
    for key, r in ref.items():
        if served[key] == r["text"]:
            continue
        at = next((i for i in range(len(r["tokens"])) if not served[key].startswith(tok.decode(r["tokens"][: i + 1]))),
                  len(r["tokens"]) - 1)
        found[key] = (at, r["margins"][at])
    return found


def test_up_on_its_defaults_answers_as_the_reference_engine(default_model_dir, tmp_path):
    up = start_up(tmp_path, "--workers", "1", "--model", str(default_model_dir), "--model-name", "smol")
    try:
        served = serve_all(up.announced["gateway:"], "smol")
    finally:
        up.stop()
    chosen = [json.loads(line) for line in up.log.read_text().splitlines()
              if line.startswith("{") and '"event": "dtype auto"' in line]
    assert chosen and chosen[0]["source"] in ("flags", "measured", "cached", "device"), chosen
    dtype = chosen[0]["dtype"]  # what "auto" picked on this machine, and why (the log line's reason)
    ref = reference(default_model_dir, "float32")
    lengths = sorted(r["prompt_tokens"] for r in ref.values())
    assert lengths[0] <= 8 and lengths[-1] >= 500, lengths
    found = divergences(served, ref, default_model_dir)
    print(f"default path ({dtype}: {chosen[0]['reason']}): {len(PROMPTS) - len(found)}/{len(PROMPTS)} identical; "
          f"divergences (token, reference margin): {found}")
    assert len(found) <= (1 if dtype == "float32" else 3), found
    # in bf16 near-ties move by up to ~0.2 with the rounding (the module docstring)
    assert all(margin < (0.05 if dtype == "float32" else 0.3) for _, margin in found.values()), found
    assert "Tokyo" in served["japan"], served["japan"]


@pytest.mark.nightly  # not the CPU default: the kernels it serves are held by the property tests in the default suite
def test_bf16_native_kernels_answer_as_the_fp32_reference_but_at_near_ties(default_model_dir, tmp_path):
    from tokenfleet import envs
    from tokenfleet.models import native

    if torch.cuda.is_available() or native.compiler() is None or not envs.native_kernels():
        pytest.skip("the native CPU kernels do not serve here (a GPU, no C compiler, or TOKENFLEET_NATIVE_KERNELS=0)")
    up = start_up(tmp_path, "--workers", "1", "--model", str(default_model_dir), "--model-name", "smol",
                  "--dtype", "bfloat16")
    try:
        served = serve_all(up.announced["gateway:"], "smol")
    finally:
        up.stop()
    checks = {c["kernel"]: c for c in map(json.loads, (line for line in up.log.read_text().splitlines()
                                                       if line.startswith("{") and '"event": "kernel"' in line))}
    assert set(checks) == {"paged_attention", "layer_ops", "temperature_sampling"}, checks
    assert all(c["check"] == "passed" and c["serving"] == c["implementation"] for c in checks.values()), checks
    assert checks["paged_attention"]["serving"].startswith("native paged attention"), checks
    ref = reference(default_model_dir, "float32")
    found = divergences(served, ref, default_model_dir)
    print(f"bf16 native: {len(PROMPTS) - len(found)}/{len(PROMPTS)} identical; divergences (token, reference margin): {found}")
    assert all(margin < 0.3 for _, margin in found.values()), found
    assert len(found) <= 3, found


GEMMA_PROMPTS = ["The three primary colors are", "The capital of France is", "Water freezes at a temperature of",
                 "The largest planet in the solar system is", "To make a cup of tea, first"]


@pytest.mark.nightly  # ~31 s; tests/model/test_gemma3_parity.py keeps Gemma 3 against transformers in the suite
def test_gemma3_raw_completions_tokenize_with_bos_and_equal_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenfleet.models.gguf_import import GEMMA3_MODEL_NAME, ensure_model

    gemma = ensure_model(GEMMA3_MODEL_NAME)
    up = start_up(tmp_path, "--workers", "1", "--model", f"gemma={gemma}", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=up.announced["gateway:"], api_key="unused", max_retries=0, timeout=300)
        served = {p: client.completions.create(model="gemma", prompt=p, temperature=0, max_tokens=12) for p in GEMMA_PROMPTS}
        # echo with logprobs: the <bos> the tokenizer adds is a token with no text, so the tokens join up to the echo
        echoed = client.completions.create(model="gemma", prompt=GEMMA_PROMPTS[0], echo=True, logprobs=1, max_tokens=1,
                                           temperature=0).choices[0]
    finally:
        up.stop()
    tok = AutoTokenizer.from_pretrained(str(gemma))
    hf = AutoModelForCausalLM.from_pretrained(str(gemma), dtype=torch.float32).eval()
    for prompt, reply in served.items():
        ids = tok(prompt, return_tensors="pt")  # the tokenizer's default special tokens: <bos> first
        assert int(ids.input_ids[0, 0]) == tok.bos_token_id
        assert reply.usage.prompt_tokens == ids.input_ids.shape[1]
        with torch.inference_mode():
            out = hf.generate(**ids, max_new_tokens=12, do_sample=False)
        expected = tok.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)
        assert reply.choices[0].text == expected, (prompt, reply.choices[0].text, expected)
    assert "red" in served["The three primary colors are"].choices[0].text.lower()
    tokens, offsets = echoed.logprobs.tokens, echoed.logprobs.text_offset
    assert tokens[0] == "" and offsets[0] == 0 and "".join(tokens) == echoed.text
    assert all(offsets[i + 1] == offsets[i] + len(tokens[i]) for i in range(len(tokens) - 1))
