"""The synchronous engine core: ``add_request``, ``abort``, ``step`` (schedule -> execute -> update).

Not thread-safe: one thread owns it (the async bridge runs it in a dedicated thread).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import ChainMap
from collections.abc import Sequence
from typing import Any

import structlog

from tokenfleet.engine.detokenizer import Decoder
from tokenfleet.engine.guided import GuideCompiler
from tokenfleet.engine.itl_guard import ItlGuard
from tokenfleet.engine.kv_connector import KVConnector
from tokenfleet.engine.kv_tier import SecondTier, StagedBlocks, TierChain
from tokenfleet.engine.lookahead import lookahead, queueable
from tokenfleet.engine.output import OutputState, RequestOutput, Resume
from tokenfleet.engine.request import FinishReason, Priority, Request, RequestStatus
from tokenfleet.engine.runner import ExecuteResult, ModelInfo, ModelRunner
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerOutput
from tokenfleet.engine.spec_decode import SpecConfig, Speculator
from tokenfleet.engine.stats import EngineStats, StepTimer
from tokenfleet.kvcache.layout import KVLayout
from tokenfleet.kvcache.salt import adapter_scope

log = structlog.get_logger()


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Decoder | None, model: ModelInfo):
        self.scheduler = scheduler
        self.runner = runner
        self._step_cost = getattr(runner, "step_cost", None)  # (SchedulerOutput) -> (model FLOPs, bytes read)
        self.tokenizer = tokenizer
        self.model = model
        self._states: dict[str, OutputState] = {}
        self._ids = itertools.count()
        self.stats = EngineStats()
        self._timer = StepTimer()
        self.kv = KVConnector(self)  # disaggregation: the decode side's remote prefills, the prefill side's holds
        self._groups: dict[str, set[str]] = {}  # n > 1: first sample's id -> ids of the group still running
        self._group_of: dict[str, str] = {}
        self._guides: GuideCompiler | None = None
        self._guides_lock = threading.Lock()
        self.tier: SecondTier | None = None
        self.staged: StagedBlocks | None = None  # blocks peers sent (peer fetch), until admission restores them
        self.spec: Speculator | None = None  # speculative decoding (enable_speculation)
        self.itl_guard: ItlGuard | None = None  # prompt chunks sized to decoding streams' latency (enable_itl_guard)

    def enable_itl_guard(self, guard: ItlGuard) -> None:
        """Steps beside decoding streams give prompt chunks only ``guard.factor`` x a decode-only step."""
        self.itl_guard = guard

    def enable_speculation(self, config: SpecConfig) -> None:
        """Propose tokens for decoding requests and verify them in the step's forward (engine.spec_decode)."""
        self.spec = Speculator(config)

    @property
    def moves_blocks(self) -> bool:
        """Whether whole blocks can leave and enter the pool here: a runner that moves them (``TierRunner``)
        and one KV group (sliding-window models: not yet). The second tier and peer fetch need it."""
        return hasattr(self.runner, "export_blocks") and len(self.scheduler.block_manager.windows) == 1

    def enable_peer_blocks(self, budget_bytes: int = 256 << 20) -> None:
        """Accept blocks fetched from peers (``stage_blocks``) and serve ours to them (``read_blocks``)."""
        if not self.moves_blocks:
            raise ValueError("this engine cannot move whole KV blocks (its runner or its KV groups)")
        self.staged = StagedBlocks(budget_bytes)
        self._chain_tiers()

    def attach_tier(self, tier: SecondTier) -> None:
        """Keep blocks the pool evicts in ``tier`` and restore them on prefix hits (engine.kv_tier)."""
        if not self.moves_blocks:
            raise ValueError("this engine cannot keep a second KV tier (its runner or its KV groups)")
        self.tier = tier
        self.scheduler.block_manager.track_evictions = True
        self._chain_tiers()

    def _chain_tiers(self) -> None:
        tiers = [t for t in (self.tier, self.staged) if t is not None]
        self.scheduler.second_tier = tiers[0] if len(tiers) == 1 else TierChain(tiers)

    # ---- peer fetch (engine thread) -------------------------------------------------------------
    def read_blocks(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Whole-block K/V of the longest leading run of ``block_hashes`` held here: in the pool, then in
        the second tier. For a peer that would otherwise recompute them."""
        if not self.moves_blocks:
            return []
        bm, out = self.scheduler.block_manager, []
        for h in block_hashes:
            block = bm.cached_block(h)
            if block is not None:
                out += self.runner.export_blocks([block])  # type: ignore[attr-defined]
            elif self.tier is not None and h in self.tier:
                got = self.tier.fetch_chain([h])
                if not got:
                    break
                out += got
            else:
                break
        self.stats.num_peer_blocks_served += len(out)
        return out

    def local_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` this engine holds (pool, then second tier): what a peer
        need not send."""
        n = len(self.scheduler.block_manager.match_prefix(block_hashes))
        while n < len(block_hashes) and self.tier is not None and block_hashes[n] in self.tier:
            n += 1
        return n

    def stage_blocks(self, block_hashes: Sequence[bytes], payloads: Sequence[bytes]) -> None:
        """Blocks a peer sent, restored at the admission of the prompt they belong to."""
        if self.staged is None:
            raise ValueError("peer blocks are not enabled on this engine")
        size = self.runner.block_bytes()  # type: ignore[attr-defined]
        for h, payload in zip(block_hashes, payloads):
            if len(payload) != size:
                raise ValueError(f"a peer's block is {len(payload)} bytes, not {size}: another layout")
            self.staged.put(h, payload)
        self.stats.num_peer_blocks_received += len(payloads)

    def offload_evicted(self) -> None:
        """Copy the blocks the pool just evicted into the second tier, before anything writes them again
        (call after every allocation: the step's, and a remote prefill's reservation)."""
        evicted = self.scheduler.block_manager.take_evicted()
        if evicted and self.tier is not None:
            # wait=False: on CUDA a side-stream copy into pinned memory the tier's writer waits for
            payloads = self.runner.export_blocks([block for block, _, _ in evicted], wait=False)  # type: ignore[attr-defined]
            for (_, block_hash, owner), payload in zip(evicted, payloads):
                self.tier.offer(block_hash, owner, payload)

    def close(self, seconds: float = 20.0) -> None:
        """At shutdown: copy the pool's cached blocks into a persistent second tier too (a restarted worker
        restores them from disk instead of recomputing its hottest prefixes) and wait for the writes."""
        if self.tier is None:
            return
        if not self.tier.store.persistent:
            self.tier.close()
            return
        tier = self.tier
        self.offload_evicted()
        tier.flush()
        # The most recently used blocks the tier's budget holds, not yet in it; at most ``seconds`` of copying.
        size = self.runner.block_bytes()  # type: ignore[attr-defined]
        fits = max(0, tier.budget_bytes // max(1, size + 4096))  # a record is the block and a small header
        blocks = [b for b in self.scheduler.block_manager.cached_blocks()[-fits:] if b[1] not in tier] if fits else []
        deadline = time.monotonic() + seconds
        for i in range(0, len(blocks), 64):  # in batches the writer keeps up with (offer drops when behind)
            if time.monotonic() > deadline:
                log.warning("kv_tier_close_cut_short", copied=i, left=len(blocks) - i)
                break
            batch = blocks[i: i + 64]
            payloads = self.runner.export_blocks([block for block, _, _ in batch])  # type: ignore[attr-defined]
            for (_, block_hash, owner), payload in zip(batch, payloads):
                tier.offer(block_hash, owner, payload)
            tier.flush()
        tier.close()

    @property
    def guides(self) -> GuideCompiler:
        """The grammar compiler, built on first use (seconds: the tokenizer's token trie); thread-safe."""
        with self._guides_lock:
            if self._guides is None:
                to_json = getattr(self.tokenizer, "to_json", None)
                if to_json is None:
                    raise ValueError("guided decoding needs the model's tokenizer")
                self._guides = GuideCompiler(to_json(), self.model.vocab_size, self.model.eos_token_ids)
            return self._guides

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = Priority.INTERACTIVE,
        arrival_time: float | None = None,
        resume: Resume | None = None,
        hold_kv: bool = False,
        tenant: str = "",
        cache_scope: str = "",
        adapter: str = "",
    ) -> str:
        """Validate and queue a request; returns its id. ValueError for bad input, QueueFullError when full.

        ``resume``: output tokens (and their text) another replica already delivered; generation
        continues after them. ``hold_kv``: keep the blocks when finished, for a KV transfer
        (``release_held``), at most ``hold_seconds``. ``cache_scope``: who may share its cached
        blocks (``tokenfleet.kvcache.salt``)."""
        if request_id is not None and "#" in request_id:
            raise ValueError(f"request id {request_id!r} must not contain '#' (it names a request's samples)")
        request = self._new_request(prompt_token_ids, sampling_params, request_id, priority, arrival_time, resume)
        request.hold_blocks = hold_kv
        request.tenant = tenant
        if adapter:
            if adapter not in (getattr(self.runner, "adapters", None) or ()):
                raise ValueError(f"LoRA adapter {adapter!r} is not loaded on this worker")
            request.adapter = adapter
            # an adapter changes every layer's K/V: its prefixes are cached (and routed) apart from the base model's
            cache_scope = adapter_scope(cache_scope, adapter)
        request.cache_scope = cache_scope
        forks = [self._fork_of(request, i) for i in range(1, sampling_params.n)]
        if forks and (hold_kv or resume is not None):
            raise ValueError("n > 1 cannot be combined with a KV hold or a resume")
        self.scheduler.add_request(request, forks)
        self._states[request.request_id] = OutputState(request, self.tokenizer, resume.text if resume else None)
        if forks:
            group = {request.request_id, *(f.request_id for f in forks)}
            self._groups[request.request_id] = group
            for member in group:
                self._group_of[member] = request.request_id
            for fork in forks:
                self._states[fork.request_id] = OutputState(fork, self.tokenizer)
        return request.request_id

    def _fork_of(self, request: Request, index: int) -> Request:
        """Sample ``index`` of ``request``'s group: same prompt; a seeded request's samples use
        seed + index, so they differ from each other yet reproduce."""
        params = request.sampling_params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + index) % 2**64)
        fork = dataclasses.replace(request, request_id=f"{request.request_id}#{index}", sampling_params=params,
                                   output_token_ids=[], block_hashes=[], index=index,  # prompt_logprobs: shared
                                   guide=self.guides.matcher(params.guided) if params.guided else None)
        return fork

    def group(self, request_id: str) -> set[str]:
        """Ids of the request's samples still running (itself alone when n = 1)."""
        return set(self._groups.get(request_id, {request_id}))

    def _new_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, request_id: str | None,
                     priority: int, arrival_time: float | None, resume: Resume | None = None) -> Request:
        prompt = self._validate_prompt(prompt_token_ids)
        max_tokens = sampling_params.output_limit(self.model.max_model_len, len(prompt))
        outputs = list(resume.output_token_ids) if resume is not None else []
        if len(outputs) >= max_tokens:
            raise ValueError(f"resumed with {len(outputs)} output tokens; the request allows {max_tokens}")
        if any(not 0 <= t < self.model.vocab_size for t in outputs):
            raise ValueError(f"resumed output token ids out of range [0, {self.model.vocab_size})")
        bad_bias = [t for t, _ in sampling_params.logit_bias if t >= self.model.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token ids out of range [0, {self.model.vocab_size}): {bad_bias[:5]}")
        guide = None
        if sampling_params.guided is not None:
            guide = self.guides.matcher(sampling_params.guided)  # cached: a copy (compiles on a miss)
            if outputs and not guide.consume_tokens(outputs):
                raise ValueError("the resumed output does not match the request's grammar")
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=prompt,
            sampling_params=sampling_params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=int(priority),
            max_tokens=max_tokens,
            eos_token_ids=self.model.eos_token_ids,
            output_token_ids=outputs,
            guide=guide,
        )

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
        """End a request now; frees its blocks (held ones too). Returns its final output, or None if unknown/finished."""
        outputs = self.abort_group(request_id)
        return next((o for o in outputs if o.request_id == request_id), None)

    def abort_group(self, request_id: str) -> list[RequestOutput]:
        """Abort a request and, when it is the first of n samples, the others; their final outputs."""
        # The other samples first: aborting the first sample drops those not forked yet from the scheduler.
        members = sorted(self.group(request_id), key=lambda member: member == request_id)
        outputs = [self._abort_one(member) for member in members]
        return [o for o in outputs if o is not None]

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        self._leave_group(request_id)
        self.kv.release_held(request_id)
        request = self.scheduler.finish_request(request_id, FinishReason.ABORT)
        if self._inflight is not None and all(self.scheduler.requests.get(rid) is not r
                                              for rid, r in self._inflight[2].items()):
            self._inflight = None  # nobody left in the queued step: the device finishes it, nobody reads it
        state = self._states.pop(request_id, None)
        self.runner.release(request_id)
        if self.spec is not None and request is not None:
            self.spec.finished(request)
        if request is None or state is None:
            return None
        self.stats.num_aborted += 1
        return state.finish(state.empty_output(), FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_layout(self) -> KVLayout:
        num_layers, num_kv_heads, head_dim, dtype = self.runner.kv_geometry()
        return KVLayout(self.scheduler.hash_salt, dtype, self.scheduler.block_manager.block_size,
                        num_layers, num_kv_heads, head_dim, self.model.layer_windows)

    # ---- one step -----------------------------------------------------------------------------
    def enable_overlap(self) -> None:
        """Overlapped scheduling: while a decode step runs on the device, the next one (``engine.lookahead``: the
        same requests one position on, their input tokens taken from the running step's samples on the device) is
        prepared and queued behind it, and only then does the host wait for the running step's tokens, update the
        scheduler and build outputs. The device runs step after step without waiting for Python in between. Needs
        a runner with ``launch`` (backends.torch); steps it cannot overlap (prefill chunks, speculation, guided or
        penalized sampling, admissions) run as before."""
        if not hasattr(self.runner, "launch"):
            raise ValueError(f"{type(self.runner).__name__} cannot queue steps ahead (overlapped scheduling)")
        self.overlap = True

    overlap = False
    # the next step, queued on the device by the last step(), with the requests it was queued for
    _inflight: tuple[SchedulerOutput, Any, dict[str, Request]] | None = None

    def step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            return self._overlapped(*self._inflight)
        if self.spec is not None:
            self.spec.cost.prefill_per_token = 1.0 / self.stats.prefill_tokens_per_s if self.stats.prefill_tokens_per_s else 0.0
            self.spec.propose(self.scheduler.running, self.scheduler.config.max_num_batched_tokens)
        if self.itl_guard is not None:
            self.scheduler.prefill_allowance = self.itl_guard.allowance()
        output = self.scheduler.schedule()
        self.offload_evicted()  # before the restores and the forward overwrite those blocks
        if output.is_empty:
            return []
        launch = self.overlap and self.spec is None and queueable(self.scheduler, output)
        with self._timer:
            if output.restores:
                self.runner.import_blocks(output.restores)  # type: ignore[attr-defined]
            if launch:
                launched = self.runner.launch(output, self._request_view())  # type: ignore[attr-defined]
            else:
                result = self.runner.execute(output, self._request_view())
        if launch:
            return self._overlapped(output, launched, self._queued_requests(output))
        return self._complete(output, result)

    def _request_view(self) -> ChainMap:
        return ChainMap(self.scheduler.requests, self.scheduler.pending_forks)

    def _queued_requests(self, output: SchedulerOutput) -> dict[str, Request]:
        """The requests a queued step runs for, by id (a row of one that has ended stays in the step, discarded)."""
        return {s.request_id: r for s in output.scheduled if (r := self.scheduler.requests.get(s.request_id)) is not None}

    def _overlapped(self, output: SchedulerOutput, launched: Any, queued_for: dict[str, Request]) -> list[RequestOutput]:
        """``output`` is queued on the device (``launched``, for the requests ``queued_for``): queue the step after
        it when the scheduler can tell it without its tokens, then wait for them and finish ``output`` (update,
        outputs). The next step stays queued for the next call."""
        with self._timer:
            following = lookahead(self.scheduler, output)
            queued = None
            if following is not None:
                self.offload_evicted()  # blocks the lookahead's allocations evicted, before the forward reuses them
                queued = self.runner.launch(following, self._request_view(), launched)  # type: ignore[attr-defined]
                self.stats.num_overlapped_steps += 1
            result = launched.result()
        self._inflight = None
        # only the rows of requests still running as they were queued (not ended, aborted, or an id reused since)
        live = tuple(s for s in output.scheduled
                     if (r := self.scheduler.requests.get(s.request_id)) is not None and r is queued_for.get(s.request_id))
        outputs = self._complete(dataclasses.replace(output, scheduled=live), result) if live else []
        if following is not None:
            ended = sum(self.scheduler.requests.get(s.request_id) is None for s in following.scheduled)
            self.stats.num_overlap_discarded_rows += ended
            if ended < len(following.scheduled):  # else every request in it ended with ``output``: drop it
                self._inflight = (following, queued, self._queued_requests(following))
        return outputs

    def _complete(self, output: SchedulerOutput, result: ExecuteResult) -> list[RequestOutput]:
        """After the forward: the scheduler's update, the step's outputs, the counters."""
        requests = self.scheduler.requests
        for request_id, lps in result.prompt_logprobs.items():
            requests[request_id].prompt_logprobs.extend(lps)
        self.stats.num_prompt_tokens_computed += sum(
            max(0, min(s.start + s.num_new_tokens, requests[s.request_id].num_prompt_tokens) - s.start)
            for s in output.scheduled)
        if self.spec is not None:
            self._observe_speculation(output, result)
        finished = {r.request_id: r for r in self.scheduler.update(output, result.sampled, result.accepted)}
        outputs = []
        for entry in output.scheduled:
            if entry.samples and entry.request_id in result.sampled:
                outputs.append(self._process(entry.request_id, result, finished))
                outputs.extend(self._process(fork_id, result, finished) for fork_id in entry.forks)
        self.stats.record_step(self._timer.last, output.num_scheduled_tokens)
        if self.itl_guard is not None and not self.overlap:
            self.itl_guard.observe(output.scheduled, self._timer.last)
        if self._step_cost is not None:
            flops, read = self._step_cost(output)
            self.stats.model_flops += flops
            self.stats.model_bytes += read
        if any(s.num_new_tokens > 1 and not s.draft for s in output.scheduled):  # a verification is no prefill
            self.stats.record_prefill_rate(output.num_scheduled_tokens, self._timer.last)
        return outputs

    def _observe_speculation(self, output: SchedulerOutput, result: ExecuteResult) -> None:
        assert self.spec is not None
        verified = [s for s in output.scheduled if s.draft]
        for entry in verified:
            accepted = len(result.accepted.get(entry.request_id, ()))
            self.spec.observe(self.scheduler.requests[entry.request_id], len(entry.draft), accepted)
            self.stats.num_spec_proposed_tokens += len(entry.draft)
            self.stats.num_spec_accepted_tokens += accepted
            self.stats.num_spec_verifications += 1
        if all(s.num_new_tokens == 1 or s.draft for s in output.scheduled):  # decode and verification steps
            self.spec.cost.observe(output.num_scheduled_tokens, self._timer.last)
            if verified:
                self.stats.num_spec_steps += 1
                self.stats.spec_step_seconds += self._timer.last
            else:
                self.stats.num_plain_decode_steps += 1
                self.stats.plain_decode_step_seconds += self._timer.last

    def _process(self, request_id: str, result: ExecuteResult, finished: dict[str, Request]) -> RequestOutput:
        state = self._states[request_id]
        request = finished.get(request_id)
        tokens = [result.sampled[request_id], *result.accepted.get(request_id, ())]
        logprobs = [result.logprobs.get(request_id), *result.accepted_logprobs.get(request_id, ())]
        live = self.scheduler.requests.get(request_id) or request
        if len(tokens) > 1:  # the scheduler drops the tail after a stop inside the accepted run
            tokens = tokens[: self.scheduler.appended.get(request_id, len(tokens))]
        out = None
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            # Ended by EOS or a stop token id: that token is not text. (A completed grammar's last token is.)
            by_token = last and request is not None and request.finish_reason is FinishReason.STOP and (
                token in request.eos_token_ids or token in request.sampling_params.stop_token_ids)
            step_out = state.on_token(token, logprobs[i] if i < len(logprobs) else None, by_token)
            if out is None:
                out = step_out
            else:
                out.new_token_ids += step_out.new_token_ids
                out.text += step_out.text
                out.logprobs += step_out.logprobs
                out.num_output_tokens = step_out.num_output_tokens
            if state.matcher.matched is not None and not last:  # a stop string inside the accepted run
                assert live is not None
                del live.output_token_ids[len(live.output_token_ids) - (len(tokens) - 1 - i):]
                out.num_output_tokens = len(live.output_token_ids)
                if request is not None:  # the scheduler ended it later in the run (length): the stop string did
                    request.finish_reason = FinishReason.STOP
                break
        assert out is not None
        if request is None and state.matcher.matched is not None:
            request = self.scheduler.finish_request(request_id, FinishReason.STOP)
        if request is not None and request.finish_reason is not None:
            if request_id in self.scheduler.held:
                self.kv.hold(request_id)
            self._states.pop(request_id)
            self._leave_group(request_id)
            self.runner.release(request_id)
            self.stats.record_finished(request)
            if self.spec is not None:
                self.spec.finished(request)
            out = state.finish(out, request.finish_reason)
        return out

    def _leave_group(self, request_id: str) -> None:
        first = self._group_of.pop(request_id, None)
        if first is not None:
            group = self._groups[first]
            group.discard(request_id)
            if not group:
                del self._groups[first]

    def snapshot(self) -> EngineStats:
        """Current counters and gauges (copied)."""
        bm = self.scheduler.block_manager
        tier = {}
        if self.tier is not None:
            t = self.tier.snapshot()
            tier = dict(tier_hit_blocks=t.hits, tier_stored_blocks=t.stored, tier_dropped_blocks=t.dropped,
                        tier_evicted_blocks=t.evicted, tier_corrupt_blocks=t.corrupt, tier_bytes_written=t.bytes_written,
                        tier_bytes_read=t.bytes_read, tier_restore_seconds=t.restore_seconds,
                        tier_bytes_used=t.bytes_used, tier_entries=t.entries)
        return self.stats.snapshot(
            **tier,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_forks=self.scheduler.num_forks,
            num_fork_shared_blocks=self.scheduler.num_fork_shared_blocks,
            num_block_copies=self.scheduler.num_block_copies,
            num_queued_prompt_tokens=sum(
                max(0, r.num_tokens - r.num_computed_tokens - 1) for r in self.scheduler.requests.values()
                if r.status is not RequestStatus.REMOTE_PREFILL),
        )
