"""What the engine reports for a request after a step, and the per-request output state."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet.engine.detokenizer import Decoder, IncrementalDetokenizer, StopStringMatcher
from tokenfleet.engine.request import FinishReason, Request


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # log-softmax of the raw logits (before temperature and penalties)
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Resume:
    """Output another replica already delivered for a request that continues here."""

    output_token_ids: tuple[int, ...]
    text: str  # what the client received for them (stop-string hold-back can make it shorter)


@dataclass
class RequestOutput:
    """Delta for one request from one step (or its final report)."""

    request_id: str
    new_token_ids: list[int]
    text: str  # new text, never containing (part of) a stop string
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None  # set when the engine failed the request (not a user error)
    index: int = 0  # which of the request's n samples
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., on the first output
    num_preemptions: int = 0
    queued_seconds: float | None = None  # arrival -> first scheduled (None: not scheduled yet)
    retained_bytes: int = 0  # on the final output: KV bytes kept retained for its conversation (retention_s)


class OutputState:
    """Detokenizer + stop-string matcher for one request; lives from add to finish."""

    def __init__(self, request: Request, tokenizer: Decoder | None, resumed_text: str | None = None):
        """``resumed_text``: the request carries output tokens another replica delivered with this text."""
        params = request.sampling_params
        self.request = request
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, request.all_token_ids, params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self._pending = ""  # resumed: text of the delivered tokens the client has not received yet
        self._sent_prompt_logprobs = False
        if tokenizer is not None and request.output_token_ids:
            emitted = resumed_text or ""
            full = IncrementalDetokenizer.text_of(tokenizer, request.prompt_token_ids, request.output_token_ids,
                                                  params.skip_special_tokens)
            self.matcher.prime(emitted)
            self._pending = full[len(emitted):] if full.startswith(emitted) else ""

    def on_token(self, token_id: int, logprobs: TokenLogprobs | None, finished_by_token: bool) -> RequestOutput:
        """Process one sampled token. If a stop string matches, ``matcher.matched`` is set."""
        text = ""
        if self.detokenizer is not None and not finished_by_token:
            text = self.matcher.feed(self._pending + self.detokenizer.push(token_id))
            self._pending = ""
        out = self._output([token_id], text)
        if logprobs is not None:
            out.logprobs.append(logprobs)
        if self.request.sampling_params.prompt_logprobs is not None and not self._sent_prompt_logprobs:
            out.prompt_logprobs = list(self.request.prompt_logprobs)
            self._sent_prompt_logprobs = True
        return out

    def finish(self, out: RequestOutput, reason: FinishReason) -> RequestOutput:
        """Mark ``out`` final; release held-back text unless a stop string ended the request."""
        if self.detokenizer is not None and self.matcher.matched is None:
            out.text += self.matcher.feed(self._pending + self.detokenizer.flush()) + self.matcher.flush()
            self._pending = ""
        out.finished = True
        out.finish_reason = reason
        out.num_output_tokens = len(self.request.output_token_ids)
        if self.matcher.matched is not None:
            out.stop_reason = self.matcher.matched
        elif reason is FinishReason.STOP and self.request.output_token_ids:
            out.stop_reason = self.request.output_token_ids[-1]
        return out

    def _output(self, token_ids: list[int], text: str) -> RequestOutput:
        r = self.request
        return RequestOutput(
            request_id=r.request_id,
            new_token_ids=token_ids,
            text=text,
            num_prompt_tokens=r.num_prompt_tokens,
            num_cached_tokens=r.num_cached_tokens,
            num_output_tokens=len(r.output_token_ids),
            index=r.index,
            num_preemptions=r.num_preemptions,
            queued_seconds=None if r.first_scheduled_time is None else max(0.0, r.first_scheduled_time - r.arrival_time),
        )

    def empty_output(self) -> RequestOutput:
        return self._output([], "")
