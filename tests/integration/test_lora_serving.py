"""LoRA adapters through every layer: `tokenfleet up --lora a0=PATH` (fp32), the real `openai` client asks for
model `smol:a0`, and gets what PEFT's merged model gives greedily (run here in-process); `smol` stays the base
model; an adapter the workers do not have is a 400 naming it."""

from __future__ import annotations

import openai
import pytest

from tests.model.helpers import greedy, make_core, run_to_completion
from tests.model.test_lora import make_adapter
from tokenfleet import launcher
from tokenfleet.api.chat_template import render_chat

QUESTION = "Name three fruits."


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    make_adapter(default_model_dir, root / "a0", root / "merged", seed=3)
    cluster = launcher.up(1, str(default_model_dir), "smol", 1, 0, dtype="float32", record=False,
                          lora=[f"a0={root / 'a0'}"])
    yield cluster, root
    cluster.stop()


def test_an_adapter_is_served_as_model_base_colon_name(served, default_model_dir):
    cluster, root = served
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]

    def ask(model: str) -> str:
        return client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0) \
            .choices[0].message.content or ""

    merged = make_core(root / "merged")
    prompt = merged.tokenizer.encode(render_chat(merged.tokenizer, messages))
    expected = merged.tokenizer.decode(run_to_completion(merged, {0: [("m", prompt, greedy(12))]})["m"])
    base = make_core(default_model_dir)
    plain = base.tokenizer.decode(run_to_completion(base, {0: [("b", prompt, greedy(12))]})["b"])
    assert ask("smol:a0") == expected
    assert ask("smol") == plain != expected
    with pytest.raises(openai.BadRequestError, match="nope"):
        ask("smol:nope")
