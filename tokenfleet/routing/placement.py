"""The whole placement decision, pure: which decode replica, whether a separate prefill
replica computes the prompt, and whether the prefix's affinity entry must be written.

Inputs are what a router knows: the fleet snapshot, the prompt's block-hash chain, the block
hashes each replica reports, and the affinity map's homes of the prompt's anchor (the hash of
its ``min_match_blocks``-th block, ``affinity/<model>/<anchor>`` in etcd). A home counts as
holding the anchor's blocks even before the replica has reported them, so a burst of one new
prefix and a freshly restarted router both follow the recorded assignment.

A request that continues a conversation (``ConversationHome``: the replica that served its last turn) stays
there while that replica is serving and within the same load bound that limits prefix affinity, whatever the
other replicas report: the home retains the transcript's blocks (in its pool or demoted to its second tier)
and may not have reported them yet, so block hashes alone undercount it. An overloaded, draining, excluded or
vanished home is left for the prefix-aware choice.

Disaggregation is conditional: a replica with the prefill role prefills its own requests; a
decode-only replica gets a separate prefill replica only when the prompt has at least
``min_uncached_tokens`` tokens it does not hold already (short prompts and mostly cached
prompts are cheaper to prefill locally, in chunks, than to ship).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.kvcache.layout import KVLayout
from tokenfleet.kvcache.salt import chain_salt
from tokenfleet.routing.policies import FleetSnapshot, ReplicaLoad, RoundRobin, least_loaded
from tokenfleet.routing.prefix import (
    DEFAULT_PREFIX_CONFIG,
    PrefixPolicyConfig,
    matched_prefix,
    overloaded,
    prefix_aware,
)

PREFIX_AWARE, LEAST_LOADED, ROUND_ROBIN = "prefix-aware", "least-loaded", "round-robin"
POLICIES = (PREFIX_AWARE, LEAST_LOADED, ROUND_ROBIN)
# What a placement did with a conversation's home (Placement.conversation; "" when it had none)
FOLLOWED, LEFT_OVERLOADED, LEFT_UNAVAILABLE = "followed", "left_overloaded", "left_unavailable"


@dataclass(frozen=True)
class DisaggConfig:
    # Measured with benchmarks/kv_transfer.py (benchmarks/reports/2026-11-22-cpu-kv-transfer.md):
    # the remote path adds 10-100 ms to a request's second token (two RPC hops, the transfer, the
    # install), while a local prefill costs the decode worker ~1.6-2 ms per token of compute that
    # stalls its running streams (210 ms at 128 tokens). From ~128 tokens that stall outweighs the
    # transfer; below it the remote path's fixed cost is a large share of a short prompt's latency.
    min_uncached_tokens: int = 128


DEFAULT_DISAGG_CONFIG = DisaggConfig()


@dataclass(frozen=True)
class Placement:
    decode: ReplicaLoad
    prefill: ReplicaLoad | None  # None: the decode replica prefills locally
    matched_blocks: int  # leading prompt blocks the decode replica holds (reported or by affinity)
    anchor: bytes | None  # the prompt's affinity key, when it is long enough to have one
    record_home: bool  # write decode.replica_id into the anchor's homes (a new assignment or a spill)
    conversation: str = ""  # FOLLOWED, LEFT_OVERLOADED or LEFT_UNAVAILABLE when the query named a home, else ""


@dataclass(frozen=True)
class ConversationHome:
    """The replica that served a conversation's last turn, and what it is known to hold of the transcript: the
    last turn's prompt was ``num_blocks`` blocks long, the last of them hashing to ``last_block_hash``. The chain
    hash covers every block before it, so a new prompt whose block ``num_blocks - 1`` has that hash starts with
    the whole of the last turn's prompt (the transcript only grew), which the home retains."""

    replica_id: str
    num_blocks: int = 0
    last_block_hash: bytes | None = None

    @classmethod
    def of(cls, replica_id: str, chain: Sequence[bytes]) -> ConversationHome:
        """The home a turn with prompt ``chain`` leaves behind on ``replica_id``."""
        return cls(replica_id, len(chain), chain[-1] if chain else None)

    def held_blocks(self, chain: Sequence[bytes]) -> int:
        """Leading blocks of ``chain`` the home holds from the last turn (0 when the transcript was rewritten)."""
        n = self.num_blocks
        return n if 0 < n <= len(chain) and chain[n - 1] == self.last_block_hash else 0


def anchor_of(chain: Sequence[bytes], config: PrefixPolicyConfig) -> bytes | None:
    """The affinity key of a prompt: the hash of its ``min_match_blocks``-th block."""
    return chain[config.min_match_blocks - 1] if len(chain) >= config.min_match_blocks else None


