"""A request's worker responses -> its choice events (``events.py``): tool-call parsing, echo, text offsets,
logprob tokens, one ``_Choice`` per sample."""

from __future__ import annotations

import dataclasses

import structlog
from tokenfleet.services.gateway import events as ev
from tokenfleet.services.gateway.request import Prepared

from tokenfleet.api.tools import CallStarted, ContentText, ToolCallParser, ToolEvent, parse
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.v1 import common_pb2, engine_pb2

log = structlog.get_logger()
FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


def logprobs_of(tokenizer: Tokenizer, logprobs: list[common_pb2.TokenLogprob]) -> tuple[ev.Logprob, ...]:
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return tuple(ev.Logprob(text(lp.token_id), lp.logprob, tuple((text(t.token_id), t.logprob) for t in lp.top))
                 for lp in logprobs)


class Translator:
    """A request's worker responses -> its choice events (one ``_Choice`` per sample)."""

    def __init__(self, prepared: Prepared):
        self.choices = [_Choice(prepared, index) for index in range(prepared.params.n)]

    def start(self) -> list[ev.ChoiceEvent]:
        return [event for choice in self.choices for event in choice.opened()]

    def feed(self, response: engine_pb2.GenerateResponse) -> list[ev.ChoiceEvent]:
        if response.HasField("chunk"):
            return self.choices[response.chunk.index].chunk(response.chunk)
        return self.choices[response.final.index].final(response.final)


class _Choice:
    """One choice's worker chunks -> events: tool-call parsing, echo, text offsets, logprob tokens."""

    def __init__(self, prepared: Prepared, index: int):
        self.prepared, self.index = prepared, index
        self.tokenizer = prepared.model.tokenizer
        self.parser = ToolCallParser() if prepared.tools else None
        self.text = ""
        self.offset = len(prepared.echo)
        self.echoed = not prepared.echo

    def opened(self) -> list[ev.ChoiceEvent]:
        return [ev.Opened(self.index)] if self.prepared.chat else []

    def _echo(self, chunk: engine_pb2.TokenChunk | None) -> list[ev.ChoiceEvent]:
        """The prompt first, with its logprobs (they come on the first chunk) when logprobs were asked for."""
        if self.echoed:
            return []
        self.echoed = True
        logprobs: tuple[ev.Logprob, ...] = ()
        if self.prepared.params.logprobs is not None:
            prompt = self.prepared.prompt
            values = list(chunk.prompt_logprobs) if chunk is not None else []
            first = ev.Logprob(self.tokenizer.decode(prompt[:1], skip_special_tokens=False), None)
            logprobs = (first, *logprobs_of(self.tokenizer, values))
            # tokens the tokenizer added (not in the echoed text) get no text: the tokens join up to the echo, offsets hold
            added = self.prepared.echo_added
            logprobs = tuple(dataclasses.replace(lp, token="") for lp in logprobs[:added]) + logprobs[added:]
        return [ev.Echo(self.index, self.prepared.echo, logprobs)]

    def chunk(self, chunk: engine_pb2.TokenChunk) -> list[ev.ChoiceEvent]:
        out = self._echo(chunk)
        logprobs = logprobs_of(self.tokenizer, list(chunk.logprobs))
        self.text += chunk.text
        parts: list[ToolEvent] = [ContentText(chunk.text)] if chunk.text else []
        if self.parser is not None:
            try:
                parts = self.parser.feed(chunk.text)
            except ValueError as e:  # not a well-formed call (the grammar prevents it): the rest is text
                log.warning("tool call output does not parse; passing it on as text", error=str(e))
                self.parser = None
        if not parts and (logprobs or not self.prepared.chat):
            parts = [ContentText("")]  # held by the call parser, the logprobs go now (completions: every chunk)
        for i, part in enumerate(parts):
            out.append(self._event(part, logprobs if i == 0 else ()))
        self.offset += len(chunk.text)
        return out

    def _event(self, part: ToolEvent, logprobs: tuple[ev.Logprob, ...]) -> ev.ChoiceEvent:
        if isinstance(part, ContentText):
            return ev.Text(self.index, part.text, self.offset, logprobs)
        if isinstance(part, CallStarted):
            return ev.ToolCallStarted(self.index, part.index, part.call, logprobs)
        return ev.ToolArguments(self.index, part.index, part.fragment, logprobs)

    def final(self, final: engine_pb2.GenerateFinal) -> list[ev.ChoiceEvent]:
        out = self._echo(None)
        reason = FINISH.get(final.finish_reason, "stop")
        content: str | None = self.text
        calls: tuple = ()
        if self.parser is not None:
            out += [self._event(part, ()) for part in self.parser.finish()]
        if self.prepared.tools:
            content, parsed = parse(self.text)  # the whole text: the same calls the stream parser found
            calls = tuple(parsed)
            if calls and reason == "stop":
                reason = "tool_calls"
        out.append(ev.Finished(self.index, reason, self.text, content, calls))
        return out
