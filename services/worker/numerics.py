"""One record, one numerics: what a worker serves when its model record says dtype "auto".

The first worker of a version resolves "auto" on its own machine (models.auto_dtype: the CPU's flags, a short
measurement, cached) and pins the choice on the record (RegistryService.PinNumerics, compare-and-set); every later
worker serves the pinned dtype, so a fleet of mixed machines gives one set of answers and one KV layout (peer fetch
and disaggregated prefill compare layouts). A worker whose own fastest dtype differs says so in its start log and in
its replica record (``ReplicaRecord.numerics``), and serves the pin anyway."""

from __future__ import annotations

import dataclasses

import grpc
import structlog
from tokenfleet.services.registry.client import pin_numerics

from tokenfleet.backends.torch.device import configure_threads, in_passing_thread, resolve_device
from tokenfleet.cluster.registry import ModelRecord
from tokenfleet.engine.config import EngineConfig
from tokenfleet.models.auto_dtype import DtypeChoice
from tokenfleet.models.loader import choose_dtype
from tokenfleet.security.plane import Plane

log = structlog.get_logger()


def local_choice(config: EngineConfig) -> DtypeChoice:
    """What "auto" resolves to on this machine, measured (when it must be) on the worker's own threads."""
    configure_threads(config.num_threads)
    return choose_dtype(config.dtype, resolve_device(config.device), config.quantization, config.model)


async def settle_dtype(registry: str, record: ModelRecord, config: EngineConfig,
                       plane: Plane) -> tuple[EngineConfig, str]:
    """``config`` with the dtype this worker serves, and the note its replica record carries ("" when the dtype is
    the record's own or this machine's choice). A config whose dtype is not "auto" (the record's, or --dtype) is
    returned as it is."""
    if config.dtype != "auto":
        return config, ""
    # torch work: never on the event loop, nor on a thread that outlives it (in_passing_thread says why)
    here = await in_passing_thread(lambda: local_choice(config))
    try:
        stored = await pin_numerics(registry, record.ref, here.to_json(), plane)
    except grpc.aio.AioRpcError as e:  # a registry without the pin (older) or unreachable: this machine's choice
        log.warning("could not pin the record's numerics; serving this machine's choice", ref=record.ref,
                    code=str(e.code()), **here.log_fields())
        return dataclasses.replace(config, dtype=here.dtype), f"{here.dtype}: not pinned ({e.code().name})"
    pinned = DtypeChoice.from_json(stored.numerics) if stored.numerics else here
    if pinned.dtype == here.dtype:
        log.info("dtype auto", ref=record.ref, pinned=stored.numerics == here.to_json(), **here.log_fields())
        return dataclasses.replace(config, dtype=here.dtype), ""
    note = (f"serves the record's {pinned.dtype} (pinned on {pinned.machine or 'another machine'}: {pinned.reason}); "
            f"this machine's fastest is {here.dtype} ({here.reason})")
    log.warning("dtype auto: serving the record's pin, not this machine's fastest", ref=record.ref, note=note,
                pinned_dtype=pinned.dtype, **here.log_fields())
    return dataclasses.replace(config, dtype=pinned.dtype), note
