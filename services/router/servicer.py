"""RouterService: Pick a replica for a request from the fleet view with a pure placement
(tokenfleet.routing.placement), record prefix assignments in the etcd affinity map, and remember where each
conversation was served last.

Conversation homes are kept in this router's memory (tokenfleet.routing.conversations), not in etcd: a
conversation's home changes with every turn (its prompt's length), and the affinity map is written only when an
assignment changes, never per request. Several routers each learn their own homes, which is enough: a gateway asks
the same router for every turn of a conversation (Dispatcher.pick), and a router that has not seen a conversation
(the gateway's first choice was away, or this router restarted) places the turn by prefix, where the home's
reported blocks and the prompt's affinity homes point to the same replica; it remembers the home from then on.
"""

from __future__ import annotations

import time

import grpc
import structlog
from tokenfleet.services.common.errors import map_errors
from tokenfleet.services.router.fleet import FleetView

from tokenfleet.cluster.affinity import AffinityMap
from tokenfleet.routing.conversations import ConversationHomes
from tokenfleet.routing.placement import (
    DEFAULT_DISAGG_CONFIG,
    LEAST_LOADED,
    PREFIX_AWARE,
    ROUND_ROBIN,
    ConversationHome,
    DisaggConfig,
    Placement,
    PlacementQuery,
    Route,
    anchor_of,
    live_homes,
    prompt_chain,
    route,
)
from tokenfleet.routing.policies import NoReplicaError, RoundRobin
from tokenfleet.routing.prefix import DEFAULT_PREFIX_CONFIG, PrefixPolicyConfig
from tokenfleet.telemetry.metrics import RouterMetrics
from tokenfleet.v1 import router_pb2, router_pb2_grpc

log = structlog.get_logger()
_POLICY_NAMES = {router_pb2.POLICY_PREFIX_AWARE: PREFIX_AWARE, router_pb2.POLICY_LEAST_LOADED: LEAST_LOADED,
                 router_pb2.POLICY_ROUND_ROBIN: ROUND_ROBIN}


class Router(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, fleet: FleetView, default_policy: int = router_pb2.POLICY_PREFIX_AWARE,
                 metrics: RouterMetrics | None = None, affinity: AffinityMap | None = None,
                 prefix_config: PrefixPolicyConfig = DEFAULT_PREFIX_CONFIG,
                 disagg: DisaggConfig = DEFAULT_DISAGG_CONFIG, peer_fetch: bool = True, batch_slots: int = 8,
                 conversations: ConversationHomes | None = None):
        self.fleet = fleet
        self.metrics = metrics or RouterMetrics(fleet.metric_rows)
        self.default_policy = default_policy
        self.round_robin = RoundRobin()
        self.affinity = affinity
        self.prefix_config = prefix_config
        self.disagg = disagg
        self.peer_fetch = peer_fetch  # name a peer holding more of the prefix (PickResponse.prefix_*)
        self.batch_slots = batch_slots  # a replica takes batch work (spare_only) while it runs fewer than this
        self.conversations = conversations or ConversationHomes()  # where each conversation was served last

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
        prompt = request.prompt_token_ids
        chain = prompt_chain(prompt, layout, request.cache_scope)
        anchor = anchor_of(chain, self.prefix_config)
        anchor_homes = self.affinity.homes_of(name, anchor) if self.affinity is not None and anchor is not None else ()
        policy = _POLICY_NAMES.get(request.policy or self.default_policy, PREFIX_AWARE)
        now = time.monotonic()
        home = self.conversations.home(name, version, request.conversation, now) if request.conversation else None
        query = PlacementQuery(snapshot, chain, cached, anchor_homes, len(prompt) or request.num_prompt_tokens,
                               layout.block_size if layout is not None else 1, policy, self.round_robin,
                               self.prefix_config, self.disagg, colocated=request.colocated,
                               homes_count=self.affinity.homes_count() if self.affinity is not None else None,
                               tiered=tiered, conversation=home)
        peer_min = self.prefix_config.peer_min_blocks if self.peer_fetch and not request.colocated else None
        try:
            routed = route(query, peer_min)
        except NoReplicaError as e:
            self.metrics.picks.labels(name, "unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{name}@{version or '*'}: {e}")
        self._record(name, version, routed.placement, anchor_homes)
        if request.conversation:
            self._remember(name, version, request.conversation, routed.placement, chain, home is None, now)
        log.debug("picked", model=f"{name}@{version}", replica=routed.placement.decode.replica_id, policy=policy,
                  matched_blocks=routed.placement.matched_blocks,
                  prefill=routed.placement.prefill.replica_id if routed.placement.prefill else None)
        return self._response(name, version, routed)

    def _record(self, name: str, version: str, placement: Placement, anchor_homes: tuple[str, ...]) -> None:
        """What a placement changes in the router's state: the anchor's homes, the replicas' assignments."""
        chosen = placement.decode
        if placement.record_home and placement.anchor is not None and self.affinity is not None:
            live = {r.replica_id for r in self.fleet.snapshot(name, version).replicas}
            self.affinity.record(name, placement.anchor, live_homes(anchor_homes, live, chosen.replica_id))
        self.fleet.note_assignment(chosen.replica_id, name, version)
        if placement.prefill is not None:
            self.fleet.note_assignment(placement.prefill.replica_id, name, version)
        self.metrics.picks.labels(name, "ok").inc()

    def _remember(self, name: str, version: str, conversation: str, placement: Placement, chain: list[bytes],
                  is_new: bool, now: float) -> None:
        """The conversation's next turn is placed where this one went (which then holds this prompt); the
        metric counts whether this turn followed its home, left it (why) or had none."""
        self.conversations.remember(name, version, conversation,
                                    ConversationHome.of(placement.decode.replica_id, chain), now)
        outcome = "new" if is_new else placement.conversation or "ignored"  # "ignored": a baseline policy
        self.metrics.conversations.labels(name, outcome).inc()

    def _response(self, name: str, version: str, routed: Route) -> router_pb2.PickResponse:
        placement, chosen = routed.placement, routed.placement.decode
        response = router_pb2.PickResponse(replica_id=chosen.replica_id, address=chosen.address, model=name,
                                           model_version=version, cached_prompt_tokens=routed.cached_prompt_tokens)
        if placement.prefill is not None:
            response.prefill_replica_id = placement.prefill.replica_id
            response.prefill_address = placement.prefill.address
        if routed.peer is not None:
            response.prefix_replica_id, response.prefix_address = routed.peer[0].replica_id, routed.peer[0].address
            response.prefix_blocks = routed.peer[1]
            self.metrics.picks.labels(name, "peer_prefix").inc()
        return response
