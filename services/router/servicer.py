"""RouterService: Pick a replica for a request from the fleet view with a pure placement
(tokenfleet.routing.placement), and record prefix assignments in the etcd affinity map."""

from __future__ import annotations

import grpc
import structlog
from tokenfleet.services.common.errors import map_errors
from tokenfleet.services.router.fleet import FleetView

from tokenfleet.cluster.affinity import AffinityMap
from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.kvcache.salt import chain_salt
from tokenfleet.routing.placement import (
    DEFAULT_DISAGG_CONFIG,
    LEAST_LOADED,
    PREFIX_AWARE,
    ROUND_ROBIN,
    DisaggConfig,
    live_homes,
    place,
    prefix_peer,
)
from tokenfleet.routing.policies import NoReplicaError, RoundRobin
from tokenfleet.routing.prefix import DEFAULT_PREFIX_CONFIG, PrefixPolicyConfig, matched_prefix
from tokenfleet.telemetry.metrics import RouterMetrics
from tokenfleet.v1 import router_pb2, router_pb2_grpc

log = structlog.get_logger()
_POLICY_NAMES = {router_pb2.POLICY_PREFIX_AWARE: PREFIX_AWARE, router_pb2.POLICY_LEAST_LOADED: LEAST_LOADED,
                 router_pb2.POLICY_ROUND_ROBIN: ROUND_ROBIN}


class Router(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, fleet: FleetView, default_policy: int = router_pb2.POLICY_PREFIX_AWARE,
                 metrics: RouterMetrics | None = None, affinity: AffinityMap | None = None,
                 prefix_config: PrefixPolicyConfig = DEFAULT_PREFIX_CONFIG,
                 disagg: DisaggConfig = DEFAULT_DISAGG_CONFIG, peer_fetch: bool = True, batch_slots: int = 8):
        self.fleet = fleet
        self.metrics = metrics or RouterMetrics(fleet.metric_rows)
        self.default_policy = default_policy
        self.round_robin = RoundRobin()
        self.affinity = affinity
        self.prefix_config = prefix_config
        self.disagg = disagg
        self.peer_fetch = peer_fetch  # name a peer holding more of the prefix (PickResponse.prefix_*)
        self.batch_slots = batch_slots  # a replica takes batch work (spare_only) while it runs fewer than this

    @map_errors
    async def Pick(self, request: router_pb2.PickRequest, context: grpc.aio.ServicerContext) -> router_pb2.PickResponse:
        try:
            name, version = self.fleet.resolve(request.model)  # UnknownModelError -> NOT_FOUND
        except LookupError:
            self.metrics.picks.labels("", "not_found").inc()
            raise
        snapshot = self.fleet.snapshot(name, version).without(request.exclude_replica_ids).preferring_adapter(request.adapter)
        if request.spare_only:
            spare = snapshot.with_spare(self.batch_slots)
            if not spare.replicas and snapshot.replicas:
                self.metrics.picks.labels(name, "no_spare").inc()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{name}: no replica has spare capacity for "
                                    "batch work now")
            snapshot = spare
        layout, cached, tiered = self.fleet.prefix_view(snapshot)
        prompt = list(request.prompt_token_ids)
        salt = chain_salt(layout.hash_salt, request.cache_scope) if layout is not None else ""
        chain = hash_blocks(prompt, layout.block_size, salt) if prompt and layout is not None else []
        block_size = layout.block_size if layout is not None else 1
        anchor_homes: tuple[str, ...] = ()
        if self.affinity is not None and len(chain) >= self.prefix_config.min_match_blocks:
            anchor_homes = self.affinity.homes_of(name, chain[self.prefix_config.min_match_blocks - 1])
        policy = _POLICY_NAMES.get(request.policy or self.default_policy, PREFIX_AWARE)
        try:
            placement = place(snapshot, chain, cached, anchor_homes, len(prompt) or request.num_prompt_tokens,
                              block_size, policy, self.round_robin, self.prefix_config, self.disagg,
                              colocated=request.colocated,
                              homes_count=self.affinity.homes_count() if self.affinity is not None else None,
                              tiered=tiered)
        except NoReplicaError as e:
            self.metrics.picks.labels(name, "unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{name}@{version or '*'}: {e}")
        chosen = placement.decode
        if placement.record_home and placement.anchor is not None and self.affinity is not None:
            live = {r.replica_id for r in self.fleet.snapshot(name, version).replicas}
            self.affinity.record(name, placement.anchor, live_homes(anchor_homes, live, chosen.replica_id))
        self.fleet.note_assignment(chosen.replica_id, name, version)
        if placement.prefill is not None:
            self.fleet.note_assignment(placement.prefill.replica_id, name, version)
        self.metrics.picks.labels(name, "ok").inc()
        log.debug("picked", model=f"{name}@{version}", replica=chosen.replica_id, policy=policy,
                  matched_blocks=placement.matched_blocks,
                  prefill=placement.prefill.replica_id if placement.prefill else None)
        response = router_pb2.PickResponse(replica_id=chosen.replica_id, address=chosen.address, model=name,
                                           model_version=version,
                                           cached_prompt_tokens=min(placement.matched_blocks * block_size,
                                                                    len(prompt)))
        computes = chosen  # the replica that computes the prompt: a peer can save it a recompute
        if placement.prefill is not None:
            response.prefill_replica_id = placement.prefill.replica_id
            response.prefill_address = placement.prefill.address
            computes = placement.prefill
        if chain and self.peer_fetch and not request.colocated:
            held = matched_prefix(chain, cached.get(computes.replica_id, ()))
            peer = prefix_peer(snapshot, chain, cached, computes.replica_id, held, self.prefix_config.peer_min_blocks)
            if peer is not None:
                response.prefix_replica_id, response.prefix_address = peer[0].replica_id, peer[0].address
                response.prefix_blocks = peer[1]
                self.metrics.picks.labels(name, "peer_prefix").inc()
        return response
