"""Device choice and CPU thread sizing for the torch backend."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from tokenfleet import envs

T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    name = envs.device() or name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure_threads(requested: int | None) -> int:
    """Set torch's intra-op threads. OpenMP threads that share cores with other busy
    processes spin at barriers and slow a step 8-20x, so callers sharing the machine
    (services, load generators) should pass fewer threads than cores."""
    threads = requested or envs.num_threads() or usable_cores()
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return threads


SMALL_STEP_TOKENS = 4  # steps of at most this many tokens take small_step_threads


def small_step_threads(threads: int, requested: int | None = None) -> int:
    """Threads for a step of a few tokens (one stream's decode, a few ms on a CPU): ``requested`` (at most
    ``threads``), else every thread. Leaving a core to the service path (the worker's gRPC stream, the gateway's SSE,
    the client) looked faster for quantized weights once, but only because a second OpenMP pool in the worker made
    every parallel region sleep and wake (``in_passing_thread`` says why); without it, served on a 2-core Intel Xeon
    with AMX at one stream, the default model's GGUF took 17-18 ms a token with 2 threads a step against 25 with 1,
    and bf16 28 against 45 in process."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"small_step_threads must be >= 1, got {requested}")
        return min(requested, threads)  # never more than the worker's threads
    return threads


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device's queued work. On CUDA: through pinned
    memory, as an asynchronous copy (a copy from pageable memory waits for everything queued on the stream: the
    step in flight, which defeats overlapped scheduling, and each of a step's small input tensors, which
    serializes the host's preparation with the device's work)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


async def in_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own that ends when ``fn`` returns, awaited without blocking the event loop: for
    torch work in a serving process before its engine thread exists (afterwards, run it on the engine thread).

    Not ``asyncio.to_thread``: every thread that runs a parallel torch op keeps an OpenMP pool for as long as it
    lives, and libgomp counts every pool's threads. Once they outnumber the cores (an executor thread's pool of 2
    beside the engine thread's pool of 2, on 2 cores), it stops spinning between parallel regions and sleeps on a
    futex at each: a one-stream decode step of the default model in bf16 on a 2-core Intel Xeon with AMX took
    38-41 ms instead of 25-26 in process, and served at 38-48 ms a token (28 without the second pool). A thread
    that ends frees its pool."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=run, name="tokenfleet-torch-once", daemon=True)
    thread.start()
    try:
        return await done
    finally:
        thread.join(timeout=1.0)  # fn has returned: the thread is only ending now
