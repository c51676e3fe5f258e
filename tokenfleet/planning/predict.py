"""``benchmarks/serve.py``'s figures predicted from a calibrated cost profile (``tokenfleet simulate calibrate``
measures one; ``benchmarks/sim_calibration.py`` checks the prediction against a real run)."""

from __future__ import annotations

from tokenfleet.planning.costs import Profile


def predict_serve(profile: Profile, concurrency: int, num_requests: int, input_tokens: int, output_tokens: int,
                  hop_seconds: float | None = None) -> dict[str, float]:
    """``benchmarks/serve.py``'s figures for one concurrency, simulated: one colocated replica with the
    profile's engine settings, C closed-loop clients, fresh prompts (no prefix hits). ``hop_seconds``
    (each way; default: half the round trip the calibration measured)."""
    if hop_seconds is None:
        hop_seconds = profile.rpc_seconds / 2
    import numpy as np

    from tokenfleet.engine.scheduler import SchedulerConfig
    from tokenfleet.planning.sim import LEAST_LOADED, FleetConfig, Simulator
    from tokenfleet.planning.workload import ClosedLoop

    engine = profile.engine
    fleet = FleetConfig(replicas=1, gpus_per_replica=1, num_blocks=int(engine["num_blocks"]),
                        block_size=int(engine["block_size"]), policy=LEAST_LOADED, hop_seconds=hop_seconds,
                        scheduler=SchedulerConfig(max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
                                                  max_num_running=int(engine["max_num_running"]),
                                                  max_num_waiting=1024, max_model_len=1 << 20))
    source = ClosedLoop(concurrency, num_requests, input_tokens, output_tokens)
    sim = Simulator(fleet, profile, source, warmup_seconds=0.0, duration_seconds=1e9, drain_seconds=0.0).run()
    tracks = [t for t in sim.tracks.values() if t.done and t.first is not None and t.last is not None]
    ttft = [t.ttft for t in tracks]
    tpot = [v for v in (t.tpot for t in tracks) if v is not None]
    wall = max(t.last or 0.0 for t in tracks) - min(t.sent for t in tracks)
    return {"concurrency": concurrency, "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1000,
            "tpot_p50_ms": float(np.percentile(tpot, 50)) * 1000,
            "out_tok_s": sum(t.num_output for t in tracks) / wall, "requests": len(tracks)}
