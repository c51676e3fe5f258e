"""The gateway's one pipeline turns worker responses into typed choice events; the OpenAI and the
public gRPC encoders render the same events (no network: responses are built by hand)."""

from __future__ import annotations

import asyncio
import json

import pytest
from tokenfleet.services.gateway import events as ev
from tokenfleet.services.gateway.catalog import ServedModel
from tokenfleet.services.gateway.grpc_encoder import GrpcEncoder
from tokenfleet.services.gateway.openai_encoder import OpenAIEncoder
from tokenfleet.services.gateway.pipeline import Prepared, Translator

from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.v1 import common_pb2, engine_pb2

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.fixture(scope="module")
def model(default_model_dir):
    return ServedModel("m", "m@1", Tokenizer(default_model_dir), 2048)


def chunk(text: str, index: int = 0, logprobs: list[tuple[int, float]] = (), prompt_logprobs=()) -> engine_pb2.GenerateResponse:
    def lp(token_id: int, value: float) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(token_id=token_id, logprob=value,
                                       top=[common_pb2.TopLogprob(token_id=token_id, logprob=value)])

    return engine_pb2.GenerateResponse(chunk=engine_pb2.TokenChunk(
        token_ids=[1], text=text, index=index, logprobs=[lp(*x) for x in logprobs],
        prompt_logprobs=[lp(*x) for x in prompt_logprobs]))


def final(index: int = 0, reason: int = common_pb2.FINISH_REASON_STOP) -> engine_pb2.GenerateResponse:
    return engine_pb2.GenerateResponse(final=engine_pb2.GenerateFinal(
        finish_reason=reason, index=index, usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=3)))


def translate(prepared: Prepared, responses: list[engine_pb2.GenerateResponse]) -> list[ev.ChoiceEvent]:
    translator = Translator(prepared)
    out = translator.start()
    for r in responses:
        out += translator.feed(r)
    return [*out, ev.Ended(ev.Usage(5, 3, 0))]


async def _aiter(events):
    for event in events:
        yield event


def render(gen) -> list:
    async def collect():
        return [x async for x in gen]
    return asyncio.run(collect())


def test_a_call_split_across_chunks_is_one_call_in_every_rendering(model):
    prepared = Prepared(model, RequestSpec([1, 2, 3], SamplingParams(logprobs=1), "chatcmpl-1"), False, tools=True)
    pieces = [CALL[:7], CALL[7:30], CALL[30:52], CALL[52:]]
    events = translate(prepared, [chunk(p, logprobs=[(10 + i, -0.5)]) for i, p in enumerate(pieces)] + [final()])
    assert isinstance(events[0], ev.Opened)
    started = [e for e in events if isinstance(e, ev.ToolCallStarted)]
    assert [e.call.name for e in started] == ["get_weather"]
    arguments = "".join(e.fragment for e in events if isinstance(e, ev.ToolArguments))
    assert json.loads(arguments) == {"city": "Oslo"}
    done = [e for e in events if isinstance(e, ev.Finished)][0]
    assert done.reason == "tool_calls" and done.content is None and done.tool_calls[0].arguments == arguments
    # Every chunk's logprobs are passed on exactly once, also while the parser holds the call's head.
    assert sum(len(getattr(e, "logprobs", ())) for e in events) == len(pieces)

    encoder = OpenAIEncoder("chatcmpl-1", "m", True, True, tools=True)
    body = asyncio.run(encoder.chat_body(_aiter(events)))
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == arguments
    assert body["choices"][0]["finish_reason"] == "tool_calls" and len(body["choices"][0]["logprobs"]["content"]) == 4

    sse = [x.decode() for x in render(encoder.chat_stream(_aiter(events)))]
    chunks = [json.loads(x.removeprefix("data: ")) for x in sse[:-1]]
    assert sse[-1] == "data: [DONE]\n\n" and chunks[-1]["usage"]["total_tokens"] == 8
    streamed = "".join(c["choices"][0]["delta"].get("tool_calls", [{}])[0].get("function", {}).get("arguments", "")
                       for c in chunks if c["choices"])
    assert streamed == arguments

    messages = render(GrpcEncoder("chatcmpl-1", "m", True).chat(_aiter(events)))
    grpc_arguments = "".join(call.function.arguments for m in messages for c in m.choices for call in c.tool_calls)
    assert grpc_arguments == arguments
    assert messages[-2].choices[0].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert messages[-1].usage.prompt_tokens == 5


def test_completion_echo_comes_first_with_prompt_logprobs_and_offsets_follow_it(model):
    prompt = model.tokenizer.encode("The sea is")
    prepared = Prepared(model, RequestSpec(prompt, SamplingParams(logprobs=1, prompt_logprobs=1), "cmpl-1"), False,
                        echo="The sea is", chat=False)
    prompt_lps = [(t, -1.0) for t in prompt[1:]]
    events = translate(prepared, [chunk(" blue", logprobs=[(42, -0.1)], prompt_logprobs=prompt_lps), chunk(""),
                                  chunk(" and", logprobs=[(43, -0.2)]), final(reason=common_pb2.FINISH_REASON_LENGTH)])
    echo, first, empty, second = events[:4]
    assert isinstance(echo, ev.Echo) and echo.text == "The sea is" and echo.logprobs[0].logprob is None
    assert len(echo.logprobs) == len(prompt)
    assert (first.text, first.offset) == (" blue", len("The sea is")) and second.offset == len("The sea is blue")
    assert empty == ev.Text(0, "", len("The sea is blue"))  # completions pass every chunk on, as before

    body = asyncio.run(OpenAIEncoder("cmpl-1", "m", True, False).completion_body(_aiter(events)))
    choice = body["choices"][0]
    assert choice["text"] == "The sea is blue and" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["tokens"]) == len(prompt) + 2
    assert choice["logprobs"]["text_offset"][-2:] == [len("The sea is"), len("The sea is") + len(first.logprobs[0].token)]

    messages = render(GrpcEncoder("cmpl-1", "m", False).completion(_aiter(events)))
    assert messages[0].choices[0].text == "The sea is" and len(messages[0].choices[0].logprobs) == len(prompt) - 1
    assert "".join(c.text for m in messages for c in m.choices) == "The sea is blue and"
    assert messages[-1].choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH  # no usage chunk: not asked


def test_samples_are_kept_apart_by_index(model):
    prepared = Prepared(model, RequestSpec([1], SamplingParams(n=2), "chatcmpl-2"), True)
    events = translate(prepared, [chunk("a", 0), chunk("b", 1), chunk("c", 0), final(1), final(0)])
    body = asyncio.run(OpenAIEncoder("chatcmpl-2", "m", False, True).chat_body(_aiter(events)))
    assert [c["message"]["content"] for c in body["choices"]] == ["ac", "b"]
    assert [e.index for e in events if isinstance(e, ev.Opened)] == [0, 1]
