"""``TrtllmEngine``: our ``Engine`` interface over one TensorRT-LLM ``LLM`` instance.

Requests: a fresh SamplingParams per request (the library mutates it; max_tokens always set),
``generate_async(..., streaming=True)`` read through each step's ``*_diff`` fields (the same
mutable result object comes back every step), the handle kept by our request id for aborts
(the LLM API has no abort by id). ``RequestError`` is the request's fault (ValueError at submit,
a RuntimeError mid-stream); any other exception marks the engine failed: ``error`` is set, it
takes no more work, and the worker deregisters.

Disaggregation: the prefill role submits ``context_only`` (max_tokens 1), then sends
PrefillStarted (the first token), one Handoff (the DisaggregatedParams, every field, plus
whether the first token already ended the request) and PrefillDone through our Prefill RPC.
The decode role submits ``generation_only`` with the original params; that stream includes the
first token, so the prefill's first token is not emitted a second time. The KV moves through
TensorRT-LLM's cache transceiver (UCX/NIXL), never through us.

The module is above the ~400-line guideline because every method shares one ``LLM`` instance and
the request-handle map its aborts and failures go through; ``translate.py`` and ``spec.py`` already
hold what is pure (parameter and output translation, the library's API surface).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import structlog

from tokenfleet.backends.trtllm import translate
from tokenfleet.backends.trtllm.spec import TrtllmSpec, llm_class, llm_kwargs, load_api
from tokenfleet.engine.interface import AdapterHost, EngineStoppedError, PeerBlocks
from tokenfleet.engine.kv_transfer import (
    Handoff,
    KVLayoutError,
    KVSource,
    KVTransferError,
    PrefillDone,
    PrefillEvent,
    PrefillStarted,
)
from tokenfleet.engine.output import RequestOutput
from tokenfleet.engine.request import FinishReason
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.runner import KernelCheck
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.stats import EngineStats
from tokenfleet.kvcache.layout import KVLayout

log = structlog.get_logger()
HEALTH_TIMEOUT_S = 120.0


class RequestFailedError(RuntimeError):
    """One request failed (not the engine); maps like any RuntimeError at the worker."""


class TrtllmEngine:
    def __init__(self, spec: TrtllmSpec, hash_salt: str, vocab_size: int, max_model_len: int,
                 api_loader: Callable[[], Any] = load_api, health_prompt: Sequence[int] = (1, 2, 3),
                 transfer_timeout: float = 60.0, health_interval: float = 30.0):
        self.spec = spec
        self.hash_salt = hash_salt
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.transfer_timeout = transfer_timeout
        self.health_interval = health_interval
        self.error: BaseException | None = None  # set when the library failed: the worker is unhealthy
        # Capabilities it lacks (Engine): the library keeps its own KV (no whole blocks to peers) and LoRA is not
        # wired to it yet.
        self.peer_blocks: PeerBlocks | None = None
        self.lora: AdapterHost | None = None
        self._api_loader = api_loader
        self._health_prompt = list(health_prompt)
        self.api: Any = None
        self.llm: Any = None
        self._handles: dict[str, Any] = {}  # our request id -> the library's RequestOutput
        self._prompt_sent: dict[str, set[int]] = {}  # samples whose first output carried the prompt logprobs
        self._accepting = False
        self._stats = EngineStats()
        self._mirror = translate.BlockHashMirror(hash_salt, spec.tokens_per_block)
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.api = await asyncio.to_thread(self._api_loader)
        cls = llm_class(self.api, self.spec)
        self.llm = await asyncio.to_thread(lambda: cls(model=self.spec.model, **llm_kwargs(self.api, self.spec)))
        await self.health_check()
        self._tasks = [asyncio.create_task(self._poll("get_stats_async", self._on_stat)),
                       asyncio.create_task(self._poll("get_kv_cache_events_async", self._mirror.apply)),
                       asyncio.create_task(self._keep_checking())]
        self._accepting = True

    async def health_check(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """A real one-token generation, not a ping (a wedged transceiver can leave /health green)."""
        params = self.api.SamplingParams(max_tokens=1, top_k=1)
        result = None
        try:
            result = self.llm.generate_async(self._health_prompt, sampling_params=params)
            await asyncio.wait_for(result.aresult(), timeout)
        except self.api.RequestError as e:  # the probe's own fault, not the engine's
            log.warning("health generation refused", error=str(e))
        except Exception as e:
            if result is not None:
                with contextlib.suppress(Exception):
                    result.abort()
            self._fail(e)
            raise EngineStoppedError(f"TensorRT-LLM health generation failed: {e}") from e

    async def _keep_checking(self) -> None:
        """A real generation every ``health_interval`` seconds: a wedged engine (a transceiver waiting
        forever, reference §10.2) fails the check and the worker leaves the fleet."""
        while not self._stopping and self.error is None:
            await asyncio.sleep(self.health_interval)
            if not self._stopping:
                with contextlib.suppress(EngineStoppedError):  # _fail has recorded it
                    await self.health_check()

    async def drain(self) -> None:
        self._accepting = False
        while self._handles:
            await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        self._accepting = False
        self._stopping = True
        try:
            self._abort_all()
            for task in self._tasks:
                task.cancel()
            if self._tasks:  # a library iterator may swallow one cancel (wait_for races): the flag ends the loop
                await asyncio.wait(self._tasks, timeout=5)
        finally:
            if self.llm is not None:  # always: MPI workers must not outlive us
                await asyncio.to_thread(self.llm.shutdown)
                self.llm = None

    def _abort_all(self) -> None:
        for handle in list(self._handles.values()):
            with contextlib.suppress(Exception):  # a dead executor may refuse: we are leaving anyway
                handle.abort()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            log.error("TensorRT-LLM failed; the engine takes no more requests", error=repr(error))
        self.error = error
        self._accepting = False
        self._abort_all()  # streams blocked on a dead executor end instead of holding the drain

    # ---- signals -------------------------------------------------------------------------------
    def kv_layout(self) -> KVLayout:
        """Routers hash prompts with this salt and block size. Raw blocks never leave the library:
        the zero geometry makes our torch engines refuse them (they fall back to local prefill)."""
        dtype = "trtllm-fp8" if self.spec.kv_fp8 else "trtllm"
        return KVLayout(self.hash_salt, dtype, self.spec.tokens_per_block, 0, 0, 0)

    def cached_block_hashes(self) -> frozenset[bytes]:
        return self._mirror.hashes

    def tier_block_hashes(self) -> frozenset[bytes]:
        return frozenset()  # the library's own host offload, if configured, is not reported apart

    def held_block_hashes(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        return self.cached_block_hashes(), self.tier_block_hashes()

    async def device_peaks(self) -> tuple[float, float, str] | None:
        return None  # the library reports no step costs: no MFU/MBU

    def kernel_checks(self) -> tuple[KernelCheck, ...]:
        return ()  # TensorRT-LLM's engines are built and checked by their own accuracy gate (backends.trtllm.build)

    def stats(self) -> EngineStats:
        """Iteration stats arrive only while the library iterates: the last one of a busy spell would
        say "running" forever once idle. All of the library's requests are ours (health probes aside),
        so the gauges are bounded by the requests we hold."""
        held = len(self._handles)
        running = min(self._stats.num_running, held)
        return self._stats.snapshot(num_running=running, num_waiting=min(self._stats.num_waiting, held - running))

    def _on_stat(self, stat: dict[str, Any]) -> None:
        gauges = translate.gauges(stat)
        self._stats = self._stats.snapshot(**gauges)
        self._stats.num_steps += 1

    async def _poll(self, method: str, sink: Callable[[dict[str, Any]], None]) -> None:
        """Drain an ``*_async(timeout)`` iterator forever (it ends after ``timeout`` with no data)."""
        while not self._stopping:
            try:
                async for item in getattr(self.llm, method)(timeout=2):
                    sink(item)
                    if self._stopping:
                        return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - stats are advisory; the request path reports failures
                log.warning("TensorRT-LLM poll failed", method=method, error=repr(e))
            await asyncio.sleep(0.5)

    # ---- requests ------------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.abort()

    async def release(self, conversation: str) -> int:
        """Always 0: TensorRT-LLM's KV cache manager has no retention tier here, so ``retention_s`` is not
        honoured by this adapter and there is never a conversation's retention to end (its blocks age in
        TensorRT-LLM's own LRU like any other)."""
        return 0

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise EngineStoppedError("engine is not accepting requests (starting, draining, stopped or failed)")

    def _check_params(self, params: SamplingParams) -> None:
        if self.spec.kind == "trt" and not self.spec.gather_generation_logits and (
                params.logprobs is not None or params.prompt_logprobs is not None):
            raise ValueError("logprobs need an engine worker started with --gather-generation-logits (TensorRT "
                             "engines gather logits only when asked)")

    def _max_tokens(self, request: RequestSpec) -> int:
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; the model's context is "
                             f"{self.max_model_len}")
        return request.output_limit(self.max_model_len)

    def _submit(self, prompt: list[int], sp: Any, streaming: bool, disaggregated: Any = None,
                cache_scope: str = "") -> Any:
        """``cache_scope`` becomes the library's ``cache_salt``: prefix reuse only within it."""
        extra = {"cache_salt": cache_scope} if cache_scope else {}
        try:
            return self.llm.generate_async(prompt, sampling_params=sp, streaming=streaming,
                                           disaggregated_params=disaggregated, **extra)
        except self.api.RequestError as e:
            raise ValueError(str(e)) from e
        except ValueError:
            raise  # the library's own argument checks (e.g. prompt longer than max_num_tokens)
        except Exception as e:
            self._fail(e)
            raise EngineStoppedError(f"TensorRT-LLM refused the request: {e}") from e

    async def generate(self, request: RequestSpec) -> AsyncGenerator[RequestOutput, None]:
        """``Engine.generate``. ``request.resume`` continues after delivered tokens by appending them to the prompt (the library
        cannot start a request with output): penalties then see them as prompt tokens.

        Longer than the ~60-line guideline: submit, the per-step diff reading and the three ways a
        stream ends (finish, request error, engine failure) share the library's one result object
        and the abort handle, and read in order here better than spread over helpers."""
        sampling_params, request_id, resume, kv_source = (request.sampling_params, request.id, request.resume,
                                                          request.kv_source)
        cache_scope = request.kv_scope
        self._check_params(sampling_params)
        if request.adapter:
            raise ValueError("LoRA adapters are not wired to the TensorRT-LLM backend yet")
        self._check_accepting()
        prompt = list(request.prompt_token_ids)
        max_tokens = self._max_tokens(request)
        delivered = list(resume.output_token_ids) if resume is not None else []
        if delivered:
            prompt, max_tokens = prompt + delivered, max_tokens - len(delivered)
            if max_tokens <= 0:
                raise ValueError(f"resumed with {len(delivered)} output tokens; the request allows no more")
        disaggregated, ended = None, None
        if kv_source is not None and not delivered and sampling_params.n == 1 and max_tokens > 1:
            disaggregated, ended = await self._pull(kv_source, request_id)
        if ended is not None:  # the prefill's first token ended the request: nothing to decode
            token, reason, text = ended
            yield RequestOutput(request_id, [token], text, finished=True, finish_reason=reason,
                                num_prompt_tokens=len(prompt), num_output_tokens=1)
            return
        def local_params() -> Any:
            return translate.sampling(self.api, sampling_params, max_tokens,
                                      guided_backend=self.spec.guided_decoding_backend, vocab_size=self.vocab_size)

        handle: Any
        first = None
        if disaggregated is None:
            handle = self._submit(prompt, local_params(), True, None, cache_scope)
        else:
            handle, first = await self._start_generation_only(prompt, local_params, disaggregated, request_id,
                                                              cache_scope)
        self._handles[request_id] = handle
        running = set(range(sampling_params.n))
        sent: dict[int, tuple[int, int]] = {}  # index -> (tokens, characters) already emitted
        num_prompt = len(prompt) - len(delivered)
        try:
            results = handle.__aiter__()
            while running:
                if first is not None:
                    result, first = first, None
                else:
                    try:
                        result = await anext(results)
                    except StopAsyncIteration:
                        break
                try:
                    outs = self._deltas(request_id, result, running, sent, num_prompt, len(delivered))
                except Exception as e:  # our translation of one result: this request's problem, not the engine's
                    raise RequestFailedError(f"cannot read TensorRT-LLM's output: {e!r}") from e
                for out in outs:
                    yield out
            for index in sorted(running):  # the library ended the stream without a reason for these samples
                running.discard(index)
                yield RequestOutput(request_id, [], "", finished=True, finish_reason=FinishReason.ABORT, index=index,
                                    num_prompt_tokens=num_prompt, num_output_tokens=sent.get(index, (0, 0))[0])
        except self.api.RequestError as e:  # this request's fault (RequestError is a RuntimeError: first)
            raise RuntimeError(f"TensorRT-LLM failed the request: {e}") from e
        except (GeneratorExit, asyncio.CancelledError, RequestFailedError):
            raise
        except Exception as e:  # anything else from the library (device errors) fails the engine
            self._fail(e)
            raise EngineStoppedError(f"TensorRT-LLM failed: {e}") from e
        finally:
            self._handles.pop(request_id, None)
            self._prompt_sent.pop(request_id, None)
            if running:  # closed early (client gone) or failed: free the library's request
                with contextlib.suppress(Exception):
                    handle.abort()
                self._stats.num_aborted += 1

    async def _start_generation_only(self, prompt: list[int], local_params: Callable[[], Any], disaggregated: Any,
                                     request_id: str, cache_scope: str = "") -> tuple[Any, Any]:
        """Submit the decode phase and wait (at most ``transfer_timeout``) for its first result; a refusal
        or a wedge (the context state is gone, a transceiver never delivers) prefills here instead.
        Returns (handle, first result or None)."""
        handle = None
        try:
            handle = self._submit(prompt, local_params(), True, disaggregated, cache_scope)
            async with asyncio.timeout(self.transfer_timeout):
                first = await anext(handle.__aiter__())
            self._stats.num_remote_prefills += 1  # counted once the decode phase has produced
            return handle, first
        except (ValueError, self.api.RequestError, TimeoutError, StopAsyncIteration) as e:
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.abort()
            log.warning("generation_only failed; prefilling locally", engine_request_id=request_id,
                        error=str(e) or type(e).__name__)
            self._stats.num_remote_fallbacks += 1
            return self._submit(prompt, local_params(), True, None, cache_scope), None

    def _deltas(self, request_id: str, result: Any, running: set[int], sent: dict[int, tuple[int, int]],
                num_prompt: int, num_resumed: int) -> list[RequestOutput]:
        """New tokens per sample since we last emitted it (our own counts: the library updates one
        sequence per response, so another sequence's ``*_diff`` can repeat what we sent)."""
        outs = []
        for c in result.outputs:
            if c.index not in running:
                continue
            done_tokens, done_chars = sent.get(c.index, (0, 0))
            token_ids, text = list(c.token_ids), c.text or ""
            tokens, new_text = token_ids[done_tokens:], text[done_chars:]
            reason = translate.finish_reason(c.finish_reason)
            if not tokens and not new_text and reason is None:
                continue
            sent[c.index] = (len(token_ids), len(text))
            logprobs = list(getattr(c, "logprobs", None) or [])[done_tokens:]
            out = RequestOutput(request_id, tokens, new_text, index=c.index, num_prompt_tokens=num_prompt,
                                num_cached_tokens=int(getattr(result, "cached_tokens", 0) or 0),
                                num_output_tokens=num_resumed + len(token_ids),
                                logprobs=translate.token_logprobs(logprobs, tokens))
            if c.index not in self._prompt_sent.setdefault(request_id, set()):
                self._prompt_sent[request_id].add(c.index)
                out.prompt_logprobs = translate.prompt_logprobs(getattr(c, "prompt_logprobs", None),
                                                                list(result.prompt_token_ids))
            if reason is not None:
                out.finished, out.finish_reason, out.stop_reason = True, reason, c.stop_reason
                running.discard(c.index)
                self._stats.num_finished += 1
                self._stats.num_generated_tokens += len(token_ids)
            outs.append(out)
        return outs

    async def _pull(self, kv_source: KVSource, request_id: str) -> tuple[Any, tuple[int, FinishReason, str] | None]:
        """Decode side: read the prefill replica's hand-off. Returns (DisaggregatedParams, None), or
        (None, (token, reason)) when its first token ended the request, or (None, None) to prefill
        here (any transfer failure)."""
        first: int | None = None
        try:
            async with contextlib.aclosing(kv_source((), self.kv_layout())) as events:
                async with asyncio.timeout(self.transfer_timeout):
                    async for event in events:
                        if isinstance(event, PrefillStarted):
                            first = event.token_id
                        elif isinstance(event, Handoff):
                            if first is None:
                                raise KVTransferError("hand-off before the first token")
                            body = json.loads(event.payload)
                            if body.get("finish") is not None:
                                return None, (first, FinishReason(body["finish"]), str(body.get("text", "")))
                            return translate.decode_disagg(self.api, event.payload), None
                        elif isinstance(event, PrefillDone):
                            break
                        else:
                            raise KVTransferError(f"a TensorRT-LLM engine cannot install {type(event).__name__}")
            raise KVTransferError("the prefill replica sent no hand-off")
        except (KVTransferError, ValueError, TimeoutError) as e:
            log.warning("hand-off failed; prefilling locally", engine_request_id=request_id, error=str(e) or "timeout")
            self._stats.num_remote_fallbacks += 1
            return None, None

    async def prefill(self, request: RequestSpec, held_block_hashes: Sequence[bytes] = (),
                      layout: KVLayout | None = None) -> AsyncGenerator[PrefillEvent, None]:
        """Prefill role: a context_only request; its KV stays in the library until the decode side
        pulls it or ``kv_transfer_timeout_ms`` passes (there is no release call)."""
        sampling_params, request_id, cache_scope = request.sampling_params, request.id, request.kv_scope
        self._check_params(sampling_params)
        self._check_accepting()
        problem = self.kv_layout().mismatch(layout) if layout is not None else None
        if problem is not None:
            raise KVLayoutError(problem)
        prompt = list(request.prompt_token_ids)
        max_tokens = self._max_tokens(request)
        sp = translate.sampling(self.api, sampling_params, max_tokens, context_only=True,
                                guided_backend=self.spec.guided_decoding_backend, vocab_size=self.vocab_size)
        handle = self._submit(prompt, sp, False, self.api.DisaggregatedParams(request_type="context_only"), cache_scope)
        self._handles[request_id] = handle
        try:
            result = await handle.aresult()
        except self.api.RequestError as e:
            raise RuntimeError(f"TensorRT-LLM failed the prefill: {e}") from e
        except (GeneratorExit, asyncio.CancelledError):
            handle.abort()
            raise
        except Exception as e:
            self._fail(e)
            raise EngineStoppedError(f"TensorRT-LLM failed: {e}") from e
        finally:
            self._handles.pop(request_id, None)
        c0 = result.outputs[0]
        if not c0.token_ids:
            raise KVTransferError(f"the prefill produced no token (finish reason {c0.finish_reason!r})")
        if c0.finish_reason in ("cancelled", "timeout"):
            raise KVTransferError(f"the prefill ended {c0.finish_reason}")
        token = int(c0.token_ids[0])
        ended = None
        if c0.finish_reason == "stop":
            ended = FinishReason.STOP.value
        elif max_tokens == 1:
            ended = FinishReason.LENGTH.value
        lps = translate.token_logprobs(getattr(c0, "logprobs", None), [token])
        yield PrefillStarted(token, lps[0] if lps else None, int(getattr(result, "cached_tokens", 0) or 0), 0, 0, 0)
        params = result.disaggregated_params
        if params is None and ended is None:
            raise KVTransferError("the context_only request returned no DisaggregatedParams (is the cache "
                                  "transceiver configured on this instance?)")
        body = json.loads(translate.encode_disagg(params)) if params is not None else {"fields": {}}
        body["finish"], body["text"] = ended, c0.text or ""  # the text matters when the first token ends it
        yield Handoff(json.dumps(body).encode())
        yield PrefillDone(0)
