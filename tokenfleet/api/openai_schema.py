"""OpenAI request schema and its translation to engine sampling params.

Every parameter OpenAI defines for chat and completions is either served or rejected with a
400 that names it (``UNSUPPORTED``); unknown parameters are rejected the same way, never ignored."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenfleet.api import tools as tool_calls
from tokenfleet.engine.grammar import GrammarError, Guided, validate
from tokenfleet.engine.request import Priority
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import MAX_N, SamplingParams
from tokenfleet.kvcache.salt import conversation_key, request_scope

DEFAULT_RETRY_AFTER = "1"  # seconds


class APIError(Exception):
    """An error the gateway returns in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}  # e.g. Retry-After, rate-limit state
        if status == 503:  # every refusal for load or a passing fault says when to try again
            self.headers.setdefault("retry-after", DEFAULT_RETRY_AFTER)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
# Bounds on what one request may carry (each a 400 naming the limit): work the gateway and the
# workers do per request, and per engine step for logit_bias, grows with them.
MAX_MESSAGES = 2048
MAX_TOOLS = 128  # as OpenAI's API
MAX_LOGIT_BIAS = 300
MAX_CACHE_SALT = 256
MAX_CACHE_KEY = 256
# How long a conversation's transcript stays cached above plain LRU after a turn that says it will be back
# (``prompt_cache_retention``): "in_memory" is the gateway's window (--retention-window-s), "24h" a day.
DEFAULT_RETENTION_WINDOW_S = 300.0
RETENTION_24H_S = 24 * 3600.0
# Accepted, with no effect on generation (bookkeeping fields clients send by default).
INFORMATIONAL = {"metadata", "service_tier"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # collected and rejected by name in sampling()

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    store: bool | None = None
    # Prefix-cache isolation within a tenant (as vLLM's field): requests share cached blocks only with
    # requests of the same tenant share group and the same cache_salt (tokenfleet.kvcache.salt).
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT)
    # OpenAI's prompt caching hints: requests with one key are kept on the replica that holds their prefix; a
    # retention keeps the prompt and reply cached above plain LRU after the request (the client is coming back)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_CACHE_KEY)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # extras that benchmark clients send (vLLM-compatible)
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    # false: never speculate for this request (where the worker speculates; lossless either way)
    speculative: bool | None = None

    def request_spec(self, prompt: Sequence[int], params: SamplingParams, request_id: str, *, tenant: str = "",
                     share_group: str = "", priority: int = Priority.INTERACTIVE, adapter: str = "",
                     max_model_len: int | None = None, client_request_id: str = "",
                     retention_window_s: float = DEFAULT_RETENTION_WINDOW_S) -> RequestSpec:
        """This body as the request every layer passes (``RequestSpec``): its prompt and sampling, its scope (the
        tenant's share group and this body's cache_salt), its conversation and retention (chat's
        ``prompt_cache_key`` and ``prompt_cache_retention``), and its output limit on a model of ``max_model_len``."""
        scope = request_scope(share_group, self.cache_salt or "")
        key, retention = self.prompt_cache_key, self.prompt_cache_retention
        spec = RequestSpec(prompt, params, request_id, priority, tenant=tenant, cache_scope=scope, adapter=adapter,
                           client_request_id=client_request_id,
                           conversation=conversation_key(scope, key, tenant) if key else "",
                           retention_s=retention_seconds(retention, retention_window_s))
        return dataclasses.replace(spec, limit=spec.output_limit(max_model_len)) if max_model_len else spec

    def _check_unsupported(self) -> None:
        extra = sorted(set(self.model_extra or {}) - INFORMATIONAL)
        if extra:
            raise APIError(400, f"Unsupported parameter(s): {', '.join(extra)}. This server does not implement "
                           "them, and does not ignore them silently.", param=extra[0], code="unsupported_parameter")
        if self.store:
            raise APIError(400, "store=true is not supported: completions are not stored", param="store",
                           code="unsupported_parameter")

    def sampling(self, max_tokens: int | None, logprobs: int | None, guided: Guided | None = None) -> SamplingParams:
        self._check_unsupported()
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise APIError(400, f"stop strings must be at most {MAX_STOP_LENGTH} characters", param="stop")
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias or {})}",
                           param="logit_bias")
        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError as e:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from e
        if any(not 0 <= k < 2**31 for k in bias):
            raise APIError(400, "logit_bias keys must be token ids in [0, 2**31)", param="logit_bias")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                stop=self.stop or (),
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                n=self.n,
                logit_bias=bias,
                guided=guided,
                speculative=self.speculative is not False,
            )
        except ValueError as e:
            param = "logit_bias" if "logit_bias" in str(e) else None
            raise APIError(400, str(e), param=param) from e


def retention_seconds(retention: str | None, window_s: float) -> float:
    """``prompt_cache_retention`` in seconds: None -> 0 (plain LRU), "in_memory" -> ``window_s``, "24h" -> a day."""
    return 0.0 if retention is None else RETENTION_24H_S if retention == "24h" else window_s


class FunctionCallIn(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(BaseModel):
    type: Literal["text"]  # images and audio: not served (a 400 names the part type)
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON schema of type object")
        return value


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def tool_choice_name(self) -> str:
        """"none", "auto", "required" or the named function; "none" when there are no tools."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def sampling_params(self) -> SamplingParams:
        if len(self.messages) > MAX_MESSAGES:
            raise APIError(400, f"at most {MAX_MESSAGES} messages, got {len(self.messages)}", param="messages")
        if len(self.tools or []) > MAX_TOOLS:
            raise APIError(400, f"at most {MAX_TOOLS} tools, got {len(self.tools or [])}", param="tools")
        for i, m in enumerate(self.messages):
            if m.role in ("user", "system", "developer") and not (m.text() or "").strip():
                raise APIError(400, f"messages[{i}].content must not be empty", param=f"messages.{i}.content")
            if m.role == "tool" and m.tool_call_id is None:
                raise APIError(400, f"messages[{i}]: a tool message needs tool_call_id",
                               param=f"messages.{i}.tool_call_id")
        if self.tool_choice is not None and not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling(limit, (self.top_logprobs or 0) if self.logprobs else None, self.guided())

    def _text_format(self) -> Guided | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Guided("json_object")
        if fmt.json_schema is None:
            raise APIError(400, "response_format json_schema needs a json_schema object",
                           param="response_format.json_schema")
        return Guided("json_schema", json.dumps(fmt.json_schema.schema_))

    def guided(self) -> Guided | None:
        """The output grammar: the tools' (calls, or text / JSON under tool_choice auto), else
        response_format's; None when the output is free text. 400 when it does not compile."""
        text = self._text_format()
        choice = self.tool_choice_name
        param = "response_format"
        try:
            if choice != "none":
                param = "tools"
                functions = [t.model_dump(exclude_none=True) for t in self.tools or []]
                spec = tool_calls.grammar(functions, choice, self.parallel_tool_calls, text)
            else:
                spec = text
            if spec is not None:
                validate(spec)
            return spec
        except (GrammarError, ValueError) as e:
            raise APIError(400, str(e), param="tool_choice" if "tool_choice" in str(e) else param) from e


class CompletionRequest(_Common):
    prompt: str | list[Annotated[int, Field(ge=0, lt=2**31)]]  # text, or token ids (checked against the vocab)
    logprobs: int | None = None
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported (only best_of equal to n)", param="best_of",
                           code="unsupported_parameter")
        params = self.sampling(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # the prompt's tokens get logprobs too
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params
