"""`tokenfleet up`, `down` and `scrape-config`: the local cluster's commands (parser.py wires them in)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def add_commands(sub: Any) -> None:
    up_cmd = sub.add_parser("up", help="start etcd, workers, router and gateway on loopback; Ctrl-C stops")
    up_cmd.add_argument("--workers", type=int, default=1)
    up_cmd.add_argument("--model", action="append", default=[],
                        help="a model to serve: an HF folder, NAME=FOLDER, or smollm2-135m-instruct / gemma3-270m "
                        "(imported on first use; add -gguf to a name to serve the GGUF's quantized weights); repeat to serve "
                        "several (the first gets --workers, each other one "
                        "worker). Default: smollm2-135m-instruct")
    up_cmd.add_argument("--model-name", default=None, help="served name of the first model (default: its own)")
    up_cmd.add_argument("--role", default="both", choices=["both", "decode", "prefill"], help="workers' role")
    up_cmd.add_argument("--prefill-workers", type=int, default=0,
                        help="disaggregate: start this many prefill workers; the --workers then decode only")
    up_cmd.add_argument("--kv-tier", default="", help="each worker's second KV tier: memory or disk:DIR (a folder "
                        "per worker under DIR); blocks the pool evicts are restored from it instead of recomputed")
    up_cmd.add_argument("--kv-tier-bytes", type=int, default=0, help="each worker's second-tier budget (default 4 GiB)")
    up_cmd.add_argument("--kv-pool-bytes", type=int, default=0, help="each worker's KV pool in bytes (its blocks: "
                        "this over the model's KV bytes per block; default 1 GiB)")
    up_cmd.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                        help="dtype in the model's registry record; auto: the first worker's fastest (bfloat16 on GPUs "
                        "and on CPUs where bf16 measured faster: AVX512-BF16 or AMX; float32 elsewhere), pinned on the "
                        "record for every worker (`tokenfleet doctor` says which and why)")
    up_cmd.add_argument("--async-scheduling", action="store_true",
                        help="workers overlap scheduling with the device: the next decode step is queued before this "
                        "one's tokens are read (GPU; off by default)")
    up_cmd.add_argument("--kv-cache-dtype", default="", choices=["", "fp8"],
                        help="the first model's record's KV cache dtype: fp8 keeps K/V as e4m3 with a scale per token "
                        "and KV head, 1.6-1.8x the tokens per byte (default: the weights' dtype)")
    up_cmd.add_argument("--quantization", default=None, choices=["", "int8", "gguf"],
                        help="the first model's record's weight format: int8 (int8 weights and activations, CPU) or "
                        "gguf (the GGUF's own quantized tensors; the default for a NAME-gguf folder); '' none")
    up_cmd.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                        help="a PEFT LoRA adapter the first model's workers load (repeat); ask for it as MODEL:NAME")
    up_cmd.add_argument("--speculative-config", default="", help="speculative decoding for the first model (its "
                        'registry record\'s speculative_config), e.g. \'{"decoding_type": "NGram", "max_draft_len": 5}\': '
                        "prompt lookup, verified only when the load makes it pay")
    up_cmd.add_argument("--threads", type=int, default=0,
                        help="torch threads per worker (0 = the machine's cores shared out among the workers)")
    up_cmd.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0 = any free port)")
    up_cmd.add_argument("--gateways", type=int, default=1, help="gateways (the first on --port, the others on free "
                        "ports, each printed): one ledger and batch tier, budgets shared out between them")
    up_cmd.add_argument("--host", default="127.0.0.1", help="where the gateway listens (another than loopback needs "
                        "--auth on or --insecure-no-auth)")
    up_cmd.add_argument("--auth", choices=["off", "on"], default="off",
                        help="require API keys (tenants in the cluster's etcd: `tokenfleet tenants add NAME`)")
    up_cmd.add_argument("--insecure-no-auth", action="store_true",
                        help="serve a non-loopback --host without API keys (anyone who reaches it may use it)")
    up_cmd.add_argument("--autoscale", action="store_true", help="grow and shrink the workers with the load "
                        "(the autoscaler service on this cluster's own processes; starts from --workers)")
    up_cmd.add_argument("--max-workers", type=int, default=2, help="with --autoscale: at most this many workers")
    up_cmd.add_argument("--autoscale-metrics-port", type=int, help="with --autoscale: serve the autoscaler's "
                        "Prometheus /metrics on this port (0 = any free port; printed)")
    up_cmd.add_argument("--target-concurrency", type=float, default=4.0, help="with --autoscale: requests (running + "
                        "waiting) one worker serves within its objectives; `tokenfleet plan` sizes it for a GPU")
    up_cmd.add_argument("--warm-pool", type=int, default=0, help="with --autoscale: keep this many extra workers "
                        "loaded and warmed up but out of the fleet (within --max-workers); a scale-up activates one "
                        "in about a second instead of a cold start")
    up_cmd.add_argument("--scale-down-after", type=float, default=20.0, help="with --autoscale: seconds the load must "
                        "fit one worker fewer before one is drained (the stabilization window; the autoscale service's "
                        "down_stable)")
    up_cmd.add_argument("--scale-down-cooldown", type=float, default=30.0, help="with --autoscale: seconds after any "
                        "change before a scale-down")
    up_cmd.add_argument("--ttft-objective", type=float, default=0.0, help="with --autoscale: seconds; add a worker "
                        "when a newcomer's predicted wait (queued prompt tokens / prefill rate) or the recent TTFT "
                        "while requests wait exceeds it (0: off)")
    up_cmd.add_argument("--tracing", action="store_true", help="OpenTelemetry traces from every service, one per "
                        "request (OTLP/HTTP to --otlp-endpoint; prompts and completions only with "
                        "TOKENFLEET_TRACE_CONTENT=1)")
    up_cmd.add_argument("--trace-sample", type=float, default=1.0, help="with --tracing: the share of requests traced")
    up_cmd.add_argument("--otlp-endpoint", help="with --tracing: the OTLP/HTTP collector (default "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318)")
    up_cmd.add_argument("--batch-slots", type=int, default=8, help="batch tier (/v1/batches): a worker takes batch "
                        "lines only while nothing waits on it and it runs fewer than this many requests")
    up_cmd.add_argument("--batch-concurrency", type=int, default=8, help="batch tier: lines the gateway runs at once")
    up_cmd.add_argument("--ask", help="send this chat message through the cluster once it is up and print the reply")
    up_cmd.add_argument("--detach", action="store_true", help="return once up (stop later with `tokenfleet down`)")
    up_cmd.add_argument("--certs", help="the internal plane's certificates (default $TOKENFLEET_CERTS, else "
                        "~/.cache/tokenfleet/certs); missing ones are created")
    up_cmd.add_argument("--insecure", action="store_true",
                        help="plaintext, unauthenticated internal gRPC and etcd (development only; warned about)")
    up_cmd.set_defaults(func=_cmd_up)
    scrape = sub.add_parser("scrape-config", help="a Prometheus configuration that scrapes every service of the running "
                            "`tokenfleet up` cluster (for compose/grafana's dashboard)")
    scrape.add_argument("--interval", default="5s")
    scrape.set_defaults(func=_cmd_scrape_config)
    down_cmd = sub.add_parser("down", help="stop the cluster started by `tokenfleet up`")
    down_cmd.set_defaults(func=_cmd_down)


def detached_up_argv(args: argparse.Namespace) -> list[str]:
    """The `up` command line of the child that runs a --detach cluster: every option but --detach/--ask."""
    argv = ["up", "--workers", str(args.workers), "--prefill-workers", str(args.prefill_workers), "--threads",
            str(args.threads), "--port", str(args.port), "--role", args.role, "--dtype", args.dtype,
            "--gateways", str(args.gateways)]
    argv += [word for model in args.model for word in ("--model", model)]
    argv += ["--model-name", args.model_name] if args.model_name else []
    argv += ["--certs", args.certs] if args.certs else []
    argv += ["--insecure"] if args.insecure else []
    argv += ["--host", args.host, "--auth", args.auth] + (["--insecure-no-auth"] if args.insecure_no_auth else [])
    argv += ["--kv-tier", args.kv_tier, "--kv-tier-bytes", str(args.kv_tier_bytes)] if args.kv_tier else []
    argv += ["--kv-pool-bytes", str(args.kv_pool_bytes)] if args.kv_pool_bytes else []
    argv += ["--speculative-config", args.speculative_config] if args.speculative_config else []
    argv += ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
    argv += ["--quantization", args.quantization] if args.quantization is not None else []
    argv += ["--async-scheduling"] if args.async_scheduling else []
    argv += [w for spec in args.lora for w in ("--lora", spec)]
    argv += ["--tracing", "--trace-sample", str(args.trace_sample)] if args.tracing else []
    argv += ["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []
    argv += ["--autoscale", "--max-workers", str(args.max_workers), "--target-concurrency",
             str(args.target_concurrency), "--warm-pool", str(args.warm_pool), "--ttft-objective",
             str(args.ttft_objective), "--scale-down-after", str(args.scale_down_after), "--scale-down-cooldown",
             str(args.scale_down_cooldown)] if args.autoscale else []
    argv += ["--batch-slots", str(args.batch_slots), "--batch-concurrency", str(args.batch_concurrency)]
    argv += ["--autoscale-metrics-port", str(args.autoscale_metrics_port)] if args.autoscale_metrics_port is not None else []
    return argv


def _cmd_scrape_config(args: argparse.Namespace) -> int:
    import yaml

    from tokenfleet.cli import launcher
    from tokenfleet.cli.context import cluster_state

    state = cluster_state()
    if not state.get("metrics"):
        print("no `tokenfleet up` cluster is running (or it predates per-service metrics)", file=sys.stderr)
        return 1
    print(yaml.safe_dump(launcher.scrape_config(state, args.interval), sort_keys=False), end="")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from tokenfleet.cli import launcher
    from tokenfleet.cli.context import cluster_context
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME

    launcher.check_auth(args.host, args.auth == "on", args.insecure_no_auth)  # before anything starts
    if args.gateways < 1:
        print(f"--gateways must be at least 1, got {args.gateways}", file=sys.stderr)
        return 2
    policy = None
    if args.autoscale:  # ScalePolicy checks the settings: refused before anything starts
        from tokenfleet.cluster.autoscale import ScalePolicy

        try:
            policy = ScalePolicy(target_concurrency=args.target_concurrency, min_replicas=args.workers,
                                 max_replicas=max(args.max_workers, args.workers), ttft_objective=args.ttft_objective,
                                 down_stable=args.scale_down_after, down_cooldown=args.scale_down_cooldown)
        except ValueError as e:
            print(f"--autoscale: {e}", file=sys.stderr)
            return 2
    if args.tracing:  # every service inherits the environment (telemetry.tracing reads it)
        if not 0.0 <= args.trace_sample <= 1.0:
            print("--trace-sample must be between 0 and 1", file=sys.stderr)
            return 2
        os.environ.update({"TOKENFLEET_TRACING": "1", "TOKENFLEET_TRACE_SAMPLE": str(args.trace_sample)})
        if args.otlp_endpoint:
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.otlp_endpoint
    if args.speculative_config:
        from tokenfleet.engine.spec_decode import SpecConfig

        try:
            SpecConfig.parse(args.speculative_config)
        except ValueError as e:
            print(f"--speculative-config: {e}", file=sys.stderr)
            return 2
    if args.detach:  # run the cluster in a child process that outlives this command
        child = [sys.executable, "-m", "tokenfleet.cli", *detached_up_argv(args)]
        import subprocess

        from tokenfleet import envs

        log_path = envs.cache_dir() / "cluster.log"  # the detached cluster's logs (it outlives this terminal)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"logs: {log_path}")
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(child, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                    text=True, start_new_session=True)
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
    from pathlib import Path

    specs = args.model or [DEFAULT_MODEL_NAME]
    name, model_dir = launcher.resolve_model(specs[0])
    name = args.model_name or name
    more = [launcher.resolve_model(spec) for spec in specs[1:]]

    auth = args.auth == "on"
    scaler = None
    cluster = launcher.up(args.workers, model_dir, name, args.threads, args.port, args.role, args.dtype,
                          args.prefill_workers, insecure=args.insecure, certs=Path(args.certs) if args.certs else None,
                          host=args.host, auth=auth, no_auth=args.insecure_no_auth, more_models=more,
                          kv_tier=args.kv_tier, kv_tier_bytes=args.kv_tier_bytes, kv_pool_bytes=args.kv_pool_bytes,
                          speculative_config=args.speculative_config, lora=args.lora,
                          kv_cache_dtype=args.kv_cache_dtype, async_scheduling=args.async_scheduling,
                          quantization=args.quantization,
                          batch_slots=args.batch_slots,
                          batch_concurrency=args.batch_concurrency, gateways=args.gateways)
    try:
        prefill = f" + {args.prefill_workers} prefill worker(s)" if args.prefill_workers else ""
        served = ", ".join([name, *(m for m, _ in more)])
        print(f"gateway: {cluster.gateway_url}/v1  (model {served}, {args.workers} worker(s){prefill}, "
              f"etcd {cluster.etcd.endpoint})", flush=True)
        if len(cluster.gateway_urls) > 1:
            print(f"more gateways: {' '.join(f'{url}/v1' for url in cluster.gateway_urls[1:])}", flush=True)
        if auth:
            print("API keys required: `tokenfleet tenants add NAME` creates a tenant and prints its key "
                  "(Authorization: Bearer tfk_...)", flush=True)
        else:
            where = "loopback only" if launcher.is_loopback(args.host) else f"{args.host}, by --insecure-no-auth"
            print(f"NO API KEYS: anyone who reaches the gateway may use it ({where}); `--auth on` requires keys",
                  flush=True)
        if args.ask and not auth:
            print(launcher.ask(cluster.gateway_url, name, args.ask), flush=True)
        if policy is not None:
            plane = cluster_context(certs=args.certs, insecure=args.insecure).plane  # the cluster just recorded
            scaler = launcher.LocalAutoscaler(cluster, name, policy, plane, metrics_port=args.autoscale_metrics_port,
                                              warm_pool=args.warm_pool)
            scaler.start()
            print(f"autoscaling {name}: {policy.min_replicas}-{policy.max_replicas} workers, "
                  f"{policy.target_concurrency:g} requests each, warm pool {args.warm_pool}", flush=True)
        launcher.wait_for_signal(cluster)
    finally:
        if scaler is not None:
            scaler.stop()
        cluster.stop()
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from tokenfleet.cli import launcher

    if launcher.down():
        print("cluster stopped")
        return 0
    print("no running cluster")
    return 1
