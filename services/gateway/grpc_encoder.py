"""Choice events (events.py) -> the public gRPC API's chunk messages (inference.proto)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from tokenfleet.services.gateway import events as ev

from tokenfleet.v1 import common_pb2, inference_pb2

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS,
}


def logprobs(entries: tuple[ev.Logprob, ...], offset: int) -> list[inference_pb2.TokenLogprobs]:
    def token(text: str, logprob: float | None) -> inference_pb2.LogprobToken:
        return inference_pb2.LogprobToken(token=text, logprob=logprob or 0.0, bytes=text.encode())

    out = []
    for lp in entries:
        out.append(inference_pb2.TokenLogprobs(token=token(lp.token, lp.logprob),
                                               top_logprobs=[token(t, v) for t, v in lp.top], text_offset=offset))
        offset += len(lp.token)
    return out


def usage(u: ev.Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                            cached_prompt_tokens=u.cached_tokens)


@dataclass
class GrpcEncoder:
    request_id: str
    model: str
    include_usage: bool

    def _chunk(self, kind: type, **kw: Any) -> Message:
        return kind(id=self.request_id, model=self.model, created=int(time.time()), **kw)

    async def chat(self, events: AsyncIterator[ev.ChoiceEvent]) -> AsyncIterator[Message]:
        def choice(delta: inference_pb2.ChatChoiceDelta) -> Message:
            return self._chunk(inference_pb2.ChatCompletionChunk, choices=[delta])

        async for event in events:
            if isinstance(event, ev.Opened):
                yield choice(inference_pb2.ChatChoiceDelta(index=event.index, role="assistant"))
            elif isinstance(event, ev.Text):
                yield choice(inference_pb2.ChatChoiceDelta(index=event.index, content=event.text,
                                                           logprobs=logprobs(event.logprobs, 0)))
            elif isinstance(event, ev.ToolCallStarted):
                call = inference_pb2.ToolCall(index=event.call_index, id=event.call.id, type="function",
                                              function=inference_pb2.FunctionCall(name=event.call.name))
                yield choice(inference_pb2.ChatChoiceDelta(index=event.index, tool_calls=[call],
                                                           logprobs=logprobs(event.logprobs, 0)))
            elif isinstance(event, ev.ToolArguments):
                call = inference_pb2.ToolCall(index=event.call_index,
                                              function=inference_pb2.FunctionCall(arguments=event.fragment))
                yield choice(inference_pb2.ChatChoiceDelta(index=event.index, tool_calls=[call],
                                                           logprobs=logprobs(event.logprobs, 0)))
            elif isinstance(event, ev.Finished):
                yield choice(inference_pb2.ChatChoiceDelta(index=event.index, finish_reason=FINISH[event.reason]))
            elif isinstance(event, ev.Ended) and self.include_usage:
                yield self._chunk(inference_pb2.ChatCompletionChunk, usage=usage(event.usage))

    async def completion(self, events: AsyncIterator[ev.ChoiceEvent]) -> AsyncIterator[Message]:
        def choice(delta: inference_pb2.CompletionChoiceDelta) -> Message:
            return self._chunk(inference_pb2.CompletionChunk, choices=[delta])

        async for event in events:
            if isinstance(event, ev.Echo):  # the prompt's tokens after the first carry logprobs when asked
                lp = logprobs(event.logprobs[1:], len(event.logprobs[0].token)) if event.logprobs else []
                yield choice(inference_pb2.CompletionChoiceDelta(index=event.index, text=event.text, logprobs=lp))
            elif isinstance(event, ev.Text):
                yield choice(inference_pb2.CompletionChoiceDelta(index=event.index, text=event.text,
                                                                 logprobs=logprobs(event.logprobs, event.offset)))
            elif isinstance(event, ev.Finished):
                yield choice(inference_pb2.CompletionChoiceDelta(index=event.index,
                                                                 finish_reason=FINISH[event.reason]))
            elif isinstance(event, ev.Ended) and self.include_usage:
                yield self._chunk(inference_pb2.CompletionChunk, usage=usage(event.usage))
