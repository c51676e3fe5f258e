"""Gateway admission at saturation: requests/s the gateway rejects (over budget: 429) and admits
(1-token completions through one worker), with API keys on and the ledger writing a record per
request. etcd-free: tenants come from a YAML file (`--tenants-file`).

    .venv/bin/python benchmarks/admission.py [--concurrency 32] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections import Counter
from pathlib import Path

from serving.load import httpx
from serving.procs import Children

from tokenfleet.tenancy.store import save_file
from tokenfleet.tenancy.tenants import Directory, Tenant, new_key


async def hammer(url: str, model: str, key: str, concurrency: int, seconds: float) -> tuple[Counter, float]:
    statuses: Counter = Counter()
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": model, "prompt": [300, 301, 302, 303], "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0),
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        start = time.perf_counter()

        async def worker() -> None:
            while time.perf_counter() - start < seconds:
                response = await client.post("/v1/completions", json=body, headers=headers)
                statuses[response.status_code] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return statuses, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    folder = Path(tempfile.mkdtemp(prefix="tokenfleet-admission-"))
    open_key, open_record = new_key("open")
    tight_key, tight_record = new_key("tight")
    save_file(folder / "tenants.yaml", Directory(
        {"open": Tenant("open"), "tight": Tenant("tight", tokens_per_minute=1)},
        {open_record.key_hash: open_record, tight_record.key_hash: tight_record}))
    children = Children()
    try:

        children.start_etcd()
        etcd = children.etcd.endpoint
        children.spawn_service("worker", "tokenfleet.services.decode", "--model", model_dir, "--model-name",
                               DEFAULT_MODEL_NAME, "--etcd", etcd, "--threads", "1", threads=1)
        router = children.spawn_service("router", "tokenfleet.services.router", "--etcd", etcd)
        gateway = children.spawn_service("gateway", "tokenfleet.services.gateway", "--router", router.address,
                                         "--model", f"{DEFAULT_MODEL_NAME}={model_dir}", "--auth", "on",
                                         "--tenants-file", str(folder / "tenants.yaml"),
                                         "--ledger", str(folder / "ledger.sqlite3"))
        url = f"http://{gateway.address}"
        import urllib.request

        def probe() -> bool:
            body = b'{"model": "%s", "prompt": [300, 301], "max_tokens": 1}' % DEFAULT_MODEL_NAME.encode()
            request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={
                "authorization": f"Bearer {open_key}", "content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30):
                    return True
            except OSError:
                return False

        deadline = time.monotonic() + 120
        while not probe() and time.monotonic() < deadline:  # until the router has seen the worker
            time.sleep(0.5)
        rows = []
        for label, key in (("rejected (429: over budget)", tight_key), ("admitted (1-token completions)", open_key)):
            statuses, wall = asyncio.run(hammer(url, DEFAULT_MODEL_NAME, key, args.concurrency, args.seconds))
            rows.append((label, dict(statuses), sum(statuses.values()) / wall))
            print(label, dict(statuses), f"{sum(statuses.values()) / wall:.0f} req/s", flush=True)
    finally:
        children.stop_all()
        children.remove_logs()
    print(f"\n| load (concurrency {args.concurrency}, {args.seconds:.0f} s) | statuses | requests/s |\n|---|---|---|")
    for label, statuses, rate in rows:
        print(f"| {label} | {statuses} | {rate:.0f} |")


if __name__ == "__main__":
    main()
