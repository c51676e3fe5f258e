"""RegistryService over etcd: writes go straight to etcd, reads come from a watched local view."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tokenfleet.services.common.errors import map_errors
from tokenfleet.services.registry.convert import record_from_proto, record_to_proto, snapshot_to_proto, status_name

from tokenfleet.cluster.etcd import EtcdClient, KeyEvent
from tokenfleet.cluster.registry import (
    ALIASES,
    MODELS,
    ModelRecord,
    ModelRegistry,
    RegistryView,
    UnknownModelError,
    follow_registry,
)
from tokenfleet.v1 import registry_pb2, registry_pb2_grpc


class WatchedView(RegistryView):
    """A RegistryView that wakes Watch streams whenever it changes."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = asyncio.Event()

    def reset(self, listing: dict[str, bytes], prefixes: tuple[str, ...] = (MODELS, ALIASES)) -> None:
        super().reset(listing, prefixes)
        self._wake()

    def apply(self, event: KeyEvent) -> None:
        super().apply(event)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_past(self, revision: int) -> None:
        while self.revision == revision:
            await self._changed.wait()


class Registry(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self, etcd: EtcdClient):
        self.store = ModelRegistry(etcd)
        self.view = WatchedView()
        self._follow: asyncio.Task | None = None

    async def start(self) -> None:
        self._follow = asyncio.create_task(follow_registry(self.store.etcd, self.view))

    async def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follow

    async def _refresh(self, key: str) -> None:
        """Read-your-writes: apply a key we just wrote to the local view now, not when its watch
        event arrives (a linearizable read returns the newest value; the event re-applies it)."""
        self.view.apply(KeyEvent(key, await self.store.etcd.get(key)))

    async def _resolve(self, ref: str) -> ModelRecord:
        try:
            return self.view.resolve(ref)
        except UnknownModelError:  # maybe registered a moment ago and the watch has not caught up
            return (await self.store.load()).resolve(ref)

    @map_errors
    async def RegisterModel(self, request, context) -> registry_pb2.RegisterModelResponse:  # type: ignore[no-untyped-def]
        record, created = await self.store.register(record_from_proto(request.record))
        await self._refresh(record.key)
        return registry_pb2.RegisterModelResponse(record=record_to_proto(record), created=created)

    @map_errors
    async def GetModel(self, request, context) -> registry_pb2.ModelRecord:  # type: ignore[no-untyped-def]
        return record_to_proto(await self._resolve(request.ref))

    @map_errors
    async def ListModels(self, request, context) -> registry_pb2.RegistrySnapshot:  # type: ignore[no-untyped-def]
        return snapshot_to_proto(self.view)

    @map_errors
    async def SetAlias(self, request, context) -> registry_pb2.SetAliasResponse:  # type: ignore[no-untyped-def]
        await self.store.set_alias(request.alias, request.target, request.canary, request.canary_weight, request.route)
        await self._refresh(f"{ALIASES}{request.alias}")
        return registry_pb2.SetAliasResponse()

    @map_errors
    async def DeleteAlias(self, request, context) -> registry_pb2.DeleteAliasResponse:  # type: ignore[no-untyped-def]
        if not await self.store.delete_alias(request.alias):
            raise UnknownModelError(f"alias {request.alias!r} does not exist")
        await self._refresh(f"{ALIASES}{request.alias}")
        return registry_pb2.DeleteAliasResponse()

    @map_errors
    async def SetModelStatus(self, request, context) -> registry_pb2.ModelRecord:  # type: ignore[no-untyped-def]
        record = await self.store.set_status(request.ref, status_name(request.status))
        await self._refresh(record.key)
        return record_to_proto(record)

    @map_errors
    async def PinNumerics(self, request, context) -> registry_pb2.ModelRecord:  # type: ignore[no-untyped-def]
        record = await self.store.pin_numerics(request.ref, request.numerics)
        await self._refresh(record.key)
        return record_to_proto(record)

    @map_errors
    async def Watch(self, request, context) -> AsyncIterator[registry_pb2.RegistrySnapshot]:  # type: ignore[no-untyped-def]
        while True:
            revision = self.view.revision
            yield snapshot_to_proto(self.view)
            await self.view.wait_past(revision)
