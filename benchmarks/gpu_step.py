"""GPU data plane: full engine steps next to the H100 roofline. One script, under 10 minutes.

Measures the card first (HBM bandwidth from a large device-to-device copy, counting bytes read and
written; the bf16 matmul peak from 8192^3 products), then for each model geometry (random weights:
SmolLM2-135M's and Llama-3.1-8B's) and each mode:

- eager:        the engine with CUDA graphs off (the Triton attention kernel either way)
- eager-torch:  graphs off and the torch reference attention: the engine as it was before this issue
- graphs:       decode steps replayed from captured CUDA graphs
- graphs-fp8:   graphs with FP8 (e4m3) weights, per-channel scales: steps of up to 16 rows through the Triton
                weight-only kernel (models.triton_linear), larger ones through torch._scaled_mm
- graphs-fp8kv: graphs with bf16 weights and an FP8 KV cache (e4m3, a scale per token and KV head: models.kv_fp8)
- graphs-fp8-fp8kv: FP8 weights and the FP8 KV cache
- graphs-overlap: graphs with overlapped scheduling (CoreParts.overlap: the next decode step is queued on
  the device before the host reads this one's tokens)
- graphs-fp8-overlap: FP8 weights, graphs and overlapped scheduling

--mixed-prompt N: after each decode run, the same batch again while a fresh N-token prompt arrives every
--mixed-every steps (stopping after its first token); the steps holding its prefill chunk are timed apart ("mixed"
steps: eager, or with --mixed-graphs 0,1 also replayed from backends.torch.mixed_graphs' graphs).

"replay ms" is the GPU time of the step's graph alone (the same graph replayed back to back after the timed
steps, CUDA events around 20 replays): step - replay is the time the GPU waits for the host each step.

decode: B requests with distinct 1,024-token prompts are prefilled (not timed), then >= --steps full
engine steps (scheduler, runner, sampler, output processing: ``EngineCore.step``) are timed one by one
on the host clock; the figure is the median. The GPU time of the forward inside each step (CUDA events
around it) gives the host's share: step - forward is time the GPU waits for Python.
prefill: one fresh 4,096-token prompt in one step, median of 3.

Roofline per row: bytes a step must read (every weight once + the batch's K/V) / measured bandwidth,
and FLOPs / measured matmul peak; the larger is the floor, and floor / step is the efficiency.

    PYTHONPATH=$PWD python3 benchmarks/gpu_step.py --out DIR      # on the GPU machine
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving.gpu_runs import (  # noqa: E402
    decode_run,
    linear_params,
    measure_card,
    mixed_run,
    prefill_run,
    step_roofline,
)

from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.models.config import ModelConfig  # noqa: E402

GEOMETRIES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}
MODES = ("eager-torch", "eager", "graphs", "graphs-fp8", "graphs-fp8kv", "graphs-fp8-fp8kv", "graphs-overlap",
         "graphs-fp8-overlap")


def fp8_weights(mode: str) -> bool:
    return mode.endswith("-fp8") or "-fp8-" in mode


def fp8_kv(mode: str) -> bool:
    return mode.endswith("fp8kv")


# (geometry, FP8 weights?) -> the random weights built for it: variants that differ only in kernels and settings
# share them, so --rounds can keep a dozen 8B engines on one card (cleared per geometry)
SHARED_WEIGHTS: dict[tuple[str, bool], object] = {}


def model_for(geometry: str, mode: str):  # type: ignore[no-untyped-def]
    """A model of ``geometry`` for ``mode``: its kernels chosen now (under the variant's settings), its weights the
    ones already built for the same geometry and weight format if any."""
    from tokenfleet.models.kv_fp8 import check_device
    from tokenfleet.models.layer_ops import select_layer_ops
    from tokenfleet.models.linear import select_linear
    from tokenfleet.models.llama import LlamaModel
    from tokenfleet.models.loader import random_model, select_attention

    config = ModelConfig.from_dict(GEOMETRIES[geometry])
    quantization, kv_dtype, device = "fp8" if fp8_weights(mode) else "", "fp8" if fp8_kv(mode) else "", torch.device("cuda")
    weights = SHARED_WEIGHTS.get((geometry, bool(quantization)))
    if weights is None:
        model = random_model(config, torch.bfloat16, device, quantization, kv_cache_dtype=kv_dtype)
        SHARED_WEIGHTS[(geometry, bool(quantization))] = model.weights
        return model
    device = weights.embed.device  # type: ignore[attr-defined]
    check_device(kv_dtype, device)
    model = LlamaModel(config, weights, torch.bfloat16, device, select_linear(torch.bfloat16, device, quantization),
                       select_attention(torch.bfloat16, device, kv_dtype), select_layer_ops(config, torch.bfloat16, device))
    model.kv_cache_dtype = kv_dtype
    return model


def mode_env(mode: str) -> dict[str, str]:
    """The settings a mode's engine is built and stepped under (the Triton logits kernels read TOKENFLEET_KERNELS at
    every step: an eager-torch engine measured between others must get its own back)."""
    return {"TOKENFLEET_KERNELS": "torch" if mode == "eager-torch" else "auto",
            "TOKENFLEET_CUDA_GRAPHS": "1" if mode.startswith("graphs") else "0"}


def build(geometry: str, mode: str, batch_cap: int, num_blocks: int, max_model_len: int):
    from tokenfleet.backends.torch.runner import TorchModelRunner
    from tokenfleet.engine.block_manager import BlockManager
    from tokenfleet.engine.core import CoreParts, EngineCore
    from tokenfleet.engine.runner import ModelInfo
    from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig

    os.environ.update(mode_env(mode))
    config = ModelConfig.from_dict(GEOMETRIES[geometry])
    model = model_for(geometry, mode)
    runner = TorchModelRunner(model, num_blocks, 16, cuda_graph_batch=batch_cap, max_model_len=max_model_len,
                              mixed_graph_tokens=8192)  # TOKENFLEET_CUDA_GRAPHS_MIXED=1: up to 2,048 (mixed_graphs)
    t0 = time.perf_counter()
    runner.capture_graphs()
    capture_s = time.perf_counter() - t0
    sched = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=8192, max_num_running=batch_cap,
                            max_num_waiting=4096)
    core = EngineCore(Scheduler(sched, BlockManager(num_blocks, 16), hash_salt=f"{geometry}|{mode}"), runner, None,
                      ModelInfo(vocab_size=config.vocab_size, max_model_len=max_model_len, eos_token_ids=()),
                      CoreParts(overlap=runner if mode.endswith("overlap") else None))
    return config, runner, core, capture_s


def profile_run(geometry: str, mode: str, batch: int, context: int) -> str:
    """Kernel-level breakdown of ``batch``-request decode steps (torch profiler; kernels inside graph replays are
    listed one by one): where the step's GPU time goes."""
    from torch.profiler import ProfilerActivity, profile

    from tokenfleet.engine.sampling_params import SamplingParams

    config = ModelConfig.from_dict(GEOMETRIES[geometry])
    blocks = batch * -(-(context + 128) // 16) + 64
    config, runner, core, _ = build(geometry, mode, max(batch, 8), blocks, context + 256)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(RequestSpec([rng.randrange(100, config.vocab_size) for _ in range(context)], params,
                                     request_id=f"prof{i}"))
    for _ in range(40):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            core.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70)
    del runner, core
    SHARED_WEIGHTS.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return table


