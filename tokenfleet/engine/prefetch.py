"""Prefetch: while a client runs its tool, bring a retained conversation's blocks that the pool demoted to the
second tier back into the pool, so its next turn is a pool hit instead of a restore on the admission's path.

Only conversations that still hold the pool's priority come back (``Retention.pool_pins_newest_first``): one
retained for a day that has been idle past the worker's pool window stays in the tier, ranked above unretained
entries, until its next turn restores it at admission.

Off the critical path by construction: it runs between steps (the engine thread, ``EngineCore.tend``), only
when no request waits, a bounded number of blocks per call, and only into room the plain LRU leaves beyond a
reserve for the running requests and the next arrivals (``prefetch_room``). It takes free or plain cached
blocks, never a retained one (``BlockManager.adopt``), and installs the tier's bytes with the same runner call
a restore at admission uses (``TierRunner.import_blocks``). Adopted blocks are ordinary cached blocks: a
request that needs the room evicts them like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.kv_tier import SecondTier
from tokenfleet.engine.retention import Pin
from tokenfleet.engine.runner import TierRunner

PREFETCH_BLOCKS = 32  # per call: one bounded read from the tier between two steps


def prefetch_room(plain_free: int, capacity: int, num_running: int) -> int:
    """Blocks a prefetch may take now: what the free list and the plain LRU hold beyond a reserve (a quarter
    of the pool, and a block per running request) that running requests grow into and new ones arrive to."""
    return max(0, plain_free - capacity // 4 - num_running)


def prefetch_plan(pins: Iterable[Pin], in_pool: Container[bytes], in_tier: Container[bytes],
                  limit: int) -> list[tuple[bytes, str]]:
    """Up to ``limit`` (hash, owner) to bring back, newest pin first: per pin, along its chain, the hashes the
    pool lacks and the tier holds, up to the first hash neither has (a block after a gap is no prefix hit)."""
    plan: list[tuple[bytes, str]] = []
    planned: set[bytes] = set()
    for pin in pins:
        for h in pin.hashes:
            if len(plan) >= limit:
                return plan
            if h in in_pool or h in planned:
                continue
            if h not in in_tier:
                break
            plan.append((h, pin.owner))
            planned.add(h)
    return plan


class Prefetcher:
    """Brings retained blocks back from ``tier`` into ``block_manager``'s pool through ``blocks`` (engine
    thread). Remembers when it last found nothing to do, so an idle engine's loop costs a comparison."""

    def __init__(self, block_manager: BlockManager, tier: SecondTier, blocks: TierRunner,
                 batch: int = PREFETCH_BLOCKS):
        self.block_manager = block_manager
        self.tier = tier
        self.blocks = blocks
        self.batch = batch
        self.num_prefetched = 0
        self._idle_at: tuple[int, ...] | None = None  # versions and room of the last call that found nothing

    def run(self, num_waiting: int, num_running: int, offload: Callable[[], None]) -> int:
        """One bounded batch; returns the blocks brought back (a full batch: call again soon). ``offload``: copies
        the plain cached blocks the adoption evicted into the tier before their blocks are written."""
        bm = self.block_manager
        if num_waiting or not bm.retention.num_pool_pins:
            return 0
        limit = min(prefetch_room(bm.num_plain_free_blocks, bm.capacity, num_running), self.batch)
        state = (bm.hash_version, bm.retention.version, self.tier.version, limit)
        if not limit or state == self._idle_at:
            return 0
        plan = prefetch_plan(bm.retention.pool_pins_newest_first(), bm.cached_hash_view(), self.tier, limit)
        payloads = {}
        for h, _ in plan:
            got = self.tier.fetch_chain([h])
            if got:
                payloads[h] = got[0]
        adopted = bm.adopt([(h, owner) for h, owner in plan if h in payloads])
        if not adopted:
            self._idle_at = state
            return 0
        offload()
        self.blocks.import_blocks([(block, payloads[h]) for block, h in adopted])
        self.num_prefetched += len(adopted)
        return len(adopted)
