"""One simulated cell, fully described (hardware, cost model, fleet, traffic, window), and the
argparse flags every ``tokenfleet simulate`` command shares. Scenarios are plain frozen data, so
sweeps can run them in worker processes."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from tokenfleet.engine.scheduler import SchedulerConfig
from tokenfleet.planning.calc import DTYPE_BYTES, GB, GPUS, MODELS, WEIGHT_DTYPES, Layout, Model, resident_tokens
from tokenfleet.planning.costs import CostModel, Profile, Roofline, StepShape
from tokenfleet.planning.gguf_size import gguf_bytes_per_param
from tokenfleet.planning.metrics import Objectives, summarize
from tokenfleet.planning.sim import POLICIES, PREFIX_AWARE, FleetConfig, Simulator
from tokenfleet.planning.workload import Arrivals, ChatTraffic, Conversations, peak_rate
from tokenfleet.routing.placement import DisaggConfig


@dataclass(frozen=True)
class Scenario:
    fleet: FleetConfig
    cost: CostModel
    arrivals: Arrivals
    conversations: Conversations = field(default_factory=Conversations)
    warmup_seconds: float = 20.0
    duration_seconds: float = 60.0
    drain_seconds: float = 30.0
    seed: int = 0
    objectives: Objectives = field(default_factory=Objectives)
    dollars_per_gpu_hour: float = 2.0
    label: str = ""
    autoscale: Any = None  # a cluster.autoscale.ScalePolicy: the cell grows and shrinks (fleet.replicas to start)
    scale_start_seconds: float = 60.0  # a new replica's time to serve (weights on the node, warm-up)
    scale_interval_seconds: float = 5.0

    @property
    def nodes(self) -> int:
        return self.fleet.replicas + self.fleet.prefill_replicas

    def typical_step_seconds(self) -> float:
        """A decode step of a moderately loaded replica (256 requests at the mean prompt): how long a
        reply takes, for seeding the conversations already under way."""
        context = int(self.conversations.mean_prompt_tokens())
        return self.cost.step_seconds(StepShape(256, 256, 256, 256 * context, 256 * context))

    def with_rate_per_node(self, rate: float) -> Scenario:
        return replace(self, arrivals=replace(self.arrivals, rate=rate * self.nodes))

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        source = ChatTraffic(self.arrivals, self.conversations, seed=self.seed,
                             expected_turn_seconds=self.conversations.output_tokens * self.typical_step_seconds())
        sim = Simulator(self.fleet, self.cost, source, self.warmup_seconds, self.duration_seconds, self.drain_seconds)
        if self.autoscale is not None:
            sim.enable_autoscale(self.autoscale, self.scale_interval_seconds, self.scale_start_seconds)
        sim.run()
        summary = summarize(sim, self.objectives, self.dollars_per_gpu_hour)
        summary.update(label=self.label, pattern=self.arrivals.pattern, rate=self.arrivals.rate,
                       rate_per_node=self.arrivals.rate / self.nodes, nodes=self.nodes,
                       simulated_s=sim.now, wall_s=time.perf_counter() - started,
                       replica_timeline=sim.replica_timeline if self.autoscale is not None else [])
        return summary


def run_all(scenarios: list[Scenario], jobs: int = 1) -> list[dict[str, Any]]:
    """Run scenarios, ``jobs`` at a time in worker processes (cells are independent)."""
    if jobs <= 1 or len(scenarios) <= 1:
        return [s.run() for s in scenarios]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(Scenario.run, scenarios))


# ---- flags ------------------------------------------------------------------------------------------------------
def add_hardware_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model, hardware and cost model")
    g.add_argument("--model", default="llama3-70b", help=f"a preset ({', '.join(MODELS)}) or an HF config.json")
    g.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    g.add_argument("--tp", type=int, default=8, help="GPUs per replica (one replica per node at 8)")
    g.add_argument("--weight-dtype", default="fp8", choices=sorted(WEIGHT_DTYPES),
                   help="gguf: a GGUF's own block types (--gguf FILE, else planning.calc.GGUF_DEFAULT_BITS)")
    g.add_argument("--gguf", metavar="FILE", help="weights as this GGUF ships them: bytes per parameter from its tensor "
                                                  "types (sets --weight-dtype gguf)")
    g.add_argument("--kv-dtype", default="fp8", choices=sorted(DTYPE_BYTES))
    g.add_argument("--reserve-gb", type=float, default=10.0, help="per replica: activations, graphs, headroom")
    g.add_argument("--prefill-efficiency", type=float, default=0.5, help="share of peak FLOP/s a prefill reaches")
    g.add_argument("--decode-efficiency", type=float, default=0.7, help="share of HBM bandwidth a decode reaches")
    g.add_argument("--step-overhead-ms", type=float, default=2.0, help="fixed cost of every step")
    g.add_argument("--profile", help="a measured cost profile (tokenfleet simulate calibrate) instead of the roofline; "
                                     "its engine settings (block size, KV blocks, batch limits) apply")


def add_fleet_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the cell")
    g.add_argument("--replicas", type=int, default=8, help="colocated replicas, or the decode pool with --prefill-replicas")
    g.add_argument("--prefill-replicas", type=int, default=0, help="a separate prefill pool of this size (P/D)")
    g.add_argument("--policy", default=PREFIX_AWARE, choices=POLICIES)
    g.add_argument("--block-size", type=int, default=32)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--max-num-running", type=int, default=1024)
    g.add_argument("--min-uncached-tokens", type=int, default=DisaggConfig().min_uncached_tokens,
                   help="P/D: shorter uncached prompts are prefilled on the decode replica")
    g.add_argument("--link-gbps", type=float, default=400.0, help="prefill -> decode KV transfer bandwidth, Gbit/s")
    g.add_argument("--hop-ms", type=float, default=2.0, help="gateway + router + RPC latency before a request starts")
    g.add_argument("--tier-gb", type=float, default=0.0,
                   help="a second KV tier per replica (host memory), GB; blocks the pool evicts are restored from it")
    g.add_argument("--tier-gbytes-per-s", type=float, default=100.0, help="restoring from that tier, GB/s per replica")
    g.add_argument("--peer-fetch", action="store_true",
                   help="the replica computing a prompt pulls the leading blocks another holds (P/D: from the decode "
                   "replica, which holds its replies) over --link-gbps")


def add_traffic_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("traffic (the headline by default: 10M daily users x 15 turns, ~5k req/s at peak)")
    g.add_argument("--daily-users", type=float, default=10e6)
    g.add_argument("--turns-per-day", type=float, default=15.0)
    g.add_argument("--peak-factor", type=float, default=2.88, help="peak rate / the day's mean rate")
    g.add_argument("--fleet-nodes", type=int, help="the fleet's size: the cell gets its share of the peak rate")
    g.add_argument("--rate", type=float, help="requests/s offered to the cell (instead of --fleet-nodes)")
    g.add_argument("--pattern", default="poisson", choices=["poisson", "bursty", "diurnal"])
    g.add_argument("--burst-cv", type=float, default=3.0)
    g.add_argument("--day-seconds", type=float, default=600.0, help="diurnal: one compressed day")
    g.add_argument("--trough-ratio", type=float, default=0.35, help="diurnal: the quietest hour's rate / the peak's "
                   "(a raised cosine between them: the day's mean is (1 + this) / 2 of the peak)")
    g.add_argument("--tenants", type=int, default=32)
    g.add_argument("--system-tokens", type=int, default=1000)
    g.add_argument("--user-tokens", type=int, default=120)
    g.add_argument("--output-tokens", type=int, default=400)
    g.add_argument("--turns", type=float, default=4.6, help="mean turns per conversation")
    g.add_argument("--think-seconds", type=float, default=30.0)


def add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the run")
    g.add_argument("--warmup", type=float, default=20.0, help="simulated seconds before measuring")
    g.add_argument("--duration", type=float, default=60.0, help="simulated seconds measured")
    g.add_argument("--drain", type=float, default=30.0, help="at most this long after the window for its requests")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ttft-slo-ms", type=float, default=700.0)
    g.add_argument("--tpot-slo-ms", type=float, default=40.0)
    g.add_argument("--usd-per-gpu-hour", type=float, default=2.0)


def add_scenario_flags(p: argparse.ArgumentParser) -> None:
    """Every flag a scenario reads (``scenario_from_args``)."""
    for add in (add_hardware_flags, add_fleet_flags, add_traffic_flags, add_run_flags):
        add(p)


def hardware(args: argparse.Namespace) -> tuple[Model, Layout]:
    model = MODELS[args.model] if args.model in MODELS else Model.from_config(args.model)
    gguf = getattr(args, "gguf", None)  # a namespace built without add_hardware_flags has none
    layout = Layout(GPUS[args.gpu], args.tp, 1, "gguf" if gguf else args.weight_dtype, args.kv_dtype,
                    args.reserve_gb * GB, args.prefill_efficiency, args.decode_efficiency,
                    gguf_bytes_per_param(gguf) if gguf else None)
    return model, layout


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    model, layout = hardware(args)
    conversations = Conversations(args.tenants, args.system_tokens, args.user_tokens, args.output_tokens,
                                  turns=args.turns, think_seconds=args.think_seconds)
    cost: CostModel
    engine: dict[str, Any] = {"block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
                              "max_num_running": args.max_num_running}
    # a roofline charges sliding-window layers their window only; a profile measured our engine, which
    # keeps every layer's whole context
    kv = _kv_geometry(model, args.kv_dtype)
    # the block manager counts tokens: a token is charged the mean KV of a request at the typical
    # context (prompt + reply), which is less than full-context KV for a model with a window
    context: int | None = int(conversations.mean_prompt_tokens()) + args.output_tokens
    if args.profile:
        profile = Profile.load(args.profile)
        cost = profile
        engine.update({k: profile.engine[k] for k in ("block_size", "num_blocks", "max_num_batched_tokens",
                                                      "max_num_running") if k in profile.engine})
        kv = {"kv_bytes_per_token": float(profile.engine.get("kv_bytes_per_token",
                                                             model.kv_bytes_per_token(args.kv_dtype)))}
        context = None
    else:
        cost = Roofline(model, layout, args.step_overhead_ms / 1000)
    num_blocks = engine.get("num_blocks") or resident_tokens(model, layout, context=context) // engine["block_size"]
    if num_blocks < 1:
        raise SystemExit(f"{model.name} leaves no KV memory on {layout.num_gpus} x {layout.gpu.name}")
    fleet = FleetConfig(
        replicas=args.replicas, prefill_replicas=args.prefill_replicas, gpus_per_replica=layout.num_gpus,
        num_blocks=int(num_blocks), block_size=int(engine["block_size"]),
        scheduler=SchedulerConfig(max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
                                  max_num_running=int(engine["max_num_running"]), max_num_waiting=1_000_000,
                                  max_model_len=1 << 20),
        policy=args.policy, disagg=DisaggConfig(args.min_uncached_tokens), **kv,
        link_bytes_per_s=args.link_gbps * 1e9 / 8, hop_seconds=args.hop_ms / 1000,
        tier_blocks=int(args.tier_gb * 1e9 / (kv["kv_bytes_per_token"] * int(engine["block_size"]))),
        tier_bytes_per_s=args.tier_gbytes_per_s * 1e9, peer_fetch=args.peer_fetch)
    nodes = args.replicas + args.prefill_replicas
    fleet_peak = peak_rate(args.daily_users, args.turns_per_day, args.peak_factor)
    if args.rate:
        rate = args.rate
    elif args.fleet_nodes:
        rate = fleet_peak * nodes / args.fleet_nodes
    else:
        raise SystemExit("name the cell's load: --fleet-nodes N (its share of the peak) or --rate R")
    arrivals = Arrivals(args.pattern, rate, args.burst_cv, args.day_seconds, args.trough_ratio)
    return Scenario(fleet, cost, arrivals, conversations, args.warmup, args.duration, args.drain, args.seed,
                    Objectives(args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000), args.usd_per_gpu_hour)


def _kv_geometry(model: Model, kv_dtype: str) -> dict[str, Any]:
    """FleetConfig's KV fields for ``model``: its window and per-token KV of full-context and of
    sliding-window layers (what transfers move, and which step shapes count a window)."""
    per_layer = model.kv_bytes_per_layer_token(kv_dtype)
    return {"kv_bytes_per_token": model.num_global_layers * per_layer, "sliding_window": model.window,
            "window_kv_bytes_per_token": model.num_sliding_layers * per_layer}
