"""A request's state as the scheduler and engine see it. Glossary: request, block, prefix hash."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    REMOTE_PREFILL = "remote_prefill"  # blocks reserved; the prompt's KV is arriving from a prefill replica
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller


class Priority(enum.IntEnum):
    """Lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(eq=False)
class Request:
    """Mutable lifecycle state of one request; owned by the scheduler.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; it catches up with
    ``num_tokens`` (prompt + output) one scheduled chunk at a time: prefill, chunked
    prefill and decode are the same model.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = Priority.INTERACTIVE
    max_tokens: int = 16  # resolved limit: sampling max_tokens capped by the context
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # when its first chunk was scheduled (arrival -> this: its queue wait)
    first_token_time: float | None = None  # when its first output token was sampled (its TPOT's clock starts)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks of all_token_ids
    hold_blocks: bool = False  # prefill role: keep the blocks when finished, for a KV transfer
    tenant: str = ""  # who is billed; tenants of one priority are queued fairly (FairQueue)
    cache_scope: str = ""  # who may share its cached blocks (tokenfleet.kvcache.salt); "" = everyone
    guide: Any = None  # grammar matcher (llguidance.LLMatcher) when sampling_params.guided is set
    index: int = 0  # which of the n samples of its group (forks share the prompt's blocks)
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs of prompt tokens 1.. (prompt_logprobs set)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative proposals to verify this step
    adapter: str = ""  # the LoRA adapter it runs with ("" = the base model)
    conversation: str = ""  # retention's key when it ends ("" = its request id)
    retention_s: float = 0.0  # when it ends (stop or length): keep its blocks retained this long (engine.retention)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
