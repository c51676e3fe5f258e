"""Discrete-event fleet simulator: our real scheduler, block manager and placement policies, with a
cost model in place of the model runner.

Each replica is a ``Scheduler`` over a ``BlockManager`` (the engine's own classes, with the
replica's KV capacity in blocks). A replica steps continuously while it has work: ``schedule()``
gives the batch, the cost model its duration, and at its end ``update()`` appends the tokens
sampled (synthetic ids that reproduce the conversation's transcript, see ``workload``), exactly as
the engine core does after the model runner. Placement is ``tokenfleet.routing.placement.place``,
the router's own decision, over a fleet snapshot refreshed at the router's load-report interval
(picks since the last report count as pending load, as in services/router) and the affinity map
of prefix anchors; replicas' cached block hashes are read live (the real router sees them up to one
report late).

Disaggregation follows the real request path: the decode replica reserves the prompt's blocks
(``add_remote``; when they are not free it prefills locally), the prefill replica computes the
prompt with its blocks held, the client gets the first token when the prefill samples it, the KV
the decode replica lacks travels at the link's bandwidth, then the decode replica installs it
(``activate_remote``) and the request joins its batch. The prefill replica frees its held blocks when
the transfer ends.

KV tiers (``tier_blocks``): each replica keeps the blocks its pool evicts in a second tier of that many
blocks (host memory on a GPU node, LRU) and restores them on a prefix hit through the scheduler's own
admission path, at ``tier_bytes_per_s``; the router counts tier blocks for less (``prefix``'s values).
Peer fetch (``peer_fetch``): the replica that computes a prompt (a prefill replica, or a decode replica
the router spilled to) first pulls the leading blocks another replica holds beyond its own, over the
link, as services/worker does; in P/D fleets that is usually the decode replica, which holds the replies
it generated.

Only requests that arrive inside the measurement window count; the simulation runs past the window
(traffic continues) until they finish or ``drain_seconds`` pass. See ``metrics`` for the outputs.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tokenfleet.engine.request import Request
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import QueueFullError, SchedulerOutput
from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.kvcache.salt import chain_salt, request_scope
from tokenfleet.planning.costs import CostModel, StepShape
from tokenfleet.planning.fleet import FleetConfig, SimReplica, Track
from tokenfleet.planning.workload import Arrival, Source
from tokenfleet.routing.placement import (
    LEAST_LOADED,
    POLICIES,
    PREFIX_AWARE,
    ROUND_ROBIN,
    Placement,
    PlacementQuery,
    live_homes,
    place,
)
from tokenfleet.routing.policies import FleetSnapshot, NoReplicaError, RoundRobin
from tokenfleet.routing.prefix import matched_prefix

PARAMS = SamplingParams(max_tokens=None, ignore_eos=True)  # lengths come from each request's max_tokens
__all__ = ["FleetConfig", "Simulator", "POLICIES", "PREFIX_AWARE", "ROUND_ROBIN", "LEAST_LOADED"]


class Simulator:
    def __init__(self, fleet: FleetConfig, cost: CostModel, source: Source, warmup_seconds: float = 20.0,
                 duration_seconds: float = 60.0, drain_seconds: float = 60.0, salt: str = "sim",
                 overload_seconds: float = 10.0):
        if not fleet.peer_fetch:  # the router then counts no fetchable blocks (services/router --no-peer-fetch)
            fleet = replace(fleet, prefix=replace(fleet.prefix, peer_block_value=0.0))
        self.fleet, self.cost, self.source = fleet, cost, source
        self.window = (warmup_seconds, warmup_seconds + duration_seconds)
        self.end = self.window[1] + drain_seconds
        self.salt = salt
        self.overload_seconds = overload_seconds  # queued work beyond this many seconds of arrivals: stop early
        self.overloaded = False
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        both = ("decode", "prefill")
        self.replicas = {f"d{i:03d}": SimReplica(f"d{i:03d}", ("decode",) if fleet.disaggregated else both, fleet, salt)
                         for i in range(fleet.replicas)}
        self.replicas.update({f"p{i:03d}": SimReplica(f"p{i:03d}", ("prefill",), fleet, salt)
                              for i in range(fleet.prefill_replicas)})
        self._loads = {rid: r.load() for rid, r in self.replicas.items()}
        self._pending: Counter[str] = Counter()
        self._homes: dict[bytes, tuple[str, ...]] = {}
        self._homes_count: Counter[str] = Counter()
        self._round_robin = RoundRobin()
        self.tracks: dict[str, Track] = {}
        self.gaps = array("d")  # inter-token gaps of measured requests (ITL)
        self.num_rejected = self.num_submitted = 0
        self.num_remote = self.num_fallbacks = 0
        self.transfer_bytes = 0.0
        self.num_peer_blocks = self.num_restored_blocks = 0  # fetched from peers, restored from tiers (in the window)
        self.output_tokens_in_window = 0
        self._held: dict[str, int] = {}  # remote request -> leading prompt blocks the decode replica had
        self._open = 0  # measured requests not finished
        # autoscaling (``enable_autoscale``): replica-seconds paid inside the window (serving, starting, draining)
        self.replica_seconds = float(len(self.replicas)) * (self.window[1] - self.window[0])
        self.replica_timeline: list[tuple[float, int]] = []  # (time, replicas paid for) at each autoscaler tick
        self._scaler: Any = None
        self.retired: list[SimReplica] = []  # replicas the autoscaler removed (their window stats still count)
        self.demand_samples: list[float] = []  # running + waiting per serving replica, at each report in the window

    # ---- the event loop (workload.Simulation) --------------------------------------------------------
    def at(self, time: float, action: Callable[[Any], None], arg: Any = None) -> None:
        heapq.heappush(self._events, (time, next(self._seq), action, arg))

    def enable_autoscale(self, policy: Any, interval: float = 5.0, start_seconds: float = 60.0) -> None:
        """Grow and shrink the (colocated) fleet with ``cluster.autoscale.Autoscaler`` under ``policy``, deciding
        every ``interval`` seconds; a new replica serves ``start_seconds`` after it is asked for (weights loaded,
        warmed up), a retired one drains (no new picks) and goes once idle. GPU-hours then count the replicas paid
        for over time (``replica_seconds``) instead of a fixed fleet."""
        from tokenfleet.cluster.autoscale import Autoscaler

        if self.fleet.disaggregated:
            raise ValueError("the simulator autoscales colocated fleets only")
        self._scaler = Autoscaler(default=policy)
        self._scale_interval, self._start_seconds = interval, start_seconds
        self._scale_history: list[Any] = []
        self._starting = 0
        self._next_replica = itertools.count(len(self.replicas))
        self.replica_seconds = 0.0
        chunk = self.fleet.scheduler.max_num_batched_tokens  # a replica's prefill rate: one full chunk, no context
        self._prefill_rate = chunk / self.cost.step_seconds(StepShape(chunk, 1, 1, chunk * (chunk + 1) // 2, chunk))

    def run(self) -> Simulator:
        self.source.start(self)
        self.at(0.0, self._report)
        if self._scaler is not None:
            self.at(0.0, self._autoscale)
        events = self._events
        while events:
            time, _, action, arg = heapq.heappop(events)
            if time > self.end or (time > self.window[1] and not self._open):
                break
            self.now = time
            action(arg)
        return self

    def _report(self, _: Any = None) -> None:
        """Load reports reach the router: fresh gauges, pending picks cleared."""
        self._loads = {rid: r.load() for rid, r in self.replicas.items()}
        self._pending.clear()
        waiting = sum(load.num_waiting for load in self._loads.values())
        if self.now > self.window[0] and waiting > self.overload_seconds * max(1.0, self.num_submitted / self.now):
            self.overloaded = True  # the queue grows without bound: the SLOs are lost, stop paying for it
            self._events.clear()
            return
        if self.window[0] <= self.now < self.window[1]:
            for r in self.replicas.values():
                bm = r.scheduler.block_manager
                r.kv_samples.append(bm.num_used_blocks / bm.num_blocks)
            serving = [x for x in self._loads.values() if x.state == "serving"]
            if serving:  # requests (running + waiting) per serving replica: the autoscaler's demand signal
                self.demand_samples.append(sum(x.num_running + x.num_waiting for x in serving) / len(serving))
        if self._events:  # anything else left to happen (a closed loop ends when its last request does)
            self.at(self.now + self.fleet.report_interval_s, self._report)

    def _autoscale(self, _: Any = None) -> None:
        from tokenfleet.cluster.autoscale import Sample

        for rid in [rid for rid, r in self.replicas.items() if r.state == "draining" and not r.scheduler.has_unfinished()]:
            self.retired.append(self.replicas.pop(rid))  # drained: it goes (the next report no longer lists it)
            self._loads.pop(rid, None)
        paid = len(self.replicas) + self._starting
        start, end = self.window
        overlap = max(0.0, min(self.now + self._scale_interval, end) - max(self.now, start))
        self.replica_seconds += paid * overlap
        self.replica_timeline.append((self.now, paid))
        serving = [r for r in self.replicas.values() if r.state == "serving"]
        loads = [r.load(self._prefill_rate) for r in serving]
        sample = Sample(self.now, len(serving), sum(x.num_running for x in loads), sum(x.num_waiting for x in loads),
                        max((x.kv_utilization for x in loads), default=0.0), self._starting,
                        prefill_wait=max((x.prefill_wait_s for x in loads), default=0.0))
        self._scale_history = [s for s in self._scale_history if self.now - s.when <= 600] + [sample]
        decision = self._scaler.decide("fleet", self._scale_history, self.now)
        if decision.delta > 0:
            for _ in range(decision.delta):
                self._starting += 1
                self.at(self.now + self._start_seconds, self._add_replica)
        elif decision.delta < 0:
            idle_first = sorted(serving, key=lambda r: (r.scheduler.num_running + r.scheduler.num_waiting, r.replica_id))
            for replica in idle_first[: -decision.delta]:
                replica.state = "draining"
                self._loads[replica.replica_id] = replica.load()
        if self._events:
            self.at(self.now + self._scale_interval, self._autoscale)

    def _add_replica(self, _: Any = None) -> None:
        self._starting -= 1
        rid = f"d{next(self._next_replica):03d}"
        self.replicas[rid] = SimReplica(rid, ("decode", "prefill"), self.fleet, self.salt)
        self._loads[rid] = self.replicas[rid].load()

    def preload(self, tokens: list[int], tenant: str = "") -> None:
        """A warm start: leave ``tokens``' KV cached (evictable) where the router would have placed
        them, on the decode replica and on the prefill replica that computed them, as an earlier
        turn of ``tenant`` that ran before the simulation would have."""
        fleet = self.fleet
        chain = hash_blocks(tokens, fleet.block_size, self._chain_salt(tenant))
        if not chain:
            return
        placement = self._placement(chain, len(tokens))
        for chosen in (placement.decode, placement.prefill):
            if chosen is not None:
                self._cache_chain(self.replicas[chosen.replica_id], chain)
                self._loads[chosen.replica_id] = self.replicas[chosen.replica_id].load()

    def _placement(self, chain: list[bytes], num_tokens: int) -> Placement:
        """The router's decision for a prompt (NoReplicaError when none serves), recording the anchor's
        new home in the affinity map as services/router does."""
        fleet = self.fleet
        anchor_homes: tuple[str, ...] = ()
        if len(chain) >= fleet.prefix.min_match_blocks:
            anchor_homes = self._homes.get(chain[fleet.prefix.min_match_blocks - 1], ())
        cached = {rid: r.held() for rid, r in self.replicas.items()}
        tiered = {rid: r.tier_only() for rid, r in self.replicas.items() if r.tier is not None}
        placement = place(PlacementQuery(self._snapshot(), chain, cached, anchor_homes, num_tokens, fleet.block_size,
                                         fleet.policy, self._round_robin, fleet.prefix, fleet.disagg,
                                         colocated=not fleet.disaggregated, homes_count=self._homes_count,
                                         tiered=tiered))
        if placement.record_home and placement.anchor is not None:
            homes = live_homes(anchor_homes, self.replicas.keys(), placement.decode.replica_id)
            self._homes_count.subtract(anchor_homes)
            self._homes_count.update(homes)
            self._homes[placement.anchor] = homes
        return placement

    # ---- placement ------------------------------------------------------------------------------------
    def submit(self, arrival: Arrival) -> None:
        measured = self.window[0] <= self.now < self.window[1]
        track = Track(arrival, self.now, measured)
        self.tracks[arrival.request_id] = track
        self._open += measured
        self.num_submitted += 1
        self.at(self.now + self.fleet.hop_seconds, self._place, track)

    def _snapshot(self) -> FleetSnapshot:
        pending = self._pending
        return FleetSnapshot(tuple(replace(load, pending_assignments=pending[rid]) if pending[rid] else load
                                   for rid, load in self._loads.items()))

    def _place(self, track: Track) -> None:
        arrival = track.arrival
        chain = hash_blocks(arrival.prompt, self.fleet.block_size, self._chain_salt(arrival.tenant))
        try:
            placement = self._placement(chain, len(arrival.prompt))
        except NoReplicaError:
            self._reject(track)
            return
        decode = placement.decode.replica_id
        self._pending[decode] += 1
        track.replica = decode
        if placement.prefill is not None:
            self._pending[placement.prefill.replica_id] += 1
            track.prefill_replica = placement.prefill.replica_id
        computes = track.prefill_replica or decode
        delay = self._fetch_from_peer(computes, chain[: (len(arrival.prompt) - 1) // self.fleet.block_size])
        if delay:
            self.at(self.now + delay, self._admit, track)
        else:
            self._admit(track)

    def _admit(self, track: Track) -> None:
        if track.prefill_replica:
            self._start_remote(track, track.prefill_replica)
        else:
            self._add_local(track)

    def _fetch_from_peer(self, replica_id: str, chain: list[bytes]) -> float:
        """Peer fetch: the leading blocks of ``chain`` the best other holder has beyond ``replica_id``'s own
        are copied into its pool (cached, evictable); returns the transfer's seconds (0: nothing fetched)."""
        fleet = self.fleet
        if not fleet.peer_fetch or not chain:
            return 0.0
        replica = self.replicas[replica_id]
        own = matched_prefix(chain, replica.held())
        best = max((matched_prefix(chain, r.held()) for rid, r in self.replicas.items() if rid != replica_id), default=0)
        if best - own < fleet.prefix.peer_min_blocks:
            return 0.0
        if not self._cache_chain(replica, chain[:best]):
            return 0.0  # no room for them now: computed there instead
        num_bytes = (best - own) * fleet.block_size * fleet.kv_bytes_per_token
        if self.window[0] <= self.now < self.window[1]:
            self.num_peer_blocks += best - own
            self.transfer_bytes += num_bytes
        return fleet.link_latency_s + num_bytes / fleet.link_bytes_per_s

    def _cache_chain(self, replica: SimReplica, chain: list[bytes]) -> bool:
        """Leave ``chain``'s blocks cached (evictable) in the replica's pool, as a finished request would;
        False when the pool has no room for them now."""
        bm = replica.scheduler.block_manager
        installed = bm.allocate_slots("install", len(chain) * self.fleet.block_size, bm.match_prefix(chain)) is not None
        if installed:
            bm.cache_blocks("install", chain)
            bm.free("install")
        replica.offload_evicted()
        return installed

    def _request(self, arrival: Arrival, max_tokens: int) -> Request:
        return Request(arrival.request_id, arrival.prompt, PARAMS, arrival_time=self.now, max_tokens=max_tokens,
                       tenant=arrival.tenant, cache_scope=request_scope(arrival.tenant))

    def _chain_salt(self, tenant: str) -> str:
        """As the router hashes a prompt: tenants never share cached prefixes (tokenfleet.kvcache.salt)."""
        return chain_salt(self.salt, request_scope(tenant))

    def _add_local(self, track: Track) -> None:
        replica = self.replicas[track.replica]
        try:
            replica.scheduler.add_request(self._request(track.arrival, track.arrival.max_tokens))
        except (QueueFullError, ValueError):
            self._reject(track)
            return
        self._wake(replica)

    def _reject(self, track: Track) -> None:
        self.num_rejected += track.measured
        self._close(track)

    # ---- disaggregation -------------------------------------------------------------------------------
    def _start_remote(self, track: Track, prefill_id: str) -> None:
        decode = self.replicas[track.replica]
        try:
            held = decode.scheduler.add_remote(self._request(track.arrival, track.arrival.max_tokens))
        except (QueueFullError, ValueError):
            held = None
        decode.offload_evicted()
        if held is None:  # no free blocks on the decode side now: prefill locally (as the worker does)
            track.prefill_replica = ""
            self._add_local(track)
            return
        prefill = self.replicas[prefill_id]
        request = self._request(track.arrival, 1)
        request.hold_blocks = True
        try:
            prefill.scheduler.add_request(request)
        except (QueueFullError, ValueError):
            decode.scheduler.fallback_to_local(track.arrival.request_id)
            track.prefill_replica = ""
            self.num_fallbacks += 1
            self._wake(decode)
            return
        self.num_remote += 1
        self._held[track.arrival.request_id] = held
        self._wake(prefill)

    def _transfer(self, track: Track, request: Request) -> None:
        """The prefill sampled the first token: ship the blocks the decode replica lacks."""
        held = self._held.pop(track.arrival.request_id, 0)
        num_tokens = max(0, request.num_prompt_tokens - held * self.fleet.block_size)
        num_bytes = self.fleet.transfer_bytes(num_tokens)
        self.transfer_bytes += num_bytes
        seconds = self.fleet.link_latency_s + num_bytes / self.fleet.link_bytes_per_s
        self.at(self.now + seconds, self._install, (track, request.output_token_ids[0]))

    def _install(self, item: tuple[Track, int]) -> None:
        track, token = item
        self.replicas[track.prefill_replica].scheduler.release_held(track.arrival.request_id)
        decode = self.replicas[track.replica]
        rid = track.arrival.request_id
        if decode.scheduler.append_remote_token(rid, token) is not None:
            self._finish(track)  # the first token ended it (max_tokens 1)
            return
        decode.scheduler.activate_remote(rid, self.now)
        self._wake(decode)

    # ---- stepping --------------------------------------------------------------------------------------
    def _wake(self, replica: SimReplica) -> None:
        if not replica.busy:
            replica.busy = True
            self.at(self.now, self._step, replica)

    def _step(self, replica: SimReplica) -> None:
        output = replica.scheduler.schedule(self.now)
        replica.offload_evicted()
        if output.is_empty:
            replica.busy = False
            return
        shape = StepShape.of(output, self.fleet.sliding_window)
        seconds = self.cost.step_seconds(shape)
        if output.restores:  # second-tier blocks copied into the pool before the step (not overlapped: pessimistic)
            if self.window[0] <= self.now < self.window[1]:
                self.num_restored_blocks += len(output.restores)
            seconds += len(output.restores) * self.fleet.block_size * self.fleet.kv_bytes_per_token / self.fleet.tier_bytes_per_s
        if self.window[0] <= self.now < self.window[1]:
            replica.busy_seconds += seconds
            replica.steps += 1
            replica.rows += shape.rows
            replica.tokens += shape.tokens
            replica.pairs += shape.pairs
            replica.window_pairs += shape.pairs if shape.window_pairs is None else shape.window_pairs
        self.at(self.now + seconds, self._step_done, (replica, output))

    def _step_done(self, item: tuple[SimReplica, SchedulerOutput]) -> None:
        replica, output = item
        scheduler, tracks, now = replica.scheduler, self.tracks, self.now
        requests = scheduler.requests
        sampled = {}
        for entry in output.scheduled:
            if entry.samples and entry.request_id in requests:
                request_id = entry.request_id
                sampled[request_id] = tracks[request_id].arrival.token(len(requests[request_id].output_token_ids))
        cached = {rid: requests[rid].num_cached_tokens for rid in sampled if tracks[rid].first is None}
        finished = scheduler.update(output, sampled)
        seen = now + self.fleet.hop_seconds  # when the client receives these tokens
        for request_id in sampled:
            track = tracks[request_id]
            if track.first is None:
                track.first = seen
                track.num_cached = cached[request_id]
            elif track.measured:
                self.gaps.append(seen - (track.last or seen))
            track.last = seen
            track.num_output += 1
        if self.window[0] <= now < self.window[1]:
            self.output_tokens_in_window += len(sampled)
        for request in finished:
            if replica.roles == ("prefill",):
                self._transfer(tracks[request.request_id], request)
            else:
                self._finish(tracks[request.request_id])
        self._step(replica)

    def _finish(self, track: Track) -> None:
        self._close(track)
        self.at(self.now + self.fleet.hop_seconds, self._delivered, track)  # the client has the whole reply

    def _delivered(self, track: Track) -> None:
        self.source.finished(self, track.arrival, track.num_output)

    def _close(self, track: Track) -> None:
        track.done = True
        if track.measured:
            self._open -= 1
        else:
            del self.tracks[track.arrival.request_id]
