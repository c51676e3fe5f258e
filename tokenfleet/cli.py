"""`tokenfleet …` command line: models import, generate, chat."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

SERVICE_COMMANDS = ("decode", "prefill", "router", "gateway")


def _run_service(name: str, argv: list[str]) -> int:
    """Services own their flags: `tokenfleet <service> --help` shows them."""
    if name == "router":
        from tokenfleet.services.router.main import main as router_main

        return router_main(argv)
    if name == "gateway":
        from tokenfleet.services.gateway.main import main as gateway_main

        return gateway_main(argv)
    from tokenfleet.services.decode.main import main as worker_main

    return worker_main(argv, default_role=name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICE_COMMANDS:
        return _run_service(argv[0], argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenfleet: error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfleet", description="tokenfleet LLM serving platform")
    sub = parser.add_subparsers(title="commands")

    models = sub.add_parser("models", help="manage local model artifacts").add_subparsers(title="models commands")
    imp = models.add_parser("import", help="convert the default GGUF model into an HF folder (once)")
    imp.add_argument("--force", action="store_true", help="re-import even if the folder exists")
    imp.set_defaults(func=_cmd_import)

    gen = sub.add_parser("generate", help="complete raw text prompts (offline, in-process engine)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts, batched together")
    _engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (one message, or interactive without one)")
    chat.add_argument("message", nargs="?", help="user message; omit for an interactive session")
    chat.add_argument("--system", help="system prompt")
    _engine_args(chat)
    chat.set_defaults(func=_cmd_chat)

    up_cmd = sub.add_parser("up", help="start etcd, workers, router and gateway on loopback; Ctrl-C stops")
    up_cmd.add_argument("--workers", type=int, default=1)
    up_cmd.add_argument("--model", help="HF model folder (default: the imported SmolLM2-135M-Instruct)")
    up_cmd.add_argument("--model-name", default=None, help="served model name (default: smollm2-135m-instruct)")
    up_cmd.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    up_cmd.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0 = any free port)")
    up_cmd.add_argument("--ask", help="send this chat message through the cluster once it is up and print the reply")
    up_cmd.add_argument("--detach", action="store_true", help="return once up (stop later with `tokenfleet down`)")
    up_cmd.set_defaults(func=_cmd_up)
    down_cmd = sub.add_parser("down", help="stop the cluster started by `tokenfleet up`")
    down_cmd.set_defaults(func=_cmd_down)

    for name in SERVICE_COMMANDS:
        sub.add_parser(name, help=f"run the {name} service (gRPC); --help for its flags")
    return parser


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF model folder (default: the imported SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
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
    from tokenfleet.models.gguf_import import default_source, import_gguf, model_dir

    source = default_source()
    start = time.monotonic()
    path = import_gguf(source, model_dir(source.name), overwrite=args.force)
    print(f"{source.name}: {path} ({time.monotonic() - start:.1f}s)")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from tokenfleet import launcher
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    if args.detach:  # run the cluster in a child process that outlives this command
        child = [sys.executable, "-m", "tokenfleet.cli", "up", "--workers", str(args.workers), "--threads",
                 str(args.threads), "--port", str(args.port)]
        child += ["--model", args.model] if args.model else []
        child += ["--model-name", args.model_name] if args.model_name else []
        import subprocess

        proc = subprocess.Popen(child, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="")
            if line.startswith("gateway:"):
                break
        if proc.poll() is not None:
            return 1
        if args.ask:
            url = line.split()[1].removesuffix("/v1")
            print(launcher.ask(url, args.model_name or DEFAULT_MODEL_NAME, args.ask))
        return 0
    model_dir = args.model or str(ensure_default_model())
    name = args.model_name or DEFAULT_MODEL_NAME
    cluster = launcher.up(args.workers, model_dir, name, args.threads, args.port)
    try:
        print(f"gateway: {cluster.gateway_url}/v1  (model {name}, {args.workers} worker(s), etcd {cluster.etcd.endpoint})",
              flush=True)
        if args.ask:
            print(launcher.ask(cluster.gateway_url, name, args.ask), flush=True)
        launcher.wait_for_signal(cluster)
    finally:
        cluster.stop()
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from tokenfleet import launcher

    if launcher.down():
        print("cluster stopped")
        return 0
    print("no running cluster")
    return 1


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


if __name__ == "__main__":
    raise SystemExit(main())
