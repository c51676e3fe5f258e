"""`tokenfleet …` command line: ``main`` and ``build_parser`` (every subcommand wired in); the service commands, `generate`,
`chat` and `certs`."""

from __future__ import annotations

import argparse
import sys
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

    from tokenfleet.cli import models

    models.add_commands(sub)

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
                   help="auto: the fastest here (bfloat16 on GPUs and on CPUs where bf16 measured faster, else "
                   "float32; `tokenfleet doctor` says which and why)")
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