# settings read when a model is built (tokenfleet.envs): each variant's replace the caller's, then go
VARIANT_ENV = {"attn_pv": ("TOKENFLEET_ATTN_PV", ",", "pv"), "attn_tuning": ("TOKENFLEET_ATTN_TUNING", ";", "tune"),
               "fp8_matmul": ("TOKENFLEET_FP8_MATMUL", ";", "fp8mm"),
               "bf16_matmul": ("TOKENFLEET_BF16_MATMUL", ";", "bf16mm"),
               "mixed_graphs": ("TOKENFLEET_CUDA_GRAPHS_MIXED", ",", "mixed"),
               "logits_kernels": ("TOKENFLEET_LOGITS_KERNELS", ",", "logits"),
               "attn_merge": ("TOKENFLEET_ATTN_MERGE", ",", "merge")}


def set_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def variants(args) -> list[tuple[str, str, dict[str, str]]]:  # type: ignore[no-untyped-def]
    """(mode, row label, environment) for each mode x --attn-pv x --attn-tuning x --fp8-matmul x --bf16-matmul x
    --mixed-graphs x --logits-kernels x --attn-merge: the kernels read TOKENFLEET_ATTN_PV, TOKENFLEET_ATTN_TUNING and
    the matmul settings when a model is built, TOKENFLEET_LOGITS_KERNELS when a graph is captured and at each eager
    step."""
    out = [(mode, mode, {}) for mode in args.modes.split(",")]
    for attr, (key, sep, short) in VARIANT_ENV.items():
        values = [v for v in getattr(args, attr).split(sep) if v] or [""]

        def applies(mode: str, attr: str = attr) -> bool:  # else the variants would be the same engine again
            if attr == "fp8_matmul":
                return fp8_weights(mode)
            if attr == "bf16_matmul":
                return not fp8_weights(mode) and mode != "eager-torch"
            if attr == "mixed_graphs":  # only --mixed-prompt's runs have steps with prefill chunks, without overlap
                return mode.startswith("graphs") and not mode.endswith("overlap")
            return mode != "eager-torch"

        out = [(mode, label + (f"[{short}={v}]" if v else ""), {**env, **({key: v} if v else {})})
               for mode, label, env in out for v in (values if applies(mode) else [""])]
    return out


