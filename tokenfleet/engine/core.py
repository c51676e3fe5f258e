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
from dataclasses import dataclass
from typing import Any

import structlog

from tokenfleet.engine.detokenizer import Decoder
from tokenfleet.engine.guided import GuideCompiler
from tokenfleet.engine.itl_guard import ItlGuard
from tokenfleet.engine.kv_connector import KVConnector
from tokenfleet.engine.kv_tier import SecondTier, StagedBlocks, TierChain
from tokenfleet.engine.lookahead import lookahead, queueable
from tokenfleet.engine.output import OutputState, RequestOutput
from tokenfleet.engine.prefetch import Prefetcher
from tokenfleet.engine.request import FinishReason, Request, RequestStatus
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.runner import (
    AdapterRunner,
    CostModel,
    ExecuteResult,
    ModelInfo,
    ModelRunner,
    OverlapRunner,
    TierRunner,
)
from tokenfleet.engine.scheduler import Scheduler, SchedulerOutput
from tokenfleet.engine.spec_decode import SpecConfig, Speculator
from tokenfleet.engine.stats import EngineStats, StepTimer
from tokenfleet.kvcache.layout import KVLayout

log = structlog.get_logger()


def kv_layout(scheduler: Scheduler, runner: ModelRunner, model: ModelInfo) -> KVLayout:
    """What the KV blocks of an engine of these parts mean (``EngineCore.kv_layout``; a builder needs it first)."""
    num_layers, num_kv_heads, head_dim, dtype = runner.kv_geometry()
    return KVLayout(scheduler.hash_salt, dtype, scheduler.block_manager.block_size, num_layers, num_kv_heads, head_dim,
                    model.layer_windows)


@dataclass
class CoreParts:
    """The optional parts an ``EngineCore`` is built with. Each capability of the runner is passed as the runner
    itself (typed by the protocol it implements), or None where the runner lacks it or the operator left it off."""

    blocks: TierRunner | None = None  # whole-block moves: the second tier and peer fetch need them
    tier: SecondTier | None = None  # keep blocks the pool evicts, restore them on prefix hits (needs ``blocks``)
    peer_blocks: bool = False  # accept blocks peers send, serve ours to them (needs ``blocks``)
    speculation: SpecConfig | None = None  # speculative decoding (engine.spec_decode)
    overlap: OverlapRunner | None = None  # overlapped scheduling (engine.lookahead)
    itl_guard: ItlGuard | None = None  # prompt chunks sized to decoding streams' latency
    adapters: AdapterRunner | None = None  # LoRA adapters
    costs: CostModel | None = None  # each step's FLOPs and bytes (MFU/MBU)


