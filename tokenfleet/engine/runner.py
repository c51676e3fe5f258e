"""The runner interface: what the engine core needs from a backend (tokenfleet.backends.*) to run a
scheduled batch, and what it is told about the model. The one engine module models and backends
implement against."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, overload

from tokenfleet.engine.output import TokenLogprobs
from tokenfleet.engine.request import Request
from tokenfleet.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from tokenfleet.engine.kv_tier import PendingBlock


@dataclass(frozen=True)
class ExecuteResult:
    sampled: dict[str, int]  # request id -> token, for scheduled entries that sample
    logprobs: dict[str, TokenLogprobs]
    # request id -> logprobs of the prompt tokens this step's chunk predicts (prompt_logprobs set)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = dataclasses.field(default_factory=dict)
    # speculative verification: request id -> the tokens it takes after ``sampled[id]`` (and their logprobs)
    accepted: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = dataclasses.field(default_factory=dict)


class ModelRunner(Protocol):
    """What the core needs from a backend: run one scheduled batch, forget a request, and
    move blocks' KV in and out for disaggregated prefill."""

    def execute(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> ExecuteResult: ...

    def release(self, request_id: str) -> None: ...

    def kv_geometry(self) -> tuple[int, int, int, str]: ...

    def export_kv(self, layer: int, block_ids: Sequence[int]) -> tuple[bytes, bytes]: ...

    def import_kv(self, layer: int, block_ids: Sequence[int], k: bytes, v: bytes) -> None: ...


# Optional capabilities: a backend's runner has those it has; the builder hands each to the core as one of its
# parts (EngineCore's ``CoreParts``), so the core never probes a runner for a method.


class TierRunner(Protocol):
    """A runner that can move whole blocks (every layer) out of and into its pool: the second KV tier, peer fetch."""

    @overload
    def export_blocks(self, block_ids: Sequence[int], wait: Literal[True] = True) -> Sequence[bytes]: ...

    @overload
    def export_blocks(self, block_ids: Sequence[int], wait: bool) -> Sequence[bytes | PendingBlock]: ...

    def export_blocks(self, block_ids: Sequence[int], wait: bool = True) -> Sequence[bytes | PendingBlock]:
        """Each block's bytes; ``wait=False`` lets a device runner return copies still under way (bytes
        when ``wait``)."""
        ...

    def block_bytes(self) -> int: ...

    def import_blocks(self, pairs: Sequence[tuple[int, bytes]]) -> None: ...


class Launched(Protocol):
    """A step queued on the device (``OverlapRunner.launch``)."""

    def result(self) -> ExecuteResult:
        """Wait for the step's tokens."""
        ...


class OverlapRunner(Protocol):
    """A runner that queues a step without waiting for its tokens: overlapped scheduling."""

    def launch(self, output: SchedulerOutput, requests: Mapping[str, Request], carry: Launched | None = None
               ) -> Launched:
        """Queue ``output``; ``carry``: the running step whose sampled tokens are this one's inputs."""
        ...


class AdapterRunner(Protocol):
    """A runner that serves LoRA adapters."""

    def load_adapter(self, name: str, folder: str) -> None:
        """Load a PEFT adapter under ``name`` (ValueError if this model cannot serve it; OSError if unreadable)."""

    def adapter_names(self) -> tuple[str, ...]:
        """The adapters loaded, sorted."""
        ...


class CostModel(Protocol):
    """What a step costs the device, for MFU/MBU (telemetry.utilization)."""

    def step_cost(self, output: SchedulerOutput) -> tuple[float, float]:
        """The step's model FLOPs and bytes read."""
        ...

    def peaks(self) -> tuple[float, float, str]:
        """The device's peak FLOP/s and bytes/s, and where the figures come from."""
        ...


@dataclass(frozen=True)
class KernelCheck:
    """A kernel's known-answer check where it was built (tokenfleet.models.kernel_check): which implementation
    was checked, whether it agreed with the torch reference, and what serves."""

    kernel: str  # the role: "paged_attention", "layer_ops", "temperature_sampling"
    implementation: str  # what was checked, e.g. "native paged attention (AVX-512 BF16)"
    passed: bool
    max_error: float  # the largest |kernel - reference| seen (token mismatches for a sampler)
    tolerance: str
    seconds: float  # what the check cost
    detail: str = ""  # a failure: the case (shapes) and its error
    serving: str = ""  # what the engine uses in this role: the implementation, or what replaced it after a failure


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window, or 0 for full attention; () = all full
    kernel_checks: tuple[KernelCheck, ...] = ()  # the runner's kernels, checked at load