class _WithHead(Collection[bytes]):
    """A replica's reported hashes plus a prefix's leading blocks, without copying the reported set
    (a replica reports ~10^5 hashes; a pick only tests a prompt's few hundred)."""

    def __init__(self, head: frozenset[bytes], reported: Collection[bytes]):
        self.head, self.reported = head, reported

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.head or block_hash in self.reported

    def __iter__(self) -> Iterator[bytes]:
        yield from self.head
        yield from (h for h in self.reported if h not in self.head)

    def __len__(self) -> int:
        return len(self.head) + sum(1 for h in self.reported if h not in self.head)


def with_affinity(cached: Mapping[str, Collection[bytes]], chain: Sequence[bytes], homes: Collection[str],
                  config: PrefixPolicyConfig) -> dict[str, Collection[bytes]]:
    """Reported hashes plus, for the anchor's homes, the anchor's leading blocks."""
    head = frozenset(chain[: config.min_match_blocks])
    merged: dict[str, Collection[bytes]] = dict(cached)
    for replica_id in homes:
        merged[replica_id] = _WithHead(head, cached.get(replica_id, ()))
    return merged


@dataclass(frozen=True)
class PlacementQuery:
    """Everything one placement decision reads. ``homes``: the affinity map's homes of the prompt's anchor.
    ``homes_count``: prefixes homed on each replica (the affinity map), to spread new prefixes over the pool.
    ``tiered``: of each replica's reported hashes, those only in its second tier (worth less than pool blocks)."""

    snapshot: FleetSnapshot
    chain: Sequence[bytes]
    cached: Mapping[str, Collection[bytes]]
    homes: Collection[str]
    num_prompt_tokens: int
    block_size: int
    policy: str = PREFIX_AWARE
    round_robin: RoundRobin | None = None
    prefix_config: PrefixPolicyConfig = DEFAULT_PREFIX_CONFIG
    disagg: DisaggConfig = DEFAULT_DISAGG_CONFIG
    colocated: bool = False
    homes_count: Mapping[str, int] | None = None
    tiered: Mapping[str, Collection[bytes]] | None = None
    conversation: ConversationHome | None = None  # the request continues a conversation served there last


def conversation_replica(snapshot: FleetSnapshot, home: ConversationHome, config: PrefixPolicyConfig,
                         chain: Sequence[bytes] = ()) -> tuple[ReplicaLoad | None, str]:
    """The home's replica when the request may stay on it (FOLLOWED), else None and why it leaves: not a serving
    decode replica of this snapshot (draining, excluded, gone, another model's) or above the load bound that
    limits prefix affinity (``prefix.overloaded``: the spill floor and the slack over the pool's mean), its slack
    widened by what leaving costs (``conversation_slack``)."""
    candidates = snapshot.candidates("decode")
    replica = next((r for r in candidates if r.replica_id == home.replica_id), None)
    if replica is None:
        return None, LEFT_UNAVAILABLE
    if overloaded(replica, candidates, conversation_slack(config, home.held_blocks(chain), len(chain))):
        return None, LEFT_OVERLOADED
    return replica, FOLLOWED


def conversation_slack(config: PrefixPolicyConfig, held_blocks: int, num_blocks: int) -> PrefixPolicyConfig:
    """The load bound for staying on a conversation's home: a turn that leaves recomputes the transcript the home
    holds (``held_blocks`` of the prompt's ``num_blocks``) to save the wait for its new blocks, so the slack over
    the mean grows with held / new: ``load_slack x (1 + held / new)``. A turn that adds 2 blocks to 8 held stays
    up to 2.25x the mean at the default slack (measured on two CPU workers: with the plain 1.25x, 5-25 % of a
    tool-calling workload's turns left a home that held 90 % of their prompt and recomputed it)."""
    if held_blocks <= 0:
        return config
    new = max(1, num_blocks - held_blocks)
    return dataclasses.replace(config, load_slack=config.load_slack * (1 + held_blocks / new))


