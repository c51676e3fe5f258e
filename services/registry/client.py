"""Talking to the registry service: the one client workers, gateways, the launcher and the CLI use
(fetch a record, watch the catalog, register a model)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import structlog
from tokenfleet.services.registry.convert import record_from_proto, record_to_proto, view_from_snapshot

from tokenfleet.cluster.registry import ModelRecord, RegistryView, UnknownModelError
from tokenfleet.security.plane import Plane
from tokenfleet.v1 import registry_pb2, registry_pb2_grpc

log = structlog.get_logger()


async def fetch_record(address: str, ref: str, plane: Plane, wait_s: float = 120.0) -> ModelRecord:
    """Resolve ``ref`` at the registry; waits (retrying) while the registry is not up yet,
    raises UnknownModelError at once for an unregistered model."""
    deadline = time.monotonic() + wait_s
    async with plane.channel(address, "registry") as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        while True:
            try:
                return record_from_proto(await stub.GetModel(registry_pb2.GetModelRequest(ref=ref), timeout=10))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    raise UnknownModelError(f"registry {address}: {e.details()}") from e
                if time.monotonic() > deadline:
                    raise ConnectionError(f"registry {address} unreachable: {e.details()}") from e
                log.info("waiting for the registry", address=address, code=str(e.code()))
                await asyncio.sleep(1.0)


async def watch_registry(address: str, plane: Plane) -> AsyncIterator[RegistryView]:
    """Every registry snapshot, forever; reconnects after errors (the caller keeps its last view)."""
    while True:
        try:
            async with plane.channel(address, "registry") as channel:  # a new one each time: current certificate
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                async for snapshot in stub.Watch(registry_pb2.WatchRequest()):
                    yield view_from_snapshot(snapshot)
        except grpc.aio.AioRpcError as e:
            log.warning("registry watch interrupted; keeping the last view", address=address, code=str(e.code()))
        await asyncio.sleep(1.0)


def register_model(address: str, record: ModelRecord, plane: Plane, timeout: float = 30.0) -> tuple[bool, ModelRecord]:
    """Register ``record`` (idempotent: an identical record already there is not an error). Returns
    (created, the registry's record). Raises grpc.RpcError (INVALID_ARGUMENT, ALREADY_EXISTS for a
    different record under the same name@version, UNAVAILABLE, PERMISSION_DENIED unless ``plane`` is an operator's)."""
    with plane.sync_channel(address, "registry") as channel:
        reply = registry_pb2_grpc.RegistryServiceStub(channel).RegisterModel(
            registry_pb2.RegisterModelRequest(record=record_to_proto(record)), timeout=timeout)
    return reply.created, record_from_proto(reply.record)


async def pin_numerics(address: str, ref: str, numerics: str, plane: Plane, timeout: float = 30.0) -> ModelRecord:
    """Pin ``numerics`` (a DtypeChoice's JSON) on ``ref``'s record unless another worker did first; returns the
    record as stored, whose ``numerics`` is the pin that stands. Raises grpc.RpcError."""
    async with plane.channel(address, "registry") as channel:
        reply = await registry_pb2_grpc.RegistryServiceStub(channel).PinNumerics(
            registry_pb2.PinNumericsRequest(ref=ref, numerics=numerics), timeout=timeout)
    return record_from_proto(reply)
