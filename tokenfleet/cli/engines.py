"""``tokenfleet engines build`` / ``tokenfleet engines gate``: FP8 TensorRT-LLM engines built, gated and
registered (the build and the gate: tokenfleet.backends.trtllm.build; registration: the registry client).
Nothing here imports tensorrt_llm until a command runs."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

from tokenfleet.backends.trtllm.build import BuildPlan, GateResult, record_for, run_gate


def add_commands(sub: Any) -> None:
    engines = sub.add_parser("engines", help="TensorRT-LLM FP8 engines: build, gate, register").add_subparsers(
        title="engines commands")
    build = engines.add_parser("build", help="quantize an HF checkpoint to FP8 (weights + KV), build a TP engine "
                               "for H100, gate its accuracy and register it (run in the TensorRT-LLM image)")
    build.add_argument("--checkpoint", required=True, help="HF bf16 checkpoint folder")
    build.add_argument("--output", required=True, help="engine dir to write")
    build.add_argument("--tp", type=int, default=1)
    build.add_argument("--max-batch-size", type=int, default=256)
    build.add_argument("--max-num-tokens", type=int, default=8192)
    build.add_argument("--max-seq-len", type=int, default=8192)
    build.add_argument("--calib-size", type=int, default=512)
    build.add_argument("--examples-dir", default=BuildPlan.examples_dir, help="TensorRT-LLM's examples folder")
    build.add_argument("--dry-run", action="store_true", help="print the commands and the record; run nothing")
    build.add_argument("--no-gate", action="store_true", help="skip the accuracy gate (the record stays disabled)")
    _gate_and_register_args(build)
    build.set_defaults(func=_cmd_build)
    gate = engines.add_parser("gate", help="run the accuracy gate on a built engine against its bf16 checkpoint")
    gate.add_argument("--engine", required=True)
    gate.add_argument("--checkpoint", required=True)
    gate.add_argument("--tp", type=int, default=1)
    _gate_and_register_args(gate)
    gate.set_defaults(func=_cmd_gate)


def _gate_and_register_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-ppl-increase", type=float, default=0.05)
    p.add_argument("--min-agreement", type=float, default=0.5)
    p.add_argument("--registry", help="register the engine here (host:port); omitted: print the record")
    p.add_argument("--name", help="model name to register (default: the output folder's name)")
    p.add_argument("--version", default="fp8")
    p.add_argument("--certs", help="certificates folder with operator.pem (registering is an operator's call)")
    p.add_argument("--insecure", action="store_true", help="register over plaintext (a --insecure cluster)")


def _cmd_build(args: argparse.Namespace) -> int:
    plan = BuildPlan(args.checkpoint, args.output, args.tp, args.max_batch_size, args.max_num_tokens,
                     args.max_seq_len, args.calib_size, args.examples_dir)
    for command in plan.commands():
        print("$ " + " ".join(command), flush=True)
        if not args.dry_run:
            subprocess.run(command, check=True)
    result = None
    if not args.dry_run and not args.no_gate:
        result = _gate(plan.output, plan.checkpoint, plan.tp, args)
    return _register(plan, args, result)


def _cmd_gate(args: argparse.Namespace) -> int:
    plan = BuildPlan(args.checkpoint, args.engine, args.tp)
    return _register(plan, args, _gate(args.engine, args.checkpoint, args.tp, args))


def _gate(engine: str, checkpoint: str, tp: int, args: argparse.Namespace) -> GateResult:
    from tokenizers import Tokenizer

    from tokenfleet.backends.trtllm.spec import load_api

    tokenizer = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    result = asyncio.run(run_gate(load_api(), engine, checkpoint, lambda t: tokenizer.encode(t).ids, tp,
                                  args.max_ppl_increase, args.min_agreement))
    print(result.describe(), flush=True)
    return result


def _register(plan: BuildPlan, args: argparse.Namespace, result: GateResult | None) -> int:
    record = record_for(plan, args.name or Path(plan.output).name, args.version, result)
    if args.registry and not getattr(args, "dry_run", False):
        from tokenfleet.cli.context import cluster_context
        from tokenfleet.services.registry.client import register_model

        context = cluster_context(registry=args.registry, certs=args.certs, insecure=args.insecure)
        register_model(context.require_registry(), record, context.plane)
        print(f"registered {record.ref} ({record.status})")
    else:
        print(json.dumps(json.loads(record.to_json()), indent=2))
    return 0 if result is None or result.passed else 2
