"""What one engine step costs, in place of the model runner (the fleet simulator's clock).

A step's cost depends on its shape, read from the real scheduler's output: tokens computed,
rows that sample, attention work (query x key pairs) and KV read (keys each row attends to), the
last two also as a sliding-window layer counts them (each query sees at most the window's keys).
Two models give seconds for a shape:

- ``Roofline``: ``tokenfleet plan``'s arithmetic for a model on a GPU layout. Compute (2 FLOPs
  per weight per token plus attention) at a share of peak, memory (weights once plus every
  row's KV) at a share of HBM bandwidth, TP all-reduce traffic over NVLink; the step takes the
  largest of the three (they overlap) plus a fixed per-step overhead (host scheduling, kernel
  launches, all-reduce latency).
- ``Profile``: coefficients measured from our own engine (``tokenfleet simulate calibrate``):
  ``seconds = base + per_token x tokens + per_sample x samples + per_pair x pairs + per_kv x kv``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tokenfleet.engine.scheduler import SchedulerOutput
from tokenfleet.planning.calc import DTYPE_BYTES, Layout, Model, attended_keys, attention_pairs


@dataclass(frozen=True)
class StepShape:
    tokens: int = 0  # tokens computed (prompt chunks + one per decoding request)
    rows: int = 0  # requests in the batch
    samples: int = 0  # tokens sampled (rows reaching their end, plus forked samples)
    pairs: int = 0  # attention (query, key) pairs, causal
    kv: int = 0  # keys read: each row's context after the step
    # pairs and keys read in a layer of sliding window ``window`` (None: not counted; a cost model
    # that needs them takes the rows as equal, see ``window_counts``)
    window: int | None = None
    window_pairs: int | None = None
    window_kv: int | None = None

    @classmethod
    def of(cls, output: SchedulerOutput, window: int | None = None) -> StepShape:
        """``window``: also count a sliding-window layer's work (the model's window)."""
        tokens = samples = pairs = kv = window_pairs = window_kv = 0
        for entry in output.scheduled:
            n, start = entry.num_new_tokens, entry.start
            tokens += n
            pairs += n * start + n * (n + 1) // 2
            kv += start + n
            if window is not None:
                window_pairs += attention_pairs(start, n, window)
                window_kv += attended_keys(start, n, window)
            if entry.samples:
                samples += 1 + len(entry.forks)
        if window is None:
            return cls(tokens, len(output.scheduled), samples, pairs, kv)
        return cls(tokens, len(output.scheduled), samples, pairs, kv, window, window_pairs, window_kv)

    def window_counts(self, window: int) -> tuple[int, int]:
        """(pairs, keys read) in a layer of sliding window ``window``: as counted, or for a shape built
        without them (by hand, or for another window) as if its rows were equal: each computing
        ``tokens / rows`` new tokens at the end of ``kv / rows`` (exact for a lone prompt or a decode
        batch at one context)."""
        if self.window == window and self.window_pairs is not None and self.window_kv is not None:
            return self.window_pairs, self.window_kv
        rows = max(self.rows, 1)
        n, end = self.tokens // rows, self.kv // rows
        start = max(0, end - n)
        return rows * attention_pairs(start, end - start, window), rows * attended_keys(start, end - start, window)


class CostModel(Protocol):
    def step_seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class Roofline:
    model: Model
    layout: Layout
    step_overhead_s: float = 0.002  # host + launches + 2 all-reduce latencies per layer (CUDA graphs lower it)

    def flops(self, tokens: int, pairs: int, window_pairs: int | None = None) -> float:
        """Model FLOPs of computing ``tokens`` with ``pairs`` attention pairs (weights and attention);
        ``window_pairs``: a sliding-window layer's pairs (default: the same)."""
        return 2 * self.model.num_params * tokens + self.model.attention_flops(pairs, window_pairs)

    def peak_flops(self) -> float:
        """Of one replica (all its GPUs), at the weights' dtype."""
        return self.layout.num_gpus * self.layout.gpu.flops(self.layout.weight_dtype)

    def step_seconds(self, shape: StepShape) -> float:
        m, lay = self.model, self.layout
        n = lay.num_gpus
        window_pairs, window_kv = shape.window_counts(m.window) if m.window else (shape.pairs, shape.kv)
        compute = self.flops(shape.tokens, shape.pairs, window_pairs) / (self.peak_flops() * lay.prefill_efficiency)
        keys = m.num_global_layers * shape.kv + m.num_sliding_layers * window_kv  # summed over layers
        read = lay.weight_bytes(m) + keys * m.kv_bytes_per_layer_token(lay.kv_dtype)
        memory = read / (n * lay.gpu.hbm_bytes_per_s * lay.decode_efficiency)
        comms = 0.0
        if lay.tp > 1:
            volume = 2 * (lay.tp - 1) / lay.tp * shape.tokens * m.hidden_size * DTYPE_BYTES["bf16"]
            comms = 2 * m.num_layers * volume / lay.gpu.nvlink_bytes_per_s
        return max(compute, memory, comms) + self.step_overhead_s