class EngineCore:
    """``parts``: what the core is built with beyond scheduling and running steps (``CoreParts``)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Decoder | None, model: ModelInfo,
                 parts: CoreParts | None = None):
        parts = parts or CoreParts()
        self.scheduler = scheduler
        self.runner = runner
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
        # whole blocks leave and enter the pool only with one KV group (sliding-window models: not yet)
        self.blocks = parts.blocks if len(scheduler.block_manager.windows) == 1 else None
        self.adapters = parts.adapters
        self.costs = parts.costs
        self.overlap = parts.overlap
        self.itl_guard = parts.itl_guard
        self.spec = Speculator(parts.speculation) if parts.speculation is not None else None
        self.tier: SecondTier | None = None
        self.staged: StagedBlocks | None = None  # blocks peers sent (peer fetch), until admission restores them
        if (parts.tier is not None or parts.peer_blocks) and self.blocks is None:
            raise ValueError("this engine cannot move whole KV blocks (its runner or its KV groups): no second tier "
                             "and no peer fetch")
        if parts.peer_blocks:
            self.staged = StagedBlocks(256 << 20)
        if parts.tier is not None:
            self.tier = parts.tier
            self.scheduler.block_manager.track_evictions = True
        # retained conversations' blocks the pool demoted to the tier come back between steps (engine.prefetch)
        self.prefetcher = Prefetcher(scheduler.block_manager, self.tier, self.blocks) \
            if self.tier is not None and self.blocks is not None else None
        tiers = [t for t in (self.tier, self.staged) if t is not None]
        if tiers:
            self.scheduler.second_tier = tiers[0] if len(tiers) == 1 else TierChain(tiers)

    @property
    def moves_blocks(self) -> bool:
        """Whether whole blocks can leave and enter the pool here (``CoreParts.blocks``)."""
        return self.blocks is not None

    # ---- peer fetch (engine thread) -------------------------------------------------------------
    def _blocks(self) -> TierRunner:
        if self.blocks is None:
            raise ValueError("this engine cannot move whole KV blocks")
        return self.blocks

    def read_blocks(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Whole-block K/V of the longest leading run of ``block_hashes`` held here: in the pool, then in
        the second tier. For a peer that would otherwise recompute them."""
        if self.blocks is None:
            return []
        bm, out = self.scheduler.block_manager, list[bytes]()
        for h in block_hashes:
            block = bm.cached_block(h)
            if block is not None:
                out += self.blocks.export_blocks([block])
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
        size = self._blocks().block_bytes()
        for h, payload in zip(block_hashes, payloads):
            if len(payload) != size:
                raise ValueError(f"a peer's block is {len(payload)} bytes, not {size}: another layout")
            self.staged.put(h, payload)
        self.stats.num_peer_blocks_received += len(payloads)

    def offload_evicted(self) -> None:
        """Copy the blocks the pool just evicted into the second tier, before anything writes them again
        (call after every allocation: the step's, and a remote prefill's reservation)."""
        bm = self.scheduler.block_manager
        evicted = bm.take_evicted()
        if evicted and self.tier is not None:
            self.stats.num_retained_demoted += sum(block_hash in bm.retention for _, block_hash, _ in evicted)
            # wait=False: on CUDA a side-stream copy into pinned memory the tier's writer waits for
            payloads = self._blocks().export_blocks([block for block, _, _ in evicted], wait=False)
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
        size = self._blocks().block_bytes()
        fits = max(0, tier.budget_bytes // max(1, size + 4096))  # a record is the block and a small header
        blocks = [b for b in self.scheduler.block_manager.cached_blocks()[-fits:] if b[1] not in tier] if fits else []
        deadline = time.monotonic() + seconds
        for i in range(0, len(blocks), 64):  # in batches the writer keeps up with (offer drops when behind)
            if time.monotonic() > deadline:
                log.warning("kv_tier_close_cut_short", copied=i, left=len(blocks) - i)
                break
            batch = blocks[i: i + 64]
            payloads = self._blocks().export_blocks([block for block, _, _ in batch])
            for (_, block_hash, owner), payload in zip(batch, payloads):
                tier.offer(block_hash, owner, payload)
            tier.flush()
        tier.close()

    @property
    def guides(self) -> GuideCompiler:
        """The grammar compiler, built on first use (seconds: the tokenizer's token trie); thread-safe."""
        with self._guides_lock:
            if self._guides is None:
                if self.tokenizer is None:
                    raise ValueError("guided decoding needs the model's tokenizer")
                self._guides = GuideCompiler(self.tokenizer.to_json(), self.model.vocab_size, self.model.eos_token_ids)
            return self._guides

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: RequestSpec) -> str:
        """Validate and queue a request; returns its id. ValueError for bad input, QueueFullError when full.

        ``request.resume``: output tokens (and their text) another replica already delivered; generation
        continues after them. ``request.hold_kv``: keep the blocks when finished, for a KV transfer
        (``release_held``), at most ``hold_seconds``. ``request.kv_scope``: who may share its cached
        blocks (``tokenfleet.kvcache.salt``; an adapter's prefixes are cached apart from the base model's)."""
        if request.request_id is not None and "#" in request.request_id:
            raise ValueError(f"request id {request.request_id!r} must not contain '#' (it names a request's samples)")
        if request.adapter and request.adapter not in self.adapter_names():
            raise ValueError(f"LoRA adapter {request.adapter!r} is not loaded on this worker")
        state = self.new_request(request)
        forks = [self._fork_of(state, i) for i in range(1, request.sampling_params.n)]
        if forks and (request.hold_kv or request.resume is not None):
            raise ValueError("n > 1 cannot be combined with a KV hold or a resume")
        self.scheduler.add_request(state, forks)
        self.track(state, request.resume.text if request.resume else None)
        if forks:
            group = {state.request_id, *(f.request_id for f in forks)}
            self._groups[state.request_id] = group
            for member in group:
                self._group_of[member] = state.request_id
            for fork in forks:
                self.track(fork)
        return state.request_id

    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters the runner has loaded (() for a runner without adapters)."""
        return self.adapters.adapter_names() if self.adapters is not None else ()

    def track(self, request: Request, resumed_text: str | None = None) -> None:
        """Follow a request the scheduler took: its outputs are built from here on."""
        self._states[request.request_id] = OutputState(request, self.tokenizer, resumed_text)

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

    def new_request(self, spec: RequestSpec) -> Request:
        """The scheduler's state for ``spec``, validated against this model (not queued yet)."""
        prompt = self._validate_prompt(spec.prompt_token_ids)
        sampling_params = spec.sampling_params
        max_tokens = spec.output_limit(self.model.max_model_len)
        outputs = list(spec.resume.output_token_ids) if spec.resume is not None else []
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
            request_id=spec.request_id if spec.request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=prompt,
            sampling_params=sampling_params,
            arrival_time=time.monotonic() if spec.arrival_time is None else spec.arrival_time,
            priority=spec.priority,
            max_tokens=max_tokens,
            eos_token_ids=self.model.eos_token_ids,
            output_token_ids=outputs,
            guide=guide,
            hold_blocks=spec.hold_kv,
            tenant=spec.tenant,
            cache_scope=spec.kv_scope,
            adapter=spec.adapter,
            conversation=spec.conversation,
            retention_s=spec.retention_s,
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

    # ---- retention (engine.retention) ---------------------------------------------------------
    def retain(self, request: Request, now: float) -> int:
        """``request`` ended (stop or length) with a retention: keep its computed full blocks, prompt and
        output, retained under its conversation (its id without one) until ``now + retention_s``, clamped to the
        pool's window and, past it, to the second tier's (``Retention.pin``). Returns the KV bytes retained."""
        if not self.scheduler.config.enable_prefix_caching:
            return 0  # nothing is cached by hash: nothing to keep
        bm = self.scheduler.block_manager
        num_blocks = request.num_computed_tokens // bm.block_size
        bm.retain(request.conversation or request.request_id, request.tenant, request.block_hashes[:num_blocks],
                  now, request.retention_s)
        return num_blocks * self._block_bytes()

    def release(self, conversation: str) -> int:
        """End ``conversation``'s retention now (the client said it is over): its blocks go back to plain LRU, in
        the pool and in the second tier. Returns how many blocks it retained (0: none, or already ended)."""
        num_blocks = self.scheduler.block_manager.release(conversation)
        self.stats.num_retention_releases += num_blocks > 0
        return num_blocks

    def tend(self, now: float) -> bool:
        """Between steps (engine thread; the async bridge calls it every loop, idle or not): end the retentions
        whose deadline passed, then prefetch one bounded batch of retained blocks from the second tier when
        nothing waits. True when the batch was full: call again soon rather than wait for work."""
        self.stats.num_retention_expiries += self.scheduler.block_manager.expire(now)
        if self.prefetcher is None or self._inflight is not None:  # a queued step's blocks are spoken for
            return False
        num = self.prefetcher.run(self.scheduler.num_waiting, self.scheduler.num_running, self.offload_evicted)
        return num >= self.prefetcher.batch

    def kv_layout(self) -> KVLayout:
        return kv_layout(self.scheduler, self.runner, self.model)

    # ---- one step -----------------------------------------------------------------------------
    # the next step, queued on the device by the last step(), with the requests it was queued for
    _inflight: tuple[SchedulerOutput, Any, dict[str, Request]] | None = None

    def step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            return self._overlapped(*self._inflight)
        if self.spec is not None:
            self.spec.cost.prefill_per_token = 1.0 / self.stats.prefill_tokens_per_s if self.stats.prefill_tokens_per_s else 0.0
            self.spec.propose(self.scheduler.running, self.scheduler.config.max_num_batched_tokens)
        now = time.monotonic()
        if self.itl_guard is not None:
            self.scheduler.prefill_allowance = self.itl_guard.step_allowance(self.scheduler.running, now)
        self.stats.num_retention_expiries += self.scheduler.block_manager.expire(now)
        output = self.scheduler.schedule(now)
        self.offload_evicted()  # before the restores and the forward overwrite those blocks
        if output.is_empty:
            return []
        overlap = self.overlap if self.overlap is not None and self.spec is None and queueable(self.scheduler, output) \
            else None
        with self._timer:
            if output.restores:
                self._blocks().import_blocks(output.restores)
            if overlap is not None:
                launched = overlap.launch(output, self._request_view())
            else:
                result = self.runner.execute(output, self._request_view())
        if overlap is not None:
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
            if following is not None and self.overlap is not None:
                self.offload_evicted()  # blocks the lookahead's allocations evicted, before the forward reuses them
                queued = self.overlap.launch(following, self._request_view(), launched)
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
        sampled_at = time.monotonic()
        for request_id in result.sampled:  # the TPOT clock of a request's stream starts at its first token
            request = requests.get(request_id) or finished.get(request_id)
            if request is not None and request.first_token_time is None:
                request.first_token_time = sampled_at
        if self.itl_guard is not None:
            for request in finished.values():
                self.itl_guard.finished(len(request.output_token_ids))
        outputs = []
        for entry in output.scheduled:
            if entry.samples and entry.request_id in result.sampled:
                outputs.append(self.output_of(entry.request_id, result, finished))
                outputs.extend(self.output_of(fork_id, result, finished) for fork_id in entry.forks)
        self.stats.record_step(self._timer.last, output.num_scheduled_tokens)
        if self.itl_guard is not None and self.overlap is None:
            self.itl_guard.observe(output.scheduled, self._timer.last)
        if self.costs is not None:
            flops, read = self.costs.step_cost(output)
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

    def output_of(self, request_id: str, result: ExecuteResult, finished: dict[str, Request]) -> RequestOutput:
        """The request's output for a step's result (tokens, text, its end when it finished)."""
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
            elif request.retention_s > 0:  # ended by stop or length here: an abort never comes this way
                out.retained_bytes = self.retain(request, time.monotonic())
            self._states.pop(request_id)
            self._leave_group(request_id)
            self.runner.release(request_id)
            self.stats.record_finished(request)
            if self.spec is not None:
                self.spec.finished(request)
            out = state.finish(out, request.finish_reason)
        return out

    def _block_bytes(self) -> int:
        """Bytes one pool block holds: K and V of every layer."""
        layout = self.kv_layout()
        return 2 * layout.num_layers * layout.block_bytes

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
        owned = bm.retention.owner_blocks()
        block_bytes = self._block_bytes() if owned else 0
        return self.stats.snapshot(
            **tier,
            num_retained_blocks=bm.retention.num_hashes,
            num_retained_idle_blocks=bm.num_retained_idle_blocks,
            num_retained_evicted=bm.num_retained_evicted,
            num_prefetched_blocks=self.prefetcher.num_prefetched if self.prefetcher is not None else 0,
            num_prefetch_hits=bm.num_prefetch_hits,
            retained_bytes_per_tenant={tenant: n * block_bytes for tenant, n in owned.items()},
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
