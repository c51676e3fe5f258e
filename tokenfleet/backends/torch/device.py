"""Device choice and CPU thread sizing for the torch backend."""

from __future__ import annotations

import os

import torch

from tokenfleet import envs


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


def small_step_threads(threads: int, requested: int | None = None, quantized: bool = True) -> int:
    """Threads for a step of a few tokens (one stream's decode, a few ms on a CPU): ``requested`` (at most
    ``threads``), else, for ``quantized`` weights, one fewer than ``threads`` when those are every usable core. Such a
    step is paced by the service path too (the worker's gRPC stream, the gateway's SSE, the client), whose per-token
    work then preempts a thread mid-step and stalls the step's barriers: served on 2 cores, the default model's GGUF
    at one stream took 14.7-15.7 ms a token with 2 threads a step and 12.6-13.1 with 1 for these steps (2 for the
    rest), the same 32-stream throughput. Dense weights keep every thread: their small steps read 2-4x the bytes, so
    halving the threads costs more than the interruptions (bf16 on a 2-core Intel Xeon with AMX, in process: 45 ms
    a one-stream step on 1 thread, 28 on 2; fp32 on the 2-core Zen 3, served: no difference measured).
    Longer steps keep every thread: their compute outweighs the service's interruptions."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"small_step_threads must be >= 1, got {requested}")
        return min(requested, threads)  # never more than the worker's threads
    return threads - 1 if quantized and threads > 1 and threads >= usable_cores() else threads


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device's queued work. On CUDA: through pinned
    memory, as an asynchronous copy (a copy from pageable memory waits for everything queued on the stream: the
    step in flight, which defeats overlapped scheduling, and each of a step's small input tensors, which
    serializes the host's preparation with the device's work)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