def run_order(labels: list[str], batches: list[int], rounds: int) -> list[tuple[int, str, int]]:
    """(round, variant, batch) in the order measured: each round runs every variant's batches, variants in turn,
    and odd rounds run the variants in reverse (so neither side of a ratio always goes first)."""
    order = []
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            order += [(r, label, b) for b in batches]
    return order


def medians(rows: list[dict]) -> list[dict]:
    """One row per (geometry, mode, batch): the median step over the rounds, every round's step kept in ``runs_ms``."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["geometry"], r["mode"], r["batch"]), []).append(r)
    out = []
    for runs in groups.values():
        runs = sorted(runs, key=lambda r: r["step_ms"])
        mid = dict(runs[(len(runs) - 1) // 2])  # the lower median: a real run, its other figures consistent with it
        mid.update(runs_ms=[r["step_ms"] for r in sorted(runs, key=lambda r: r["round"])], rounds=len(runs))
        mixed = [r["mixed"] for r in sorted(runs, key=lambda r: r["round"]) if "mixed" in r]
        if len(mixed) > 1:  # the mixed steps' own medians over the rounds, every round kept
            mid["mixed"] = {**mixed[0], "mixed_step_ms": statistics.median(m["mixed_step_ms"] for m in mixed),
                            "decode_step_ms": statistics.median(m["decode_step_ms"] for m in mixed),
                            "mixed_replays": sum(m["mixed_replays"] for m in mixed),
                            "mixed_steps": sum(m["mixed_steps"] for m in mixed),
                            "runs_ms": [(m["mixed_step_ms"], m["decode_step_ms"]) for m in mixed]}
        out.append(mid)
    return out


def measure(results: dict, geometry: str, label: str, mode: str, built, b: int, args, card: dict, num_blocks: int,
            seed: int, rnd: int = 0) -> None:  # type: ignore[no-untyped-def]
    config, runner, core, capture_s = built
    if b * -(-(args.context + args.steps + 16) // 16) > num_blocks:
        results["errors"].append(f"{geometry} {label} b={b}: {num_blocks} blocks are too few")
        return
    try:
        row = decode_run(core, runner, config, b, args.context, args.steps, seed=seed)
    except Exception as e:
        results["errors"].append(f"{geometry} {label} b={b}: {type(e).__name__}: {e}")
        print(results["errors"][-1], flush=True)
        return
    roof = step_roofline(config, b, row["context_mid"], fp8_weights(mode), card, fp8_kv(mode))
    row.update(geometry=geometry, mode=label, capture_s=capture_s, roofline_ms=roof["floor_ms"], round=rnd,
               bytes=roof["bytes"], flops=roof["flops"], efficiency=roof["floor_ms"] / row["step_ms"],
               hbm_share=roof["bytes"] / card["hbm_bytes_per_s"] * 1000 / row["step_ms"])
    results["runs"].append(row)
    print(f"{geometry:13s} {label:11s} b={b:3d} round {rnd} step {row['step_ms']:8.3f} ms "
          f"(p90 {row['p90_step_ms']:.3f}) fwd-gpu {row['forward_gpu_ms']:7.3f} ms  floor {roof['floor_ms']:7.3f} ms  "
          f"eff {row['efficiency']:.0%}  replays {row['graph_replays']}", flush=True)
    if args.mixed_prompt and not mode.endswith("overlap"):
        try:
            row["mixed"] = mixed_run(core, runner, config, b, args.context, args.steps, args.mixed_prompt,
                                     args.mixed_every, seed=seed + 7)
        except Exception as e:
            results["errors"].append(f"{geometry} {label} b={b} mixed: {type(e).__name__}: {e}")
            print(results["errors"][-1], flush=True)
            return
        m = row["mixed"]
        print(f"{geometry:13s} {label:11s} b={b:3d} round {rnd} with a {m['prompt_len']}-token chunk "
              f"{m['mixed_step_ms']:8.3f} ms, without {m['decode_step_ms']:8.3f} ms, mixed replays "
              f"{m['mixed_replays']}/{m['mixed_steps']}", flush=True)


def prefill(results: dict, geometry: str, label: str, mode: str, built, args, card: dict) -> None:  # type: ignore[no-untyped-def]
    config, _, core, _ = built
    if not args.prefill or mode not in ("eager", "graphs-fp8"):
        return
    try:
        pre = prefill_run(core, config, args.prefill, seed=7)
        pre.update(geometry=geometry, mode=label, peak_share=pre["flops_per_s"] / card["bf16_matmul_flops"])
        results["prefill"].append(pre)
        print(f"{geometry:13s} {label:11s} prefill {args.prefill}: {pre['seconds'] * 1000:.1f} ms "
              f"{pre['tok_s']:.0f} tok/s {pre['flops_per_s'] / 1e12:.0f} TFLOP/s = {pre['peak_share']:.0%} of peak",
              flush=True)
    except Exception as e:
        results["errors"].append(f"{geometry} {label} prefill: {type(e).__name__}: {e}")
        print(results["errors"][-1], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/reports")
    p.add_argument("--geometries", default=",".join(GEOMETRIES))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--torch-batches", default="1", help="batches for eager-torch (the old path is slow)")
    p.add_argument("--name", default="gpu-step")
    p.add_argument("--attn-pv", default="", help="comma-separated TOKENFLEET_ATTN_PV values to measure each mode with")
    p.add_argument("--attn-tuning", default="", help="semicolon-separated TOKENFLEET_ATTN_TUNING values "
                   "(block_n,partition,num_warps,num_stages) to measure each mode with")
    p.add_argument("--fp8-matmul", default="", help="semicolon-separated TOKENFLEET_FP8_MATMUL values "
                   "(rows,block_n,block_k,num_warps,num_stages; rows 0: torch._scaled_mm only) for each mode")
    p.add_argument("--rounds", type=int, default=1,
                   help=">1: build every variant of a geometry first and keep them all on the GPU, then run their "
                        "batches in turn that many rounds (reversed on odd rounds); rows are the median round")
    p.add_argument("--mixed-graphs", default="", help="comma-separated TOKENFLEET_CUDA_GRAPHS_MIXED values (0,1) "
                   "to measure each mode with")
    p.add_argument("--bf16-matmul", default="", help="semicolon-separated TOKENFLEET_BF16_MATMUL values (as "
                   "--fp8-matmul's, for bf16 weights; rows 0: cuBLAS only, the default) for each bf16 mode")
    p.add_argument("--attn-merge", default="", help="comma-separated TOKENFLEET_ATTN_MERGE values (kernel,fused: the "
                   "split-K partitions merged by a second kernel or by the last partition) to measure each mode with")
    p.add_argument("--logits-kernels", default="", help="comma-separated TOKENFLEET_LOGITS_KERNELS values (1,0: "
                   "models.triton_logits against torch's topk and argmax) to measure each mode with")
    p.add_argument("--mixed-prompt", type=int, default=0, help="> 0: after each decode run, the same batch with a "
                   "fresh prompt of this many tokens arriving every --mixed-every steps; steps holding its prefill "
                   "chunk timed apart (modes without overlap)")
    p.add_argument("--mixed-every", type=int, default=4)
    p.add_argument("--profile", default="", help="GEOMETRY:MODE:BATCH,...: torch-profiler kernel tables, 20 steps each")
    args = p.parse_args()
    if args.rounds == 2:
        p.error("--rounds 2 has no median: 1, or 3 and more")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    card = measure_card()
    print(f"card: {card['device']}  HBM {card['hbm_bytes_per_s'] / 1e12:.2f} TB/s  bf16 matmul "
          f"{card['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s  torch {card['torch']}", flush=True)
    results: dict = {"card": card, "args": vars(args), "rows": [], "runs": [], "prefill": [], "errors": []}
    stamp = time.strftime("%Y-%m-%d")  # one name for the whole run, past midnight too
    caller_env = {key: os.environ.get(key) for key, _, _ in VARIANT_ENV.values()}
    batches = [int(b) for b in args.batches.split(",")]
    todo = variants(args)

    def save() -> None:
        results["rows"] = medians(results["runs"])
        (out / f"{stamp}-{args.name}.json").write_text(json.dumps(results, indent=1))

    for geometry in args.geometries.split(","):
        config_probe = ModelConfig.from_dict(GEOMETRIES[geometry])
        max_model_len = args.context + args.steps + 64
        if args.prefill:
            max_model_len = max(max_model_len, args.prefill + 16)
        per_block = 16 * 2 * config_probe.num_layers * config_probe.num_kv_heads * config_probe.head_dim * 2
        want = max(batches) * -(-(args.context + args.steps + 16) // 16) + 64
        free = torch.cuda.mem_get_info()[0]
        head = 2 * config_probe.vocab_size * config_probe.hidden_size * 2  # embedding + LM head, bf16
        kinds = {fp8_weights(mode) for mode, _, _ in todo}  # weights built once per format (SHARED_WEIGHTS)
        per_format = [linear_params(config_probe) * (1 if fp8 else 2) + head for fp8 in kinds]
        resident = len(todo) if args.rounds > 1 else 1  # engines on the GPU at once share what is free
        weights = sum(per_format) if args.rounds > 1 else max(per_format)  # all formats resident, or one at a time
        num_blocks = int(min(want, (free - weights - (6 << 30) * (1 + (resident - 1) // 4)) // resident // per_block))
        mode_batches = {label: [b for b in batches if mode != "eager-torch" or str(b) in args.torch_batches.split(",")]
                        for mode, label, _ in todo}

        def build_variant(mode: str, label: str, env: dict[str, str]):  # type: ignore[no-untyped-def]
            set_env({**caller_env, **env})
            try:
                return build(geometry, mode, max(batches), num_blocks, max_model_len)
            except Exception as e:  # one mode failing must not cost the others' figures
                results["errors"].append(f"{geometry} {label} build: {type(e).__name__}: {e}")
                print(results["errors"][-1], flush=True)
                return None

        if args.rounds <= 1:  # one engine at a time: as much KV as the card holds for each
            for mode, label, env in todo:
                built = build_variant(mode, label, env)
                if built is None:
                    continue
                for b in mode_batches[label]:
                    measure(results, geometry, label, mode, built, b, args, card, num_blocks, seed=b)
                prefill(results, geometry, label, mode, built, args, card)
                del built
                SHARED_WEIGHTS.clear()  # one engine at a time: as much KV as the card holds for each
                save()  # so far
                gc.collect()
                torch.cuda.empty_cache()
            continue
        least = min(batches) * -(-(args.context + args.steps + 16) // 16)
        if num_blocks < least:
            results["errors"].append(f"{geometry}: {len(todo)} resident engines leave {max(num_blocks, 0)} KV blocks "
                                     f"each, under the {least} that batch {min(batches)} needs: fewer variants")
            print(results["errors"][-1], flush=True)
            continue
        engines = {}
        envs_of = {label: env for _, label, env in todo}
        for mode, label, env in todo:
            built = build_variant(mode, label, env)
            if built is not None:
                engines[label] = (mode, built)
        built = None

        def use_variant(label: str) -> None:
            set_env({**caller_env, **envs_of[label]})
            os.environ.update(mode_env(engines[label][0]))

        order = run_order(list(engines), batches, args.rounds)
        for k, (rnd, label, b) in enumerate(order):
            if b in mode_batches[label]:
                use_variant(label)  # settings read per step too (the sampler's argmax)
                measure(results, geometry, label, engines[label][0], engines[label][1], b, args, card, num_blocks,
                        seed=1000 * rnd + b, rnd=rnd)
            if k + 1 == len(order) or order[k + 1][0] != rnd:
                save()  # after each round: a run cut short keeps the rounds it finished
        for label in list(engines):
            use_variant(label)
            prefill(results, geometry, label, engines[label][0], engines[label][1], args, card)
        engines.clear()  # every engine's weights and KV off the GPU before the next geometry
        SHARED_WEIGHTS.clear()
        save()
        gc.collect()
        torch.cuda.empty_cache()
    set_env(caller_env)  # --profile runs under the caller's settings
    save()
    (out / f"{stamp}-{args.name}.md").write_text(report(results))
    print(report(results))
    for spec in filter(None, args.profile.split(",")):  # into the JSON: a GPU machine returns few files
        geometry, mode, batch = spec.split(":")
        try:
            table = profile_run(geometry, mode, int(batch), args.context)
        except Exception as e:
            table = f"{type(e).__name__}: {e}"
        results.setdefault("profiles", {})[spec] = table
        print(f"profile {spec}:\n{table}", flush=True)
        save()
    if results["errors"]:
        print("ERRORS:", *results["errors"], sep="\n  ", file=sys.stderr)


def report(results: dict) -> str:
    card = results["card"]
    lines = [f"## GPU engine steps vs the roofline ({card['device']}, torch {card['torch']})", "",
             f"Measured: HBM {card['hbm_bytes_per_s'] / 1e12:.2f} TB/s (device copy, read + write), bf16 matmul "
             f"{card['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s (8192^3).", "",
             "| geometry | mode | batch | step ms (median) | p90 | forward GPU ms | replay ms | GPU waits ms | roofline ms "
             "| efficiency | tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        gap = f"{r['host_gap_ms']:.3f}" if r.get("host_gap_ms") is not None else "-"
        rounds = f" (median of {r['rounds']})" if r.get("rounds", 1) > 1 else ""  # every round: the list below
        lines.append(f"| {r['geometry']} | {r['mode']} | {r['batch']} | {r['step_ms']:.3f}{rounds} | {r['p90_step_ms']:.3f} | "
                     f"{r['forward_gpu_ms']:.3f} | {r.get('replay_ms', 0):.3f} | {gap} | {r['roofline_ms']:.3f} | "
                     f"{r['efficiency']:.0%} | {r['tok_s']:.0f} |")
    if any("mixed" in r for r in results["rows"]):
        lines += ["", "Steps while a fresh prompt arrives every few steps (stopping after its first token): the steps "
                  "holding its prefill chunk, and the others", "",
                  "| geometry | mode | batch | prompt | step with the chunk ms | step without ms | chunk steps replayed |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['geometry']} | {r['mode']} | {r['batch']} | {r['mixed']['prompt_len']} | "
                  f"{r['mixed']['mixed_step_ms']:.3f} | {r['mixed']['decode_step_ms']:.3f} | "
                  f"{r['mixed']['mixed_replays']}/{r['mixed']['mixed_steps']} |" for r in results["rows"] if "mixed" in r]
    if any(r.get("rounds", 1) > 1 for r in results["rows"]):
        lines += ["", "Every round's step (ms), in the order run (odd rounds ran the variants in reverse):", ""]
        lines += [f"- {r['geometry']} {r['mode']} b={r['batch']}: " + ", ".join(f"{v:.3f}" for v in r["runs_ms"])
                  for r in results["rows"]]
    if results["prefill"]:
        lines += ["", "| geometry | mode | prefill tokens | ms (median of 3) | tok/s | TFLOP/s | share of matmul peak |",
                  "|---|---|---|---|---|---|---|"]
        for r in results["prefill"]:
            lines.append(f"| {r['geometry']} | {r['mode']} | {r['tokens']} | {r['seconds'] * 1000:.1f} | {r['tok_s']:.0f} | "
                         f"{r['flops_per_s'] / 1e12:.0f} | {r['peak_share']:.0%} |")
    if results["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in results["errors"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
