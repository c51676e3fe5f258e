"""RouterService: Pick a replica for a request from the fleet view with a pure policy."""

from __future__ import annotations

import grpc
import structlog
from tokenfleet.services.common.errors import map_errors
from tokenfleet.services.router.fleet import FleetView

from tokenfleet.routing.policies import NoReplicaError, RoundRobin, least_loaded
from tokenfleet.telemetry.metrics import RouterMetrics
from tokenfleet.v1 import router_pb2, router_pb2_grpc

log = structlog.get_logger()


class Router(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, fleet: FleetView, default_policy: int = router_pb2.POLICY_LEAST_LOADED,
                 metrics: RouterMetrics | None = None):
        self.fleet = fleet
        self.metrics = metrics or RouterMetrics(fleet.metric_rows)
        self.default_policy = default_policy
        self.round_robin = RoundRobin()

    @map_errors
    async def Pick(self, request: router_pb2.PickRequest, context: grpc.aio.ServicerContext) -> router_pb2.PickResponse:
        try:
            name, version = self.fleet.resolve(request.model)  # UnknownModelError -> NOT_FOUND
        except LookupError:
            self.metrics.picks.labels("", "not_found").inc()
            raise
        snapshot = self.fleet.snapshot(name, version).without(request.exclude_replica_ids)
        policy = request.policy or self.default_policy
        try:
            chosen = self.round_robin.pick(snapshot) if policy == router_pb2.POLICY_ROUND_ROBIN else least_loaded(snapshot)
        except NoReplicaError as e:
            self.metrics.picks.labels(name, "unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{name}@{version or '*'}: {e}")
        self.fleet.note_assignment(chosen.replica_id, name, version)
        self.metrics.picks.labels(name, "ok").inc()
        log.debug("picked", model=f"{name}@{version}", replica=chosen.replica_id)
        return router_pb2.PickResponse(replica_id=chosen.replica_id, address=chosen.address, model=name,
                                       model_version=version)
