"""One request, as asked: the frozen record every layer passes whole.

The gateway builds it once at its edge from the OpenAI or gRPC body (``tokenfleet.api.openai_schema``), the
pipeline and the dispatcher carry it, ``services/common/convert.py`` turns it into the worker's proto and back,
and ``Engine.generate`` / ``EngineCore.add_request`` take it as it is. A field added here, in the body's schema,
in engine.proto and in the converter reaches the engine and its logs (``log_fields``) without touching the
layers in between.

It is not the scheduler's ``Request`` (``request.py``): that one is the mutable state of a running request,
built from this record by the engine core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenfleet.engine.kv_transfer import KVSource
from tokenfleet.engine.output import Resume
from tokenfleet.engine.request import Priority
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.kvcache.salt import adapter_scope


@dataclass(frozen=True)
class RequestSpec:
    """What to run, for whom, and from where.

    ``request_id``: the engine's id for it (None: the engine core names it). ``limit``: the output tokens it may
    produce, as the edge resolved it for the model it was placed on (None: the engine resolves it from
    ``sampling_params.max_tokens`` and its context). ``cache_scope``: who may share its cached prefix
    (``tokenfleet.kvcache.salt.request_scope``, without the adapter); ``kv_scope`` adds the adapter, as every block
    hash of the request is salted. ``resume``: output another replica already delivered. ``kv_source``: take the
    prompt's first token and KV from a prefill replica. ``hold_kv``: keep the blocks when done (prefill role).
    ``client_request_id``: the caller's own id (x-request-id), for logs and traces across hops.
    ``conversation``: the conversation the request continues (a stored response chain, or the client's
    ``prompt_cache_key``), as a digest already scoped to the tenant's cache scope ("" = none): the router keeps a
    conversation on the replica that holds its transcript. ``retention_s``: when the request ends, keep its blocks
    (prompt and output) cached at a priority above plain LRU for this many seconds, because the conversation is
    expected back (0 = plain LRU); released early by ``Engine.release(conversation)``.
    """

    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams
    request_id: str | None = None
    priority: int = Priority.INTERACTIVE
    arrival_time: float | None = None  # time.monotonic() of arrival (None: when the engine takes it)
    resume: Resume | None = None
    hold_kv: bool = False
    tenant: str = ""  # who is billed; tenants of one priority are queued fairly
    cache_scope: str = ""
    adapter: str = ""  # a LoRA adapter loaded on the engine ("" = the base model)
    kv_source: KVSource | None = None
    client_request_id: str = ""
    limit: int | None = None
    conversation: str = ""
    retention_s: float = 0.0
    kv_scope: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "priority", int(self.priority))
        object.__setattr__(self, "kv_scope", adapter_scope(self.cache_scope, self.adapter))
        if self.retention_s < 0:
            raise ValueError(f"retention_s must not be negative, got {self.retention_s}")

    @property
    def id(self) -> str:
        return self.request_id or ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def output_limit(self, max_model_len: int) -> int:
        """The output tokens it may produce per sample on a model of ``max_model_len``: the edge's ``limit`` when it
        set one, capped (as ``max_tokens`` alone is) by what the context leaves after the prompt. <= 0: the prompt
        alone fills the context."""
        room = self.sampling_params.output_limit(max_model_len, self.num_prompt_tokens)
        return room if self.limit is None else min(self.limit, room)

    def log_fields(self) -> dict[str, object]:
        """What a log line says about the request: its ids and who asked (never the prompt)."""
        return {"engine_request_id": self.request_id, "client_request_id": self.client_request_id or None,
                "tenant": self.tenant or None, "adapter": self.adapter or None, "priority": self.priority,
                "prompt_tokens": self.num_prompt_tokens, "conversation": self.conversation or None,
                "retention_s": self.retention_s or None}