FEATURES = ("base", "per_token", "per_sample", "per_pair", "per_kv")


@dataclass(frozen=True)
class Profile:
    """A measured linear cost model, with the engine settings it was measured under (the simulated
    replica runs the scheduler with the same ones)."""

    base: float
    per_token: float
    per_sample: float
    per_pair: float
    per_kv: float
    rpc_seconds: float = 0.0  # the measuring client's round trip (not a step cost; a hop estimate)
    engine: Mapping[str, Any] = field(default_factory=dict)  # block_size, num_blocks, max_num_batched_tokens, ...
    fit: Mapping[str, Any] = field(default_factory=dict)  # how well it fits its measurements

    def step_seconds(self, shape: StepShape) -> float:
        return (self.base + self.per_token * shape.tokens + self.per_sample * shape.samples
                + self.per_pair * shape.pairs + self.per_kv * shape.kv)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2, default=dict) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        missing = [k for k in FEATURES if k not in data]
        if missing:
            raise ValueError(f"{path}: not a cost profile (missing {', '.join(missing)})")
        return cls(**{k: data[k] for k in (*FEATURES, "rpc_seconds", "engine", "fit") if k in data})


def features(shape: StepShape) -> list[float]:
    return [1.0, shape.tokens, shape.samples, shape.pairs, shape.kv]


def fit_profile(shapes: list[StepShape], seconds: list[float], engine: Mapping[str, Any],
                extra: list[float] | None = None) -> Profile:
    """Least squares with non-negative coefficients (a feature whose coefficient comes out negative
    is dropped and the rest refitted: a negative cost per token is noise, not physics). ``extra``: a
    further 0/1 column per measurement whose coefficient is the measuring client's RPC round trip
    (measurements that include one)."""
    import numpy as np

    columns = [features(s) + ([extra[i]] if extra is not None else []) for i, s in enumerate(shapes)]
    x = np.array(columns, dtype=float)
    y = np.array(seconds, dtype=float)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            coef[:] = 0
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    error = np.abs(x @ coef - y) / np.maximum(y, 1e-9)
    fit = {"measurements": len(y), "median_rel_error": float(np.median(error)),
           "p90_rel_error": float(np.percentile(error, 90)),
           "points": [[*(int(v) for v in row[1:len(FEATURES)]), round(float(t), 5), round(float(p), 5)]
                      for row, t, p in zip(x, y, x @ coef, strict=True)]}  # [tokens, samples, pairs, kv, s, fitted]
    rpc = float(coef[len(FEATURES)]) if extra is not None else 0.0
    coefficients = {name: float(c) for name, c in zip(FEATURES, coef, strict=False)}
    return Profile(**coefficients, rpc_seconds=rpc, engine=dict(engine), fit=fit)
