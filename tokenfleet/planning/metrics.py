"""What a simulation reports: latency percentiles, SLO attainment, utilization, cache and cost.

- TTFT: request sent -> first token at the client; TPOT: (last token - first) / (tokens - 1) per
  request; ITL: every gap between consecutive tokens of measured requests.
- SLO attainment (goodput share): measured requests whose TTFT and TPOT are within their
  objectives (``Objectives.met``: the TTFT objective may grow with the prompt, a base plus an
  allowance per prompt token); a request that never got a first token (queued, rejected) misses, and one still
  streaming when the simulation ends is judged on its tokens so far. ``goodput_rps``: those per
  second of the window. ``meets_slo``: both p99s (never-started requests count as infinite TTFT)
  are within the objectives and the cell was not overloaded (queue growing without bound).
- Utilization: the share of the window each replica spent stepping; MFU: model FLOPs / peak FLOPs
  (roofline cost models); KV: mean share of blocks in use.
- Prefix hit rate: prompt tokens served from a prefix cache / prompt tokens, over measured requests
  that were admitted (got a first token).
- Cost: GPUs x $/GPU-hour over the window, per 1M output tokens and per 1M tokens (prompt + output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenfleet.planning.costs import Roofline
from tokenfleet.planning.sim import Simulator

NEVER = 1e9  # the TTFT of a request that never started (a finite stand-in for infinity: percentiles interpolate)


@dataclass(frozen=True)
class Objectives:
    ttft_s: float = 0.7
    tpot_s: float = 0.04
    ttft_per_prompt_token_s: float = 0.0  # a long prompt cannot be prefilled in ttft_s: its objective grows

    def ttft_limit(self, prompt_tokens: int) -> float:
        return self.ttft_s + self.ttft_per_prompt_token_s * prompt_tokens

    def met(self, ttft: float | None, tpot: float | None, prompt_tokens: int) -> bool:
        """Both objectives: a request with no first token misses; one with a single token has no TPOT to miss."""
        return ttft is not None and ttft <= self.ttft_limit(prompt_tokens) and (tpot or 0.0) <= self.tpot_s


ATTAINMENT_TARGET = 0.9


def goodput_rate(curve: list[tuple[float, float]], target: float = ATTAINMENT_TARGET) -> float | None:
    """The highest offered rate at which at least ``target`` of the requests met both objectives.

    ``curve``: (offered rate, attainment) in the order the rates were stepped up. Rates past the
    first miss do not count (a lucky run above a miss is noise, not capacity); None when the lowest
    rate already missed.
    """
    best = None
    for rate, attained in sorted(curve):
        if attained < target:
            break
        best = rate
    return best


def _pct(values: Any, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(sim: Simulator, objectives: Objectives = Objectives(), dollars_per_gpu_hour: float = 2.0) -> dict[str, Any]:
    start, end = sim.window
    seconds = end - start
    measured = [t for t in sim.tracks.values() if t.measured]
    started = [t for t in measured if t.first is not None]
    finished = [t for t in started if t.done]
    # A request never started counts as an infinite TTFT; one still streaming when the simulation
    # ends is judged on its tokens so far (its TPOT up to then).
    ttft = np.array([t.ttft for t in started] + [NEVER] * (len(measured) - len(started)), dtype=float)
    tpot = np.array([v for v in (t.tpot for t in started) if v is not None], dtype=float)
    good = sum(1 for t in started if objectives.met(t.ttft, t.tpot, len(t.arrival.prompt)))
    prompt_tokens = sum(len(t.arrival.prompt) for t in measured)
    started_prompt_tokens = sum(len(t.arrival.prompt) for t in started)
    cached_tokens = sum(t.num_cached for t in started)
    output_tokens = sim.output_tokens_in_window
    replicas = list(sim.replicas.values()) + sim.retired
    gpu_hours = sim.replica_seconds * sim.fleet.gpus_per_replica / 3600  # a fixed fleet: every replica, all window
    if sim.fleet.prefill_replicas:
        gpu_hours = sim.fleet.num_gpus * seconds / 3600
    dollars = gpu_hours * dollars_per_gpu_hour
    gaps = np.frombuffer(sim.gaps, dtype=np.float64) if len(sim.gaps) else np.array([])
    meets = (not sim.overloaded and len(measured) > 0 and float(np.percentile(ttft, 99)) <= objectives.ttft_s
             and (not len(tpot) or float(np.percentile(tpot, 99)) <= objectives.tpot_s))
    return {
        "replicas": sim.fleet.replicas, "prefill_replicas": sim.fleet.prefill_replicas, "gpus": sim.fleet.num_gpus,
        "policy": sim.fleet.policy, "window_s": seconds,
        "requests": len(measured), "started": len(started), "finished": len(finished), "rejected": sim.num_rejected,
        "offered_rps": len(measured) / seconds,
        "ttft_p50_s": _finite(_pct(ttft, 50)), "ttft_p99_s": _finite(_pct(ttft, 99)),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "itl_p50_s": _pct(gaps, 50), "itl_p99_s": _pct(gaps, 99),
        "slo_attainment": good / len(measured) if measured else None,
        "goodput_rps": good / seconds,
        "meets_slo": bool(meets),
        "overloaded": sim.overloaded,
        "output_tok_s": output_tokens / seconds,
        "mean_prompt_tokens": prompt_tokens / len(measured) if measured else None,
        "prefix_hit_rate": cached_tokens / started_prompt_tokens if started_prompt_tokens else None,
        "preemptions": sum(r.scheduler.num_preemptions for r in replicas),
        "utilization": sum(r.busy_seconds for r in replicas) / sim.replica_seconds if sim.replica_seconds else 0.0,
        "kv_utilization": float(np.mean([np.mean(r.kv_samples) if r.kv_samples else 0.0 for r in replicas])),
        "mean_batch": sum(r.rows for r in replicas) / max(1, sum(r.steps for r in replicas)),
        "mean_demand_per_replica": float(np.mean(sim.demand_samples)) if sim.demand_samples else 0.0,
        "mfu": _mfu(sim, seconds),
        "remote_prefills": sim.num_remote, "transfer_gb": sim.transfer_bytes / 1e9,
        "peer_blocks": sim.num_peer_blocks, "tier_restored_blocks": sim.num_restored_blocks,
        "dollars_per_gpu_hour": dollars_per_gpu_hour, "gpu_hours": gpu_hours,
        "mean_replicas": sim.replica_seconds / seconds if not sim.fleet.prefill_replicas else sim.fleet.replicas,
        "usd_per_m_output_tokens": dollars / output_tokens * 1e6 if output_tokens else None,
        "usd_per_m_tokens": dollars / (output_tokens + prompt_tokens) * 1e6 if output_tokens + prompt_tokens else None,
    }


def _mfu(sim: Simulator, seconds: float) -> float | None:
    """Model FLOPs utilization of the cell (roofline cost models only: a profile knows no FLOPs)."""
    cost = sim.cost
    if not isinstance(cost, Roofline):
        return None
    used = sum(cost.flops(r.tokens, r.pairs, r.window_pairs) for r in sim.replicas.values())
    return used / (max(1, len(sim.replicas)) * cost.peak_flops() * seconds)


def _finite(value: float | None) -> float | None:
    return None if value is None or value >= NEVER else value