def place(query: PlacementQuery) -> Placement:
    """Raises NoReplicaError when no decode replica is serving. A conversation's home is followed only under the
    prefix-aware policy (the baselines ignore what replicas hold)."""
    q = query
    snapshot, chain, cached, homes, prefix_config = q.snapshot, q.chain, q.cached, q.homes, q.prefix_config
    policy, homes_count, tiered = q.policy, q.homes_count, q.tiered
    anchor = anchor_of(chain, prefix_config)
    known = with_affinity(cached, chain, homes if anchor is not None else (), prefix_config)
    conversation = q.conversation if policy == PREFIX_AWARE else None
    home, outcome = None, ""
    if conversation is not None:
        home, outcome = conversation_replica(snapshot, conversation, prefix_config, chain)
    if conversation is not None and home is not None:  # it holds what it was reported to and the last turn's prompt
        held = frozenset(chain[: conversation.held_blocks(chain)])
        known[home.replica_id] = _WithHead(held, known.get(home.replica_id, ()))
        decode = home
    elif policy == PREFIX_AWARE:
        decode = prefix_aware(snapshot, chain, known, prefix_config, homes_count=homes_count, tiered=tiered).replica
    elif policy == ROUND_ROBIN:
        decode = (q.round_robin or RoundRobin()).pick(snapshot)
    else:
        decode = least_loaded(snapshot)
    matched = matched_prefix(chain, known.get(decode.replica_id, ()))
    prefill = None
    if not q.colocated:
        prefill = choose_prefill(snapshot, decode, chain, known, q.num_prompt_tokens - matched * q.block_size,
                                 prefix_config, q.disagg, tiered)
    record = anchor is not None and decode.replica_id not in homes
    return Placement(decode, prefill, matched, anchor, record, outcome)


def choose_prefill(snapshot: FleetSnapshot, decode: ReplicaLoad, chain: Sequence[bytes],
                   cached: Mapping[str, Collection[bytes]], uncached_tokens: int,
                   prefix_config: PrefixPolicyConfig, disagg: DisaggConfig,
                   tiered: Mapping[str, Collection[bytes]] | None = None) -> ReplicaLoad | None:
    if "prefill" in decode.roles or uncached_tokens < disagg.min_uncached_tokens:
        return None
    others = FleetSnapshot(tuple(r for r in snapshot.replicas if r.replica_id != decode.replica_id))
    if not others.candidates("prefill"):
        return None
    return prefix_aware(others, chain, cached, prefix_config, role="prefill", tiered=tiered).replica


def live_homes(homes: Sequence[str], live: Collection[str], new: str) -> tuple[str, ...]:
    """The anchor's homes after placing on ``new``: dead replicas dropped, ``new`` added last."""
    return tuple(h for h in homes if h in live and h != new) + (new,)


def prefix_peer(snapshot: FleetSnapshot, chain: Sequence[bytes], cached: Mapping[str, Collection[bytes]],
                chosen: str, chosen_blocks: int, min_blocks: int) -> tuple[ReplicaLoad, int] | None:
    """Another replica (serving or draining: a draining one still sends blocks) that reports at least
    ``min_blocks`` more of the prompt's leading blocks than the chosen one, and how many it holds: the
    chosen replica fetches them from it instead of recomputing (peer fetch). None when there is none."""
    best: tuple[ReplicaLoad, int] | None = None
    for replica in snapshot.replicas:
        if replica.replica_id == chosen:
            continue
        n = matched_prefix(chain, cached.get(replica.replica_id, ()))
        if n - chosen_blocks >= min_blocks and (best is None or n > best[1]):
            best = (replica, n)
    return best


@dataclass(frozen=True)
class Route:
    """A router's whole answer for one request (``route``)."""

    placement: Placement
    cached_prompt_tokens: int  # of the prompt, held by the decode replica (reported or by affinity)
    peer: tuple[ReplicaLoad, int] | None  # a replica holding more of the prompt's leading blocks, and how many


def prompt_chain(prompt: Sequence[int], layout: KVLayout | None, cache_scope: str) -> list[bytes]:
    """The prompt's block-hash chain as the replicas of ``layout`` hash it for ``cache_scope`` ([] without a layout)."""
    if not prompt or layout is None:
        return []
    return hash_blocks(list(prompt), layout.block_size, chain_salt(layout.hash_salt, cache_scope))


def route(query: PlacementQuery, peer_min_blocks: int | None) -> Route:
    """``place`` and what the response says besides: the prompt tokens the chosen replica holds and, when
    ``peer_min_blocks`` is set (peer fetch on, a placement that may move blocks), a peer the replica computing the
    prompt can fetch its prefix from. Raises NoReplicaError when no decode replica is serving."""
    placement = place(query)
    cached_tokens = min(placement.matched_blocks * query.block_size, query.num_prompt_tokens)
    peer = None
    if query.chain and peer_min_blocks is not None:
        computes = placement.prefill or placement.decode  # the replica that computes the prompt
        held = matched_prefix(query.chain, query.cached.get(computes.replica_id, ()))
        peer = prefix_peer(query.snapshot, query.chain, query.cached, computes.replica_id, held, peer_min_blocks)
    return Route(placement, cached_tokens, peer)
