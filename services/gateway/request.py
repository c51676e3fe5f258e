"""The gateway's edge: a validated body becomes the one request object (``RequestSpec``) every layer passes, with
what only the gateway's encoders need beside it (``Prepared``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.services.gateway.catalog import ServedModel

from tokenfleet.api.openai_schema import DEFAULT_RETENTION_WINDOW_S, ChatCompletionRequest, CompletionRequest
from tokenfleet.engine.request import Priority
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.tenancy.tenants import Tenant

TIER_PRIORITY = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}  # a tenant's tier: its requests'


@dataclass(frozen=True)
class Edge:
    """Who sent a body: what the gateway's edge adds to it to make the request (``Edge.request``)."""

    tenant: Tenant
    client_request_id: str = ""
    retention_window_s: float = DEFAULT_RETENTION_WINDOW_S  # what prompt_cache_retention "in_memory" keeps

    def request(self, model: ServedModel, body: ChatCompletionRequest | CompletionRequest, prompt: Sequence[int],
                params: SamplingParams, request_id: str) -> RequestSpec:
        """The one request object (tokenfleet.engine.request_spec) for ``body`` on ``model``: built once, here."""
        tenant = self.tenant
        return body.request_spec(prompt, params, request_id, tenant=tenant.name,
                                 share_group=tenant.cache_group or tenant.name, priority=TIER_PRIORITY[tenant.tier],
                                 adapter=model.adapter, max_model_len=model.max_model_len,
                                 client_request_id=self.client_request_id,
                                 retention_window_s=self.retention_window_s)


@dataclass
class Prepared:
    """A validated request, rendered and tokenized, not yet admitted: the request every layer passes
    (``RequestSpec``, built here once) and what only the gateway's encoders need."""

    model: ServedModel
    request: RequestSpec
    include_usage: bool
    tools: bool = False  # parse tool calls out of the output (chat with tools, tool_choice not "none")
    echo: str = ""  # completions with echo: the prompt's text, sent before each choice's text
    echo_added: int = 0  # special tokens the tokenizer put before the echoed text's own (Gemma's <bos>): no text
    chat: bool = True
    requested_model: str = ""  # the routing alias the client named, when the model router chose ``model``

    @property
    def request_id(self) -> str:
        return self.request.id

    @property
    def prompt(self) -> Sequence[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def limit(self) -> int:
        """Output tokens it may produce per sample on ``model`` (the edge's limit)."""
        return self.request.output_limit(self.model.max_model_len)
