"""Fuzz the gateway's OpenAPI document with schemathesis: no request may get a 5xx or crash it.

Starts etcd, one worker (--max-model-len 96 so valid generations stay short on CPU), the router
and the gateway (auth off), then runs schemathesis against http://GATEWAY/openapi.json with the
`not_a_server_error` check, and finally checks that the gateway still answers.

schemathesis is not a tokenfleet dependency: give its command (a separate venv is simplest):

    python -m venv FZ_VENV && FZ_VENV/bin/pip install schemathesis
    .venv/bin/python benchmarks/fuzz_gateway.py --schemathesis FZ_VENV/bin/schemathesis [--max-examples 40]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from serving.procs import Children, wait_completion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemathesis", required=True, help="the schemathesis command")
    parser.add_argument("--max-examples", type=int, default=40)
    args = parser.parse_args()

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    children = Children()
    try:

        children.start_etcd()
        etcd = children.etcd.endpoint
        children.spawn_service("worker", "tokenfleet.services.decode", "--model", model_dir, "--model-name",
                               DEFAULT_MODEL_NAME, "--etcd", etcd, "--threads", "1", "--max-model-len", "96", threads=1)
        router = children.spawn_service("router", "tokenfleet.services.router", "--etcd", etcd)
        gateway = children.spawn_service("gateway", "tokenfleet.services.gateway", "--router", router.address,
                                         "--model", f"{DEFAULT_MODEL_NAME}={model_dir}", "--ledger", "none",
                                         "--api-docs")  # the fuzzer reads /openapi.json
        url = f"http://{gateway.address}"
        wait_completion(url, DEFAULT_MODEL_NAME, 120, lambda: all(c.proc.poll() is None for c in children.children))
        # The served model's name only: random names would all be 404s and never reach the core logic.
        with urllib.request.urlopen(f"{url}/openapi.json", timeout=30) as response:
            schema = json.loads(response.read())
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            schema["components"]["schemas"][name]["properties"]["model"] = {"type": "string",
                                                                             "enum": [DEFAULT_MODEL_NAME]}
        schema_file = children.log_dir / "openapi.json"
        schema_file.write_text(json.dumps(schema))
        run = subprocess.run([args.schemathesis, "run", str(schema_file), "--url", url, "--checks",
                              "not_a_server_error", "--max-examples", str(args.max_examples),
                              "--request-timeout", "120"], capture_output=True, text=True)
        print(run.stdout[-6000:])
        print(run.stderr[-2000:], file=sys.stderr)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            alive = json.loads(response.read())["data"][0]["id"] == DEFAULT_MODEL_NAME
        print(f"schemathesis exit {run.returncode}; gateway still serving: {alive}")
        sys.exit(run.returncode or (0 if alive else 1))
    finally:
        children.stop_all()
        children.remove_logs()


if __name__ == "__main__":
    main()
