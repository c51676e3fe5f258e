"""Iteration-level scheduler: pure Python over plain data (no torch, no I/O, no clock).

One token-budget model covers everything: each step a request is given ``num_new_tokens``
so that ``num_computed_tokens`` catches up with ``num_tokens`` (prompt + output). A chunk
that reaches ``num_tokens`` samples one token. Order of a step:

1. running requests, highest priority and earliest arrival first: decodes (1 token) and the
   rest of partially prefilled prompts. If blocks run out, the lowest-priority,
   latest-arrived running request is preempted (blocks freed, recomputed later).
2. waiting requests fill the remaining budget with prefill chunks, admitted only if their
   blocks can be allocated (prefix-cache hits are reused). Priority classes are strict; within
   one, preempted requests first, then tenants by virtual token counters (``FairQueue``: the
   tenant served least goes next, FCFS within a tenant), or plain arrival order without
   ``fair_queuing``. Prompt tokens are charged when scheduled, output tokens when sampled.

Disaggregation adds two lifecycles outside the step loop. A decode worker reserves a remote
request's prompt blocks (``add_remote``), takes its first token and KV from a prefill
replica, then ``activate_remote`` joins it to the running batch (or ``fallback_to_local``
recomputes it here, like a preemption). A prefill worker's requests ``hold_blocks``: when
they finish, their blocks stay in ``held`` until ``release_held`` (transfer done or timed out).

At over 500 lines this module is above the house guideline on purpose: it is one class whose
``schedule`` order above is the policy, and the remote/held lifecycles move requests between the
same queues; split across files, each part would have to reach into the others' queues. The
pieces that stand alone already live apart (``BlockManager``, ``FairQueue``, ``Request``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.fair_queue import FairQueue
from tokenfleet.engine.itl_guard import PrefillAllowance, for_step
from tokenfleet.engine.request import FinishReason, Request, RequestStatus
from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.kvcache.salt import chain_salt


class PrefixTier(Protocol):
    """Where blocks the pool evicted may still be (engine.kv_tier.SecondTier)."""

    def held_run(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading ``block_hashes`` it holds, from its index alone (no reads)."""
        ...

    def fetch_chain(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """K/V bytes of the longest leading run of ``block_hashes`` it holds (verified; a record that
        fails verification ends the run early)."""
        ...


class QueueFullError(RuntimeError):
    """The waiting queue is at capacity; the caller should reject the request (e.g. 503)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_running: int = 128
    max_num_waiting: int = 1024
    max_prefill_chunk: int = 0  # per-request chunk cap; 0 = limited only by the budget
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    fair_queuing: bool = True  # within a priority, tenants by virtual token counters (FairQueue)
    fair_prompt_weight: float = 1.0
    fair_output_weight: float = 2.0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_running < 1 or self.max_num_waiting < 0:
            raise ValueError(f"invalid scheduler limits: {self}")
        if self.max_prefill_chunk < 0:
            raise ValueError(f"max_prefill_chunk must be >= 0, got {self.max_prefill_chunk}")


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    start: int  # num_computed_tokens before this step
    num_new_tokens: int
    block_ids: tuple[int, ...]  # the request's whole block table after allocation (the first KV group's)
    samples: bool  # the chunk reaches the end of the known tokens: sample one token
    forks: tuple[str, ...] = ()  # samples of the same prompt: each samples its own first token from these logits
    other_block_ids: tuple[tuple[int, ...], ...] = ()  # the other KV groups' tables (sliding-window models)
    # Speculative verification: proposed tokens after the request's last one (num_new_tokens counts them too);
    # each of the 1 + len(draft) positions gets logits, and update() takes the accepted run.
    draft: tuple[int, ...] = ()

    @property
    def plain_decode(self) -> bool:
        """One token in, one sampled out, for this request alone (no verification, no forks)."""
        return self.num_new_tokens == 1 and self.samples and not self.draft and not self.forks


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]  # single-token entries first, then longer chunks
    copies: tuple[tuple[int, int], ...]  # (src, dst) blocks to copy before the forward
    preempted_ids: tuple[str, ...]
    restores: tuple[tuple[int, bytes], ...] = ()  # (block, K/V bytes) from the second tier, to install first

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, hash_salt: str):
        self.config = config
        self.block_manager = block_manager
        self.hash_salt = hash_salt
        self.requests: dict[str, Request] = {}
        self.waiting = FairQueue(config.fair_queuing, config.fair_prompt_weight, config.fair_output_weight)
        self.running: list[Request] = []
        self._seq = itertools.count()
        self._order: dict[str, tuple] = {}
        self.held: dict[str, Request] = {}  # finished, blocks kept for a KV transfer
        # n > 1: the other samples of a request wait here until its prompt is computed, then
        # share its blocks (fork, copy-on-write) and join the running batch.
        self.forks: dict[str, list[Request]] = {}  # parent id -> its pending samples
        self.pending_forks: dict[str, Request] = {}  # id -> pending sample
        self.num_preemptions = 0
        self.num_forks = self.num_fork_shared_blocks = self.num_block_copies = 0
        # The second KV tier (engine.kv_tier): blocks past a pool hit that it holds are restored, not recomputed.
        self.second_tier: PrefixTier | None = None
        self.appended: dict[str, int] = {}  # the last update's verification entries: tokens each request took

    # ---- queue management --------------------------------------------------------------
    def salt(self, request: Request) -> str:
        """The salt of ``request``'s block-hash chain: this engine's, scoped to who may share (kvcache.salt)."""
        return chain_salt(self.hash_salt, request.cache_scope)

    def add_request(self, request: Request, forks: Sequence[Request] = ()) -> None:
        """Queue a validated request. Raises QueueFullError or ValueError (can never fit).

        ``forks``: more samples of the same prompt (n > 1); they are forked from ``request``
        when its prompt is computed, sharing its blocks."""
        self._check_new(request)
        for fork in forks:
            if fork.request_id in self.requests or fork.request_id in self.pending_forks or fork.output_token_ids:
                raise ValueError(f"bad fork {fork.request_id!r}: duplicate id or already has output")
        if forks and request.output_token_ids:
            raise ValueError("a request with output tokens (resumed) cannot fork samples")
        self._lift(request.tenant)
        self.requests[request.request_id] = request
        self._order[request.request_id] = (request.priority, request.arrival_time, next(self._seq))
        self._push_waiting(request)
        if forks:
            self.forks[request.request_id] = list(forks)
            self.pending_forks.update((f.request_id, f) for f in forks)

    def active_tenants(self) -> set[str]:
        """Tenants with a request waiting or running."""
        return {r.tenant for r in self.requests.values() if r.status is not RequestStatus.REMOTE_PREFILL}

    def _lift(self, tenant: str) -> None:
        """Call before ``tenant``'s request joins the waiting or running requests: if it had none,
        its counter is lifted to the smallest active one (VTC: idle time earns no credit)."""
        if self.config.fair_queuing:
            active = self.active_tenants()
            if tenant not in active:
                self.waiting.activate(tenant, active)

    def _check_new(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.held or \
                request.request_id in self.pending_forks:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if len(self.waiting) >= self.config.max_num_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_num_waiting} requests)")
        bm = self.block_manager
        bs = bm.block_size
        num_blocks = bm.blocks_for(request.num_tokens, self.config.max_num_batched_tokens)
        if num_blocks > bm.capacity:
            raise ValueError(f"prompt needs {num_blocks} KV blocks; the cache has {bm.capacity}")
        request.block_hashes = hash_blocks(request.all_token_ids, bs, self.salt(request))

    # ---- disaggregation ------------------------------------------------------------------
    def add_remote(self, request: Request) -> int | None:
        """Reserve blocks for a prompt whose KV comes from a prefill replica; the request waits
        outside the queues until ``activate_remote``. Returns how many leading prompt blocks
        were already cached here (they need not travel), or None (nothing changed) when the
        blocks are not free now."""
        self._check_new(request)
        bm = self.block_manager
        full = request.block_hashes[: request.num_prompt_tokens // bm.block_size]
        prefix = bm.match_prefix(full) if self.config.enable_prefix_caching else []
        # start: the decode side's first step computes the position after the prompt
        if bm.allocate_slots(request.request_id, request.num_prompt_tokens, prefix, start=request.num_prompt_tokens) is None:
            return None
        request.num_cached_tokens = len(prefix) * bm.block_size
        request.status = RequestStatus.REMOTE_PREFILL
        self.requests[request.request_id] = request
        self._order[request.request_id] = (request.priority, request.arrival_time, next(self._seq))
        return len(prefix)

    def append_remote_token(self, request_id: str, token_id: int) -> Request | None:
        """The prefill replica's first token. Returns the request if that token finished it (freed)."""
        request = self.remote_request(request_id)
        request.output_token_ids.append(token_id)
        reason = self._check_stop(request)
        if reason is None:
            return None
        self.finish_request(request_id, reason)
        return request

    def activate_remote(self, request_id: str, now: float) -> None:
        """The prompt's KV is installed: the request joins the running batch for its next token."""
        request = self.remote_request(request_id)
        bs = self.block_manager.block_size
        request.num_computed_tokens = request.num_prompt_tokens
        request.block_hashes = hash_blocks(request.all_token_ids, bs, self.salt(request), request.block_hashes)
        if self.config.enable_prefix_caching:
            self.block_manager.cache_blocks(request_id, request.block_hashes[: request.num_prompt_tokens // bs],
                                            request.tenant)
        self._lift(request.tenant)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:  # its wait: until the prompt's KV arrived
            request.first_scheduled_time = now
        self.running.append(request)

    def fallback_to_local(self, request_id: str) -> None:
        """The transfer failed: drop the reserved blocks and compute the request here (its
        tokens so far are kept, as after a preemption)."""
        request = self.remote_request(request_id)
        self.block_manager.free(request_id)
        self._lift(request.tenant)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self._push_waiting(request)

    def release_held(self, request_id: str) -> bool:
        """Free a finished request's held blocks; False if it holds none."""
        if self.held.pop(request_id, None) is None:
            return False
        self.block_manager.free(request_id)
        return True

    def remote_request(self, request_id: str) -> Request:
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.REMOTE_PREFILL:
            raise KeyError(f"{request_id!r} is not awaiting a remote prefill")
        return request

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (abort, stop string): free its blocks and drop it from the queues.
        Samples still waiting to fork from it end with it."""
        pending = self.pending_forks.pop(request_id, None)
        if pending is not None:  # a sample not forked yet: it holds nothing
            for forks in self.forks.values():
                if pending in forks:
                    forks.remove(pending)
            pending.status, pending.finish_reason = RequestStatus.FINISHED, reason
            return pending
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for fork in self.forks.pop(request_id, []):
            self.pending_forks.pop(fork.request_id, None)
            fork.status, fork.finish_reason = RequestStatus.FINISHED, reason
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is not RequestStatus.REMOTE_PREFILL:
            self.waiting.remove(request)
        if request.hold_blocks and reason is not FinishReason.ABORT:
            self.held[request_id] = request
        else:
            self.block_manager.free(request_id)
        self._order.pop(request_id, None)
        if len(self.waiting.counters) > 64:  # forget_idle's floor: skip the O(requests) scan below it
            self.waiting.forget_idle(self.active_tenants())
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        """Work a step can do (requests awaiting a remote prefill are not steppable)."""
        return bool(self.running or self.waiting)

    # ---- one step ------------------------------------------------------------------------
    # the prefill work a step may take beside decoding streams or a short waiting prompt (engine.itl_guard), set by
    # the core before ``schedule``; applied only to a step that has either
    prefill_allowance: PrefillAllowance | None = None
    _allowance: PrefillAllowance | None = None  # this step's, when applied

    @property
    def decoding(self) -> bool:
        """Whether a running request is generating (its next step computes one token)."""
        return any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)

    def schedule(self, now: float) -> SchedulerOutput:
        """The next step. ``now``: the caller's clock (the engine's monotonic time, the simulator's virtual one), when
        a request first scheduled now started (its queue wait ends)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        copies: list[tuple[int, int]] = []
        preempted: list[str] = []
        restores: list[tuple[int, bytes]] = []
        self.running.sort(key=lambda r: self._order[r.request_id])
        owed = self._owed_after(now) if any(r.draft_token_ids for r in self.running) else None
        # long prompts' chunks are held to the allowance while something waits on this step (itl_guard.for_step)
        self._allowance = None if self.prefill_allowance is None else for_step(
            self.prefill_allowance, self.running, self.waiting.requests(), self.decoding,
            room=len(self.running) < self.config.max_num_running)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, request.num_computed_tokens, budget, now)
            if n == 0:  # a long prompt held back this step (the ITL guard): it keeps its blocks
                i += 1
                continue
            allocation, draft = None, ()
            if request.draft_token_ids and n == 1 and owed is not None and request.request_id not in self.forks:
                # proposals take only budget the running requests after this one do not need
                allocation, draft = self._allocate_draft(request, budget - owed[i], len(self.running) - i - 1)
            if allocation is None:
                allocation = self._allocate_or_preempt(request, n, preempted)
            if allocation is None:
                break  # the request itself was preempted; it was the last running one
            copies.extend(allocation.copies)
            scheduled.append(self._entry(request, n + len(draft), draft))
            budget -= n + len(draft)
            self._spend(request, request.num_computed_tokens, n)
            i += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, copies, restores, now)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1 and not s.draft)  # stable: decodes (and verifications) first
        self._allowance = None
        self.num_block_copies += len(copies)
        return SchedulerOutput(tuple(scheduled), tuple(copies), tuple(preempted), tuple(restores))

    def _chunk(self, request: Request, num_computed: int, budget: int, now: float) -> int:
        n = min(request.num_tokens - num_computed, budget)
        if self.config.max_prefill_chunk:
            n = min(n, self.config.max_prefill_chunk)
        if n > 1 and self._allowance is not None and self._allowance.is_long(request.num_tokens - num_computed):
            seconds_left = self._allowance.seconds_left(request.arrival_time, request.num_prompt_tokens, now)
            n = self._allowance.tokens(num_computed, n, request.num_tokens - num_computed, seconds_left)
        return n

    def _spend(self, request: Request, start: int, n: int) -> None:
        """A prompt chunk's work comes off the step's allowance (a long prompt's single token too)."""
        if self._allowance is not None:
            long = self._allowance.is_long(request.num_tokens - start)
            if n > 1 or long:
                self._allowance.spend(start, n, long)

    def _owed_after(self, now: float) -> list[int]:
        """Per running request, the tokens the running requests after it need this step (their decode or prefill
        chunk): what speculation before them must leave in the budget."""
        owed = [0] * len(self.running)
        total = 0
        for i in range(len(self.running) - 1, -1, -1):
            owed[i] = total
            r = self.running[i]
            total += self._chunk(r, r.num_computed_tokens, self.config.max_num_batched_tokens, now)
        return owed

    def _allocate_draft(self, request: Request, budget: int, num_after: int):
        """Slots for a decoding request's last token and its proposed tokens, without preempting anyone and
        leaving a block for each running request after it. (allocation, draft), or (None, ()) to decode plainly."""
        draft, request.draft_token_ids = request.draft_token_ids, []
        k = min(len(draft), budget - 1, request.max_tokens - len(request.output_token_ids) - 1,
                self.config.max_model_len - request.num_tokens - 1)
        if k <= 0:
            return None, ()
        bm = self.block_manager
        end = request.num_computed_tokens + 1 + k
        if bm.blocks_needed(request.request_id, end) + num_after > bm.num_free_blocks:
            return None, ()
        allocation = bm.allocate_slots(request.request_id, end, start=request.num_computed_tokens)
        return (allocation, tuple(draft[:k])) if allocation is not None else (None, ())

    def _allocate_or_preempt(self, request: Request, n: int, preempted: list[str]):
        while True:
            allocation = self.block_manager.allocate_slots(request.request_id, request.num_computed_tokens + n,
                                                           start=request.num_computed_tokens)
            if allocation is not None:
                return allocation
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest], copies: list,
                       restores: list[tuple[int, bytes]], now: float) -> int:
        bm, bs = self.block_manager, self.block_manager.block_size
        held_back: set[str] = set()  # long prompts the ITL guard holds back this step: those behind them go ahead
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_running:
            request = self.waiting.peek(held_back)
            if request is None:
                break
            samples = len(self.forks.get(request.request_id, ()))
            if samples and self.running and len(self.running) + 1 + samples > self.config.max_num_running:
                break  # its samples join the batch when forked: admit it when they fit (alone: always)
            prefix: list[int] = []
            held = 0  # blocks past the pool's hit that the second tier holds
            if self.config.enable_prefix_caching and request.sampling_params.prompt_logprobs is None:
                # Always leave at least one token to compute: its logits are needed. (Prompt
                # logprobs need every prompt position's logits: no hits.)
                limit = (request.num_tokens - 1) // bs
                prefix = bm.match_prefix(request.block_hashes[:limit])
                if self.second_tier is not None and len(prefix) < limit:
                    held = self.second_tier.held_run(request.block_hashes[len(prefix): limit])
            computed = (len(prefix) + held) * bs
            n = self._chunk(request, computed, budget, now)
            if n == 0:
                held_back.add(request.request_id)
                continue
            allocation = bm.allocate_slots(request.request_id, computed + n, prefix, start=computed)
            if allocation is None:
                break  # nothing read from the tier: a request that waits for blocks costs no I/O per step
            if held:  # the blocks after the pool's hit are fresh: the tier's bytes go there before the forward
                assert self.second_tier is not None
                tier = self.second_tier.fetch_chain(request.block_hashes[len(prefix): len(prefix) + held])
                if len(tier) < held:  # a record failed verification: compute from there, within the slots held
                    slots = computed + n
                    computed = (len(prefix) + len(tier)) * bs
                    n = min(self._chunk(request, computed, budget, now), slots - computed)
                restores.extend(zip(bm.block_table(request.request_id)[len(prefix):], tier))
            self.waiting.remove(request)
            if request.num_preemptions == 0:
                request.num_cached_tokens = min(computed, request.num_prompt_tokens)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.num_computed_tokens = computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            copies.extend(allocation.copies)
            scheduled.append(self._entry(request, n))
            budget -= n
            self._spend(request, computed, n)
        return budget

    def _entry(self, request: Request, n: int, draft: tuple[int, ...] = ()) -> ScheduledRequest:
        """The step's entry for ``request``; its tenant is charged for the prompt tokens it
        computes now (when scheduled, so later admissions of this step see the charge; prefix
        cache hits are not computed, hence free)."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + n
        num_prompt = len(request.prompt_token_ids)
        if start < num_prompt:
            self.waiting.charge(request.tenant, prompt_tokens=min(end, num_prompt) - start)
        samples = end - len(draft) == num_prompt + len(request.output_token_ids)
        forks = self.forks.get(request.request_id) if samples else None
        tables = self.block_manager.block_tables(request.request_id)
        return ScheduledRequest(request.request_id, start, n, tuple(tables[0]), samples,
                                tuple(f.request_id for f in forks) if forks else (),
                                tuple(tuple(t) for t in tables[1:]), draft)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        self.waiting.push(request, self._order[request.request_id], resumed=request.status is RequestStatus.PREEMPTED)

    # ---- after the forward -----------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int],
               accepted: Mapping[str, Sequence[int]] | None = None) -> list[Request]:
        """Advance computed counts, append sampled tokens, apply token-level stops.

        ``sampled`` maps request id -> token for entries with ``samples``; ``accepted``, for verification
        entries, the tokens after it (the accepted proposals past the first, then the sampler's own), so
        those requests take 1 + len(accepted[id]) tokens. Returns the requests that finished in this step
        (already removed, blocks freed).
        """
        bs = self.block_manager.block_size
        finished = []
        self.appended.clear()
        for entry in output.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            more = (accepted or {}).get(entry.request_id, ()) if entry.draft else ()
            # the KV of the last token and of the accepted proposals is valid; the rejected positions' is not
            request.num_computed_tokens += entry.num_new_tokens - len(entry.draft) + len(more)
            completed_block = request.num_computed_tokens // bs != entry.start // bs
            if entry.samples:
                tokens = [sampled[entry.request_id], *more]
                appended = 0
                for token in tokens:
                    request.output_token_ids.append(token)
                    appended += 1
                    if appended < len(tokens) and self._check_stop(request, grammar=False) is not None:
                        break  # EOS, a stop id or the length inside the accepted run: the rest is dropped
                self.waiting.charge(request.tenant, output_tokens=appended)
                if entry.draft:
                    self.appended[entry.request_id] = appended
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                if request.num_tokens // bs > len(request.block_hashes):
                    request.block_hashes = hash_blocks(
                        request.all_token_ids, bs, self.salt(request), request.block_hashes
                    )
            if self.config.enable_prefix_caching and completed_block:  # else no new full block to record
                self.block_manager.cache_blocks(
                    entry.request_id, request.block_hashes[: request.num_computed_tokens // bs], request.tenant
                )
            if entry.forks:
                finished.extend(self._fork(request, entry.forks, sampled))
            reason = self._check_stop(request) if entry.samples else None
            if reason is not None:
                self.finish_request(entry.request_id, reason)
                finished.append(request)
            elif entry.draft:
                self.block_manager.trim(entry.request_id, request.num_tokens)
        return finished

    def _fork(self, parent: Request, fork_ids: Sequence[str], sampled: Mapping[str, int]) -> list[Request]:
        """The parent's prompt is computed: its pending samples take its blocks (shared; the
        partial last block is copied when one of them first writes to it) and their own first
        token. Returns those that finished with it."""
        bs = self.block_manager.block_size
        finished = []
        for fork_id in fork_ids:
            fork = self.pending_forks.pop(fork_id)
            self.forks[parent.request_id].remove(fork)
            self.block_manager.fork(parent.request_id, fork_id)
            self.num_forks += 1
            self.num_fork_shared_blocks += len(self.block_manager.block_table(fork_id))
            fork.num_computed_tokens = parent.num_prompt_tokens
            fork.num_cached_tokens = parent.num_cached_tokens
            fork.output_token_ids.append(sampled[fork_id])
            fork.block_hashes = hash_blocks(fork.all_token_ids, bs, self.salt(fork),
                                            parent.block_hashes[: parent.num_prompt_tokens // bs])
            fork.status = RequestStatus.RUNNING
            self.requests[fork_id] = fork
            self._order[fork_id] = (fork.priority, fork.arrival_time, next(self._seq))
            self.running.append(fork)
            self.waiting.charge(fork.tenant, output_tokens=1)
            reason = self._check_stop(fork)
            if reason is not None:
                self.finish_request(fork_id, reason)
                finished.append(fork)
        if not self.forks[parent.request_id]:
            del self.forks[parent.request_id]
        return finished

    def _check_stop(self, request: Request, grammar: bool = True) -> FinishReason | None:
        """Why ``request`` ends after its last token, or None. ``grammar=False``: not the grammar's state (the
        matcher has consumed a whole accepted run; it is checked after its last token)."""
        params = request.sampling_params
        if grammar and request.guide is not None and (request.guide.is_stopped() or request.guide.is_error()):
            return FinishReason.STOP  # the grammar is complete (or cannot continue)
        num_output = len(request.output_token_ids)
        token = request.output_token_ids[-1]
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                return FinishReason.STOP
        if num_output >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None
