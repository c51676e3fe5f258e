"""Offline Python API: ``LLM(...).generate(prompts, sampling_params)`` and ``.chat(...)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.api.chat_template import render_chat
from tokenfleet.backends.torch.builder import build_engine_core
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.output import RequestOutput, TokenLogprobs
from tokenfleet.engine.request import FinishReason
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.gguf_import import ensure_default_model

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # SamplingParams.prompt_logprobs
    samples: list[Completion] = field(default_factory=list)  # n > 1: samples 1..n-1 (this one is sample 0)


class LLM:
    """Runs the engine in-process. ``model=None`` uses the default model (imported on first use)."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        path = model or str(ensure_default_model())
        self.core = build_engine_core(EngineConfig(model=path, **engine_options))
        self.tokenizer = self.core.tokenizer

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run every prompt (text or token ids) to completion, batched together; results in input order."""
        batch = [prompts] if _is_single(prompts) else list(prompts)  # type: ignore[list-item]
        token_lists = [self.tokenizer.encode_prompt(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(token_lists, _params_list(sampling_params, len(token_lists)))

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_lists = [self.tokenizer.encode(render_chat(self.tokenizer, list(c))) for c in conversations]
        return self._run(token_lists, _params_list(sampling_params, len(token_lists)))

    def _run(self, token_lists: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        completions: dict[str, Completion] = {}
        owners: dict[str, Completion] = {}  # engine request id (samples of n > 1 too) -> its completion
        try:
            for tokens, p in zip(token_lists, params):
                request_id = self.core.add_request(RequestSpec(tokens, p))
                completion = completions[request_id] = Completion(request_id=request_id, prompt_token_ids=tokens)
                completion.samples = [Completion(request_id=f"{request_id}#{i}", prompt_token_ids=tokens)
                                      for i in range(1, p.n)]
                for member in self.core.group(request_id):
                    owners[member] = completion
        except ValueError:
            for request_id in completions:  # all or nothing
                self.core.abort(request_id)
            raise
        while self.core.has_unfinished():
            for out in self.core.step():
                completion = owners[out.request_id]
                _accumulate(completion.samples[out.index - 1] if out.index else completion, out)
        return list(completions.values())


def _accumulate(completion: Completion, out: RequestOutput) -> None:
    completion.token_ids += out.new_token_ids
    completion.text += out.text
    completion.logprobs += out.logprobs
    completion.prompt_logprobs += out.prompt_logprobs
    completion.num_cached_tokens = out.num_cached_tokens
    if out.finished:
        completion.finish_reason = out.finish_reason


def _is_single(prompts: Any) -> bool:
    return isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))


def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
