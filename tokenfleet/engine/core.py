"""The synchronous engine core: ``add_request``, ``abort``, ``step`` (schedule -> execute -> update).

Not thread-safe: one thread owns it (the async bridge runs it in a dedicated thread).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenfleet.engine.detokenizer import Decoder
from tokenfleet.engine.output import OutputState, RequestOutput, TokenLogprobs
from tokenfleet.engine.request import FinishReason, Priority, Request
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerOutput
from tokenfleet.engine.stats import EngineStats, StepTimer


@dataclass(frozen=True)
class ExecuteResult:
    sampled: dict[str, int]  # request id -> token, for scheduled entries that sample
    logprobs: dict[str, TokenLogprobs]


class ModelRunner(Protocol):
    """What the core needs from a backend: run one scheduled batch, forget a request."""

    def execute(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> ExecuteResult: ...

    def release(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Decoder | None, model: ModelInfo):
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.model = model
        self._states: dict[str, OutputState] = {}
        self._ids = itertools.count()
        self.stats = EngineStats()
        self._timer = StepTimer()

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = Priority.INTERACTIVE,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. ValueError for bad input, QueueFullError when full."""
        prompt = self._validate_prompt(prompt_token_ids)
        limit = self.model.max_model_len - len(prompt)
        max_tokens = limit if sampling_params.max_tokens is None else min(sampling_params.max_tokens, limit)
        request = Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=prompt,
            sampling_params=sampling_params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=int(priority),
            max_tokens=max_tokens,
            eos_token_ids=self.model.eos_token_ids,
        )
        self.scheduler.add_request(request)
        self._states[request.request_id] = OutputState(request, self.tokenizer)
        return request.request_id

    def _validate_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) >= self.model.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; the model's context is {self.model.max_model_len} "
                "and at least one token must be generated"
            )
        bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model.vocab_size}): {bad[:5]}")
        return prompt

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; frees its blocks. Returns its final output, or None if unknown/finished."""
        request = self.scheduler.finish_request(request_id, FinishReason.ABORT)
        state = self._states.pop(request_id, None)
        self.runner.release(request_id)
        if request is None or state is None:
            return None
        self.stats.num_aborted += 1
        return state.finish(state.empty_output(), FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        with self._timer:
            result = self.runner.execute(output, self.scheduler.requests)
        finished = {r.request_id: r for r in self.scheduler.update(output, result.sampled)}
        outputs = []
        for entry in output.scheduled:
            if entry.samples and entry.request_id in result.sampled:
                outputs.append(self._process(entry.request_id, result, finished))
        self.stats.record_step(self._timer.last, output.num_scheduled_tokens)
        return outputs

    def _process(self, request_id: str, result: ExecuteResult, finished: dict[str, Request]) -> RequestOutput:
        state = self._states[request_id]
        request = finished.get(request_id)
        by_token = request is not None and request.finish_reason is FinishReason.STOP
        out = state.on_token(result.sampled[request_id], result.logprobs.get(request_id), by_token)
        if request is None and state.matcher.matched is not None:
            request = self.scheduler.finish_request(request_id, FinishReason.STOP)
        if request is not None and request.finish_reason is not None:
            self._states.pop(request_id)
            self.runner.release(request_id)
            self.stats.record_finished(request)
            out = state.finish(out, request.finish_reason)
        return out

    def snapshot(self) -> EngineStats:
        """Current counters and gauges (copied)."""
        bm = self.scheduler.block_manager
        return self.stats.snapshot(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
        )
