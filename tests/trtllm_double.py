"""TEST DOUBLE of the TensorRT-LLM LLM-API surface our adapter uses (tensorrt-llm 1.2.x, per
shared/reference/trtllm-api.md). Not TensorRT-LLM: a deterministic toy "model" behind the same
signatures and behaviours the adapter must respect:

- ``SamplingParams``: ``@dataclass(slots=True, kw_only=True)``, ``max_tokens`` defaults to 32,
  greedy when temperature/top_p/top_k are all unset; ``generate_async`` MUTATES it (end_id,
  pad_id; max_tokens forced to 1 for context_only on the PyTorch backend, not on TRT engines).
- ``LLM`` (PyTorch backend) and ``TrtEngineLLM`` (``_tensorrt_engine.LLM``): strict kwargs
  (unknown or backend-specific ones raise ValueError), ``generate_async`` returns at once a
  result whose async iteration yields the same mutable object each step (``*_diff`` fields),
  ``aresult()``, ``abort()`` (finish reason 'cancelled'), ``get_stats_async`` /
  ``get_kv_cache_events_async`` iterators that end after ``timeout`` seconds without data.
- Disaggregation: context_only returns ``DisaggregatedParams`` (first_gen_tokens, ctx_request_id,
  opaque_state bytes); generation_only pulls the context state through a shared ``Fabric`` (the
  cache transceiver's stand-in) and its stream INCLUDES the first token; both instances need a
  cache_transceiver_config; unpulled context state expires after kv_transfer_timeout_ms.

Next token = (31 * previous + 7) % 997 + 3 (never EOS = 2 unless ``eos_after`` says so);
token t decodes to "t<t> ".
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

EOS = 2


class RequestError(RuntimeError):
    """Per-request error (tensorrt_llm.executor.utils.RequestError)."""


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 32
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided_decoding: Any = None
    embedding_bias: Any = None
    end_id: int | None = None
    pad_id: int | None = None

    def __post_init__(self) -> None:
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError("top_p must be in [0, 1]")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError("temperature must be >= 0")


@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None

    def __post_init__(self) -> None:
        if self.request_type is not None:
            self.request_type = self.request_type.lower()
            if self.request_type not in ("context_only", "generation_only", "context_and_generation"):
                raise ValueError(f"Unknown request type: {self.request_type}")


@dataclass(kw_only=True)
class GuidedDecodingParams:
    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if sum(x not in (None, False) for x in (self.json, self.regex, self.grammar, self.json_object,
                                                  self.structural_tag)) != 1:
            raise ValueError("exactly one guide must be set")


@dataclass(kw_only=True)
class KvCacheConfig:
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float = 0.9
    max_gpu_total_bytes: int = 0
    tokens_per_block: int = 32
    event_buffer_max_size: int = 0
    dtype: str = "auto"


@dataclass(kw_only=True)
class CacheTransceiverConfig:
    backend: str = "DEFAULT"
    max_tokens_in_buffer: int | None = None
    kv_transfer_timeout_ms: int | None = None


@dataclass
class Fabric:
    """Context-phase state the generation instances pull (the cache transceiver's stand-in). In
    memory, or in a folder shared by processes (``TRTLLM_DOUBLE_FABRIC``)."""

    pending: Any = field(default_factory=dict)  # opaque -> (prompt, expiry)
    ids: Any = field(default_factory=lambda: itertools.count(1000))


class FolderFabric(Fabric):
    def __init__(self, folder: str):
        super().__init__(pending=_FolderDict(Path(folder)), ids=itertools.count(int(time.time() * 1000) % 10**9))


class _FolderDict:
    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def __setitem__(self, key: bytes, value: tuple[list[int], float]) -> None:
        (self.folder / key.hex()).write_text(json.dumps(value))

    def pop(self, key: bytes, default: Any = None) -> Any:
        path = self.folder / key.hex()
        if not path.exists():
            return default
        prompt, expiry = json.loads(path.read_text())
        path.unlink()
        return prompt, expiry


PROCESS_FABRIC = Fabric()  # instances in one process reach each other, as through a real transceiver

COMMON_ARGS = {"tokenizer", "gather_generation_logits", "tensor_parallel_size", "kv_cache_config",
               "enable_chunked_prefill", "guided_decoding_backend", "max_batch_size", "max_num_tokens",
               "cache_transceiver_config", "speculative_config"}
TORCH_ONLY = {"enable_iter_perf_stats", "disable_overlap_scheduler", "cuda_graph_config"}


class _BaseLLM:
    pytorch_backend = True

    def __init__(self, model: str, *, fabric: Fabric | None = None, fail_with: BaseException | None = None,
                 hang: bool = False, wedge_transfers: bool = False, eos_after: int | None = None,
                 logprob_offset: float = 0.0, **kwargs: Any):
        allowed = COMMON_ARGS | (TORCH_ONLY if self.pytorch_backend else set())
        for key in kwargs:
            if key not in allowed:
                raise ValueError(f"{type(self).__name__} got invalid argument: {key}")
        kv = kwargs.get("kv_cache_config") or KvCacheConfig()
        if not self.pytorch_backend and kv.dtype != "auto":
            raise ValueError("KvCacheConfig.dtype is not supported by the TensorRT backend.")
        if kwargs.get("guided_decoding_backend") not in (None, "xgrammar") and not self.pytorch_backend:
            raise ValueError("llguidance guided decoding is supported by the PyTorch backend only")
        self.model, self.kwargs, self.kv = model, kwargs, kv
        shared = os.environ.get("TRTLLM_DOUBLE_FABRIC")
        self.fabric = fabric or (FolderFabric(shared) if shared else PROCESS_FABRIC)
        self.fail_with, self.hang, self.eos_after = fail_with, hang, eos_after
        self.wedge_transfers = wedge_transfers  # generation_only requests wait forever (a stuck transceiver)
        self.logprob_offset = logprob_offset  # TRT-engine instances score text this much worse (gate tests)
        self.submitted: list[tuple[list[int], SamplingParams, DisaggregatedParams | None]] = []
        self.aborted: list[int] = []
        self._ids = itertools.count(1)
        self._stats: asyncio.Queue | None = None
        self._events: asyncio.Queue | None = None
        self._cached: dict[tuple[int, ...], int] = {}  # full-block token prefixes -> engine block hash
        self._active = 0
        self.shut_down = False

    # -- the API ----------------------------------------------------------------------------------
    def generate_async(self, inputs: list[int], sampling_params: SamplingParams | None = None, streaming: bool = False,
                       disaggregated_params: DisaggregatedParams | None = None, **_: Any) -> FakeRequestOutput:
        if self.shut_down:
            raise RuntimeError("LLM is shutting down")
        loop = asyncio.get_running_loop()  # the real one needs a running loop to use an AsyncQueue
        sp = sampling_params or SamplingParams()
        prompt = list(inputs)
        if not prompt:
            raise ValueError("prompt must not be empty")
        request_type = disaggregated_params.request_type if disaggregated_params else None
        if request_type is not None and "cache_transceiver_config" not in self.kwargs:
            raise RuntimeError("Disaggregated serving is not enabled, please check the configuration")
        if not self.pytorch_backend and self.kwargs.get("tokenizer") is None and sp.end_id is None:
            raise ValueError("end_id is required when no tokenizer is set (an engine dir holds none)")
        if not self.pytorch_backend and sp.logprobs is not None and not self.kwargs.get("gather_generation_logits"):
            raise ValueError("logprobs on the TRT backend need gather_generation_logits=True")
        sp.end_id, sp.pad_id = EOS, EOS  # mutated, as the library does
        if request_type == "context_only" and self.pytorch_backend:
            sp.max_tokens = 1  # forced on the PyTorch backend only
        self.submitted.append((prompt, sp, disaggregated_params))
        out = FakeRequestOutput(next(self._ids), prompt, sp.n, self)
        out.cached_tokens = self._match(prompt)
        if sp.prompt_logprobs is not None:  # position 0 has none; then {token: Logprob}
            offset = 0.0 if self.pytorch_backend else self.logprob_offset
            out.outputs[0].prompt_logprobs = [None] + [
                {t: Logprob(-0.5 * (1 + t % 3) - offset, 1)} for t in prompt[1:]]
        first: list[int] | None = None
        if request_type == "generation_only":  # like the library: a missing context fails in the stream
            first = list(disaggregated_params.first_gen_tokens or [])
            out._context = (disaggregated_params.opaque_state or b"", prompt)
        out._task = loop.create_task(self._produce(out, prompt, sp, request_type, first))
        return out

    def _next(self, previous: int) -> int:
        return (31 * previous + 7) % 997 + 3

    async def _produce(self, out: FakeRequestOutput, prompt: list[int], sp: SamplingParams,
                       request_type: str | None, first: list[int] | None) -> None:
        self._active += 1
        try:
            fail_after = os.environ.get("TRTLLM_DOUBLE_FAIL_AFTER")  # a device error after N requests
            if fail_after is not None and out.request_id > int(fail_after):
                self.fail_with = RuntimeError("CUDA error: an illegal memory access was encountered")
            if self.fail_with is not None:
                await asyncio.sleep(0)
                out._push(error=self.fail_with)
                return
            if self.hang or (self.wedge_transfers and out._context is not None):
                await asyncio.sleep(3600)
            if out._context is not None:
                state = self.fabric.pending.pop(out._context[0], None)
                if state is None or state[1] < time.monotonic() or state[0] != out._context[1]:
                    await asyncio.sleep(0)
                    out._push(error=RequestError("context KV not found (transfer timed out or never prefilled)"))
                    return
            self._store(prompt)
            last = [prompt[-1]] * sp.n
            for step in range(sp.max_tokens):
                await asyncio.sleep(0.001)
                self._stat()  # one per iteration, as the executor does
                if out._cancelled:
                    out._push(finish=["cancelled"] * sp.n)
                    return
                tokens = []
                for i in range(sp.n):
                    token = first[0] if first and step == 0 else self._next(last[i] + 101 * i)
                    if self.eos_after is not None and step == self.eos_after:
                        token = EOS
                    tokens.append(token)
                    last[i] = token
                finishes: list[str | None] = [None] * sp.n
                for i, token in enumerate(tokens):
                    if token == EOS and not sp.ignore_eos or token in (sp.stop_token_ids or []):
                        finishes[i] = "stop"
                    elif step + 1 == sp.max_tokens:
                        finishes[i] = "not_finished" if request_type == "context_only" and not self.pytorch_backend \
                            else "length"
                if request_type == "context_only":
                    opaque = f"ctx:{id(self)}:{out.request_id}".encode()
                    self.fabric.pending[opaque] = (prompt, time.monotonic() + self._transfer_timeout())
                    out.disaggregated_params = DisaggregatedParams(
                        request_type="context_only", first_gen_tokens=[tokens[0]],
                        ctx_request_id=next(self.fabric.ids), opaque_state=opaque, draft_tokens=None)
                    finishes = [f or "not_finished" for f in finishes]
                for i in range(sp.n):  # one sequence per response, as the library does
                    if out.outputs[i].finish_reason in (None, "not_finished") or request_type == "context_only":
                        out._push(tokens=tokens, finish=finishes, only=i)
                if all(f is not None for f in finishes):
                    return
        finally:
            self._stat()  # the last iteration still counts this request active (the library's stats do)
            self._active -= 1

    def _transfer_timeout(self) -> float:
        config = self.kwargs.get("cache_transceiver_config")
        return (config.kv_transfer_timeout_ms or 60_000) / 1000

    def _match(self, prompt: list[int]) -> int:
        bs, hit = self.kv.tokens_per_block, 0
        while (hit + 1) * bs <= len(prompt) and tuple(prompt[: (hit + 1) * bs]) in self._cached:
            hit += 1
        return hit * bs

    def _store(self, prompt: list[int]) -> None:
        bs = self.kv.tokens_per_block
        parent = None
        for end in range(bs, len(prompt) + 1, bs):
            key = tuple(prompt[:end])
            if key not in self._cached:
                self._cached[key] = 10_000 + len(self._cached)
                self._event({"event_id": len(self._cached), "data": {
                    "type": "stored", "parent_hash": parent,
                    "blocks": [{"type": "stored_block", "block_hash": self._cached[key],
                                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                           for t in prompt[end - bs: end]]}]}})
            parent = self._cached[key]

    def evict_all(self) -> None:
        hashes = list(self._cached.values())
        self._cached.clear()
        self._event({"event_id": -1, "data": {"type": "removed", "block_hashes": hashes}})

    def _stat(self) -> None:
        used = len(self._cached)
        self._queue("_stats").put_nowait({
            "iter": 1, "iterLatencyMS": 2.5, "numActiveRequests": self._active, "numQueuedRequests": 0,
            "kvCacheStats": {"maxNumBlocks": 100, "usedNumBlocks": used, "freeNumBlocks": 100 - used,
                             "tokensPerBlock": self.kv.tokens_per_block},
            "inflightBatchingStats": {"numPausedRequests": 0}})

    def _event(self, event: dict) -> None:
        if self.kv.event_buffer_max_size > 0:
            self._queue("_events").put_nowait(event)

    def _queue(self, name: str) -> asyncio.Queue:
        if getattr(self, name) is None:
            setattr(self, name, asyncio.Queue())
        return getattr(self, name)

    async def get_stats_async(self, timeout: float = 2):
        async for item in self._drain("_stats", timeout):
            yield item

    async def get_kv_cache_events_async(self, timeout: float = 2):
        async for item in self._drain("_events", timeout):
            yield item

    async def _drain(self, name: str, timeout: float):
        queue = self._queue(name)
        while True:
            try:
                async with asyncio.timeout(timeout):
                    item = await queue.get()
            except TimeoutError:
                return
            yield item

    def shutdown(self) -> None:
        self.shut_down = True


class LLM(_BaseLLM):
    pytorch_backend = True


class TrtEngineLLM(_BaseLLM):
    pytorch_backend = False


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    disaggregated_params: Any = None
    prompt_logprobs: list | None = None
    _last: int = 0
    _last_text: int = 0

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last:]

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text:]

    @property
    def logprobs_diff(self) -> list:
        return self.logprobs[self._last:]


class FakeRequestOutput:
    """The library's RequestOutput: the same object every step; diffs since the previous step."""

    def __init__(self, request_id: int, prompt: list[int], n: int, llm: _BaseLLM):
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.outputs = [CompletionOutput(i) for i in range(n)]
        self.finished = False
        self.disaggregated_params: DisaggregatedParams | None = None
        self.cached_tokens = 0
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = False
        self._llm = llm
        self._task: asyncio.Task | None = None
        self._context: tuple[bytes, list[int]] | None = None  # generation_only: the context state to pull

    def _push(self, tokens: list[int] | None = None, finish: list[str | None] | None = None,
              error: BaseException | None = None, only: int | None = None) -> None:
        self._queue.put_nowait((tokens, finish, error, only))

    def _apply(self, tokens: list[int] | None, finish: list[str | None] | None, only: int | None = None) -> None:
        for i, c in enumerate(self.outputs):  # only the updated sequence's diff moves: the others' go stale
            if only is None or i == only:
                c._last, c._last_text = len(c.token_ids), len(c.text)
        for i, c in enumerate(self.outputs):
            if only is not None and i != only:
                continue
            if c.finish_reason is not None and c.finish_reason != "not_finished":
                continue
            if tokens is not None:
                c.token_ids.append(tokens[i])
                if tokens[i] != EOS:
                    c.text += f"t{tokens[i]} "
            if finish is not None and finish[i] is not None:
                c.finish_reason = finish[i]
                if finish[i] == "stop":
                    c.stop_reason = c.token_ids[-1]
        self.finished = all(c.finish_reason is not None for c in self.outputs)

    def __aiter__(self) -> FakeRequestOutput:
        return self

    async def __anext__(self) -> FakeRequestOutput:
        if self.finished:
            raise StopAsyncIteration
        tokens, finish, error, only = await self._queue.get()
        if error is not None:
            raise error
        self._apply(tokens, finish, only)
        return self

    async def aresult(self) -> FakeRequestOutput:
        async for _ in self:
            pass
        return self

    def abort(self) -> None:
        self._cancelled = True
        self._llm.aborted.append(self.request_id)

    def aborted(self) -> bool:
        return self._cancelled


def api(**llm_options: Any) -> SimpleNamespace:
    """What ``tokenfleet.backends.trtllm.spec.load_api()`` returns, for this double. ``llm_options``
    (fabric, fail_with, hang, wedge_transfers, eos_after) go to every LLM it constructs."""
    def bind(cls: type) -> Any:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, model: str, **kwargs: Any):
                super().__init__(model, **llm_options, **kwargs)
        Bound.__name__ = cls.__name__
        return Bound

    ns = SimpleNamespace(LLM=bind(LLM), TrtEngineLLM=bind(TrtEngineLLM), SamplingParams=SamplingParams,
                         DisaggregatedParams=DisaggregatedParams, KvCacheConfig=KvCacheConfig,
                         CacheTransceiverConfig=CacheTransceiverConfig, GuidedDecodingParams=GuidedDecodingParams,
                         RequestError=RequestError)
    ns.instances = []
    for name in ("LLM", "TrtEngineLLM"):
        cls = getattr(ns, name)
        original = cls.__init__

        def init(self: Any, *a: Any, _original: Any = original, **kw: Any) -> None:
            _original(self, *a, **kw)
            ns.instances.append(self)
        cls.__init__ = init
    return ns


def replace(params: Any, **changes: Any) -> Any:
    return dataclasses.replace(params, **changes)
