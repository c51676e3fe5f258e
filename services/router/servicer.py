"""RouterService: Pick a replica for a request from the fleet view with a pure policy."""

from __future__ import annotations

import grpc
import structlog
from tokenfleet.services.common.errors import map_errors
from tokenfleet.services.router.fleet import FleetView

from tokenfleet.routing.policies import NoReplicaError, RoundRobin, least_loaded
from tokenfleet.v1 import router_pb2, router_pb2_grpc

log = structlog.get_logger()


class Router(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, fleet: FleetView, default_policy: int = router_pb2.POLICY_LEAST_LOADED):
        self.fleet = fleet
        self.default_policy = default_policy
        self.round_robin = RoundRobin()

    @map_errors
    async def Pick(self, request: router_pb2.PickRequest, context: grpc.aio.ServicerContext) -> router_pb2.PickResponse:
        name, version = self.fleet.resolve(request.model)  # UnknownModelError -> NOT_FOUND
        snapshot = self.fleet.snapshot(name, version).without(request.exclude_replica_ids)
        policy = request.policy or self.default_policy
        try:
            chosen = self.round_robin.pick(snapshot) if policy == router_pb2.POLICY_ROUND_ROBIN else least_loaded(snapshot)
        except NoReplicaError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{name}@{version or '*'}: {e}")
        self.fleet.note_assignment(chosen.replica_id, name, version)
        log.debug("picked", model=f"{name}@{version}", replica=chosen.replica_id)
        return router_pb2.PickResponse(replica_id=chosen.replica_id, address=chosen.address, model=name,
                                       model_version=version)
