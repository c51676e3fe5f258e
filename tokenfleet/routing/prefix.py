"""Prefix-aware placement with bounded load: a pure function over a fleet snapshot.

A request's prompt is a chain of block hashes (tokenfleet.kvcache.block_hash, the engine's own
hashing). Each replica is known to hold some of those blocks: the hashes it reports and the
affinity map's homes of this prefix (``affinity/<model>/<prefix_hash>``, kept in etcd by the
routers). The policy prefers the replica that would reuse the longest cached prefix, but only
while its load stays within a bound relative to the pool ("consistent hashing with bounded
loads"): once its load exceeds ``(1 + load_slack)`` x the pool's mean (and is at least
``spill_floor`` requests, so an almost idle fleet keeps its affinity) it spills to the least
loaded replica, and the caller records that replica as a second home of the prefix.

Blocks are not all worth the same: one in a replica's pool is free, one in its second tier must be
restored (``tier_block_value`` of a pool block: a disk read and a copy instead of a prefill), and one a
peer holds can be fetched by whichever replica is picked (``peer_block_value``; 0 when peer fetch is
off). A replica's reuse value is its pool blocks + tier_block_value x its tier blocks + peer_block_value
x the blocks past its own run that the best peer holds, so a replica holding a long prefix on disk can
lose to an idle one when the peer fetch is almost as good.

Short matches do not pin traffic: below ``min_match_blocks`` the prefix is ignored and the
request goes to the least-loaded replica, so one short system prompt shared by every tenant
does not send all traffic to one replica. A burst of same-prefix requests is not herded onto
one replica because the router's own pending assignments count as load.

The router (services/router) calls it through tokenfleet.routing.placement with the hashes
workers report in their load streams and the etcd affinity map (tokenfleet.cluster.affinity).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tokenfleet.routing.policies import FleetSnapshot, NoReplicaError, ReplicaLoad


@dataclass(frozen=True)
class PrefixPolicyConfig:
    min_match_blocks: int = 4  # matches shorter than this are ignored (4 blocks = 64 tokens at block size 16)
    load_slack: float = 0.25  # epsilon of the bound: stay affine up to (1 + eps) x the pool's mean load
    spill_floor: int = 4  # a replica with fewer requests than this is never too loaded to stay affine
    # A block's worth relative to one in the pool (1 = free, 0 = a recompute). Defaults from
    # benchmarks/reports/2026-11-25-cpu-kv-tier*.md (SmolLM2 on CPU): a disk restore ~1 ms a block,
    # a peer fetch over loopback ~2-4 ms, against ~25 ms to prefill 16 tokens.
    tier_block_value: float = 0.9
    peer_block_value: float = 0.8  # 0: peer fetch off (the router's --no-peer-fetch)
    # A peer is named when it holds at least this many more leading blocks than the picked replica: one
    # block's prefill (~25 ms for 16 tokens on CPU) already outweighs a fetch's round trip (~2 ms).
    peer_min_blocks: int = 1

    def __post_init__(self) -> None:
        if self.min_match_blocks < 1:
            raise ValueError("min_match_blocks must be >= 1")
        if self.load_slack < 0:
            raise ValueError("load_slack must be >= 0")
        if self.spill_floor < 0:
            raise ValueError("spill_floor must be >= 0")
        if self.peer_min_blocks < 1:
            raise ValueError("peer_min_blocks must be >= 1")
        if not (0 <= self.tier_block_value <= 1 and 0 <= self.peer_block_value <= 1):
            raise ValueError("tier_block_value and peer_block_value must be within [0, 1]")


DEFAULT_PREFIX_CONFIG = PrefixPolicyConfig()


@dataclass(frozen=True)
class PrefixPlacement:
    replica: ReplicaLoad
    matched_blocks: int  # leading prompt blocks the chosen replica already holds
    spilled: bool  # an affine replica existed but was over the bound: record a new home


def matched_prefix(block_hashes: Sequence[bytes], cached: Collection[bytes]) -> int:
    """How many leading blocks of the prompt are in ``cached`` (a prefix match: stops at the first miss)."""
    n = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        n += 1
    return n


def reuse_value(block_hashes: Sequence[bytes], run: int, tiered: Collection[bytes], best_run: int,
                config: PrefixPolicyConfig) -> float:
    """What a replica holding the prompt's first ``run`` blocks (``tiered``: those only in its second tier)
    saves, in pool blocks, when the best holder in the fleet has ``best_run`` of them (fetchable)."""
    slow = sum(1 for h in block_hashes[:run] if h in tiered)  # never bool(tiered): a live view may count by iterating
    fetchable = best_run - run if best_run - run >= config.peer_min_blocks else 0  # what a named peer would send
    return run - slow * (1 - config.tier_block_value) + config.peer_block_value * fetchable


def overloaded(replica: ReplicaLoad, candidates: Sequence[ReplicaLoad], config: PrefixPolicyConfig) -> bool:
    """Too loaded to take another request for affinity's sake: above (1 + eps) x the mean and the floor."""
    mean = sum(r.effective_load for r in candidates) / len(candidates)
    load = replica.effective_load
    return load >= config.spill_floor and load > (1 + config.load_slack) * mean


def prefix_aware(
    snapshot: FleetSnapshot,
    block_hashes: Sequence[bytes],
    cached: Mapping[str, Collection[bytes]],
    config: PrefixPolicyConfig = PrefixPolicyConfig(),
    role: str = "decode",
    homes_count: Mapping[str, int] | None = None,
    tiered: Mapping[str, Collection[bytes]] | None = None,
) -> PrefixPlacement:
    """Pick a replica for a prompt with ``block_hashes``; ``cached`` maps replica id -> block hashes it holds,
    ``tiered`` replica id -> those of them only in its second tier.

    ``homes_count`` (replica id -> prefixes whose home it is): a new prefix, long enough to be
    worth a home, goes to the replica with the fewest homes among those within the load bound,
    so prefixes spread over the pool's caches instead of piling onto the lowest id."""
    candidates = snapshot.candidates(role)
    if not candidates:
        raise NoReplicaError(f"no serving replica with role {role!r}")
    matches = {r.replica_id: matched_prefix(block_hashes, cached.get(r.replica_id, ())) for r in candidates}
    affine = [r for r in candidates if matches[r.replica_id] >= config.min_match_blocks]
    within = [r for r in affine if not overloaded(r, candidates, config)]
    if within:  # most reuse first; among equal values the less loaded
        holders = [matched_prefix(block_hashes, cached.get(r.replica_id, ())) for r in snapshot.replicas]
        best_run = max(holders, default=0)  # draining replicas too: they still send blocks
        value = {r.replica_id: reuse_value(block_hashes, matches[r.replica_id], (tiered or {}).get(r.replica_id, ()),
                                           best_run, config) for r in within}
        best = min(within, key=lambda r: (-value[r.replica_id], r.effective_load, r.replica_id))
        return PrefixPlacement(best, matches[best.replica_id], spilled=False)
    if not affine and homes_count is not None and len(block_hashes) >= config.min_match_blocks:
        bounded = [r for r in candidates if not overloaded(r, candidates, config)] or candidates
        chosen = min(bounded, key=lambda r: (homes_count.get(r.replica_id, 0), r.effective_load, r.replica_id))
        return PrefixPlacement(chosen, matches[chosen.replica_id], spilled=False)
    chosen = min(candidates, key=lambda r: (r.effective_load, r.kv_utilization, r.replica_id))
    return PrefixPlacement(chosen, matches[chosen.replica_id], spilled=bool(affine) and chosen not in affine)
