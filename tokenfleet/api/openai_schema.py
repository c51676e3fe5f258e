"""OpenAI request schema (the subset we serve) and its translation to engine sampling params."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenfleet.engine.sampling_params import SamplingParams


class APIError(Exception):
    """An error the gateway returns in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}  # e.g. Retry-After and rate-limit headers of a 429

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI-compatible servers do

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
    user: str | None = None
    # extras that benchmark clients send (vLLM-compatible)
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    # Not supported yet: rejected by name, never silently ignored.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format {self.response_format.get('type')!r} is not supported yet; only "
                           "'text'", param="response_format")
        for name in ("tools", "tool_choice"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported yet", param=name)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise APIError(400, f"stop strings must be at most {MAX_STOP_LENGTH} characters", param="stop")
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
            )
        except ValueError as e:
            raise APIError(400, str(e)) from e


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        for i, m in enumerate(self.messages):
            if m.role in ("user", "system", "developer") and not (m.content or "").strip():
                raise APIError(400, f"messages[{i}].content must not be empty", param=f"messages.{i}.content")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling(limit, (self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(_Common):
    prompt: str | list[Annotated[int, Field(ge=0, lt=2**31)]]  # text, or token ids (checked against the vocab)
    logprobs: int | None = None
    max_tokens: int | None = 16  # OpenAI's default for completions

    def sampling_params(self) -> SamplingParams:
        return self.sampling(self.max_tokens, self.logprobs)
