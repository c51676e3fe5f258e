"""The simulated cell's parts: its configuration (``FleetConfig``), a replica (``SimReplica``: the engine's own
``Scheduler`` over a ``BlockManager``, and a second KV tier as hashes), and what the client side records of a
request (``Track``). ``sim.Simulator`` moves them through time."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
from tokenfleet.planning.workload import Arrival
from tokenfleet.routing.placement import POLICIES, PREFIX_AWARE, DisaggConfig
from tokenfleet.routing.policies import ReplicaLoad
from tokenfleet.routing.prefix import PrefixPolicyConfig


@dataclass(frozen=True)
class FleetConfig:
    """One cell: colocated replicas (``prefill_replicas == 0``) or a prefill pool and a decode pool."""

    replicas: int = 8  # colocated replicas, or the decode pool's size
    prefill_replicas: int = 0
    gpus_per_replica: int = 8
    num_blocks: int = 100_000  # KV capacity of one replica, in blocks
    block_size: int = 32
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_num_batched_tokens=2048,
                                                                               max_num_running=1024,
                                                                               max_num_waiting=100_000,
                                                                               max_model_len=32_768))
    policy: str = PREFIX_AWARE
    prefix: PrefixPolicyConfig = field(default_factory=PrefixPolicyConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    kv_bytes_per_token: float = 163_840.0  # what a transfer moves per uncached prompt token (full-context layers)
    # a model with sliding-window layers: their window (step shapes count their work too) and their
    # KV per token, which a transfer moves for the last ``sliding_window`` uncached prompt tokens only
    sliding_window: int | None = None
    window_kv_bytes_per_token: float = 0.0
    link_bytes_per_s: float = 50e9  # prefill -> decode, effective, per transfer
    link_latency_s: float = 0.001
    hop_seconds: float = 0.002  # gateway + router + worker RPCs before a request reaches its replica
    report_interval_s: float = 0.2  # load reports to the router (services/router: 200 ms)
    tier_blocks: int = 0  # a second KV tier per replica (host memory), in blocks; 0: none
    tier_bytes_per_s: float = 100e9  # restoring from it into the pool (host -> all of a replica's GPUs)
    peer_fetch: bool = False  # pull a prompt's leading blocks from the replica holding the most of them

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.prefill_replicas < 0 or self.gpus_per_replica < 1:
            raise ValueError(f"invalid fleet: {self.replicas} replicas, {self.prefill_replicas} prefill")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.link_bytes_per_s <= 0 or self.report_interval_s <= 0:
            raise ValueError("link bandwidth and report interval must be positive")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.tier_blocks < 0 or self.tier_bytes_per_s <= 0:
            raise ValueError("tier_blocks must be >= 0 and tier_bytes_per_s positive")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def num_gpus(self) -> int:
        return (self.replicas + self.prefill_replicas) * self.gpus_per_replica

    def transfer_bytes(self, num_tokens: int) -> float:
        """KV a decode replica lacking the prompt's last ``num_tokens`` tokens is sent: all of them in
        full-context layers; in sliding-window layers only those the window still covers."""
        local = num_tokens if self.sliding_window is None else min(num_tokens, self.sliding_window)
        return num_tokens * self.kv_bytes_per_token + local * self.window_kv_bytes_per_token


class SimTier:
    """A replica's second KV tier as the scheduler sees it (``PrefixTier``): block hashes, LRU, no bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0

    def offer(self, block_hash: bytes) -> None:
        self.blocks[block_hash] = None
        self.blocks.move_to_end(block_hash)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def held_run(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.blocks:
            n += 1
        return n

    def fetch_chain(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        n = self.held_run(block_hashes)
        for h in block_hashes[:n]:
            self.blocks.move_to_end(h)
        self.hits += n
        return [b""] * n


class _Held(Collection[bytes]):
    """A replica's blocks as its load reports say: the pool's and the tier's (``tier_only``: the tier's
    that are not in the pool), live views, never copied."""

    def __init__(self, pool: Collection[bytes], tier: Collection[bytes], tier_only: bool = False):
        self.pool, self.tier, self.tier_only = pool, tier, tier_only

    def __contains__(self, block_hash: object) -> bool:
        if self.tier_only:
            return block_hash in self.tier and block_hash not in self.pool
        return block_hash in self.pool or block_hash in self.tier

    def __iter__(self) -> Iterator[bytes]:
        if not self.tier_only:
            yield from self.pool
        yield from (h for h in self.tier if h not in self.pool)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class SimReplica:
    def __init__(self, replica_id: str, roles: tuple[str, ...], config: FleetConfig, salt: str):
        self.replica_id, self.roles = replica_id, roles
        self.scheduler = Scheduler(config.scheduler, BlockManager(config.num_blocks, config.block_size), salt)
        self.tier = SimTier(config.tier_blocks) if config.tier_blocks else None
        if self.tier is not None:
            self.scheduler.block_manager.track_evictions = True
            self.scheduler.second_tier = self.tier
        self.busy = False
        self.state = "serving"  # "draining": the autoscaler retires it (no new picks; removed once idle)
        self.busy_seconds = 0.0  # inside the window
        self.steps = self.rows = self.tokens = self.pairs = self.window_pairs = 0  # inside the window
        self.kv_samples: list[float] = []

    def offload_evicted(self) -> None:
        for _, block_hash, _ in self.scheduler.block_manager.take_evicted():
            if self.tier is not None:
                self.tier.offer(block_hash)

    def held(self) -> Collection[bytes]:
        pool = self.scheduler.block_manager.cached_hash_view()
        return pool if self.tier is None else _Held(pool, self.tier.blocks.keys())

    def tier_only(self) -> Collection[bytes]:
        """The tier's blocks that are not in the pool (a replica with a tier)."""
        assert self.tier is not None
        return _Held(self.scheduler.block_manager.cached_hash_view(), self.tier.blocks.keys(), tier_only=True)

    def load(self, prefill_tokens_per_s: float = 0.0) -> ReplicaLoad:
        """Its load report; with ``prefill_tokens_per_s``, also a newcomer's predicted wait before its prefill
        starts (prompt tokens queued over that rate, as the engine's load report counts them)."""
        s, bm = self.scheduler, self.scheduler.block_manager
        wait = 0.0
        if prefill_tokens_per_s > 0:
            queued = sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in s.requests.values())
            wait = queued / prefill_tokens_per_s
        return ReplicaLoad(self.replica_id, self.replica_id, self.roles, state=self.state, num_waiting=s.num_waiting,
                           num_running=s.num_running, num_blocks_used=bm.num_used_blocks,
                           num_blocks_free=bm.num_free_blocks, prefill_wait_s=wait)


@dataclass(eq=False)
class Track:
    """What the simulator records of one request (client side)."""

    arrival: Arrival
    sent: float
    measured: bool
    replica: str = ""
    prefill_replica: str = ""
    first: float | None = None
    last: float | None = None
    num_output: int = 0
    num_cached: int = 0  # prompt tokens served from a prefix cache
    done: bool = False

    @property
    def ttft(self) -> float:
        if self.first is None:
            raise ValueError(f"{self.arrival.request_id} has no first token")
        return self.first - self.sent

    @property
    def tpot(self) -> float | None:
        """Mean gap between its tokens so far (None before a second token)."""
        if self.first is None or self.last is None or self.num_output < 2:
            return None
        return (self.last - self.first) / (self.num_output - 1)
