"""Attacks from outside against a cluster with API keys on: each must be refused with the right status
while the cluster keeps serving. One line per probe with its outcome; exit status 1 if any fails.

The cluster is `tokenfleet up --auth on` (etcd over TLS, mutual TLS inside, one worker), started here
with its own certificates and state. Probes:

- cross-tenant cache: each round tenant A sends a new 512-token prompt until it is cached for A; tenant
  B then sends the same prompt once ("probe") and a fresh prompt of the same length ("fresh"). Passes
  when every probe reports cached_tokens = 0 and the median TTFTs of probe and fresh differ by at most 10 %.
- chunked 8 MiB body (no Content-Length): 413.
- logit_bias with 100k entries: 400 naming the limit.
- 10k unauthenticated requests to distinct paths: the gateway's request metric keeps a handful of
  series (labelled by route template, not by path), counted on its metrics port.
- 200 slow-loris connections (a request head sent a few bytes at a time): a normal request's TTFT
  stays within 2x its baseline (medians of 5) while they hang on, and the server closes them within 30 s.

    .venv/bin/python benchmarks/security_probe.py [--out benchmarks/reports/security-probe.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = "smol"


def request(url: str, body: dict | None, key: str | None, path: str = "/v1/completions") -> tuple[int, dict, float]:
    """(status, JSON body, seconds to the first byte of the response)."""
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{url}{path}", data=data, headers=headers, method="POST" if data else "GET")
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as response:
            first = time.perf_counter() - start
            return response.status, json.loads(response.read() or b"{}"), first
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw.startswith(b"{") else {}, time.perf_counter() - start


def ttft(url: str, key: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens) of a streamed completion."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={
        "content-type": "application/json", "authorization": f"Bearer {key}"})
    start = time.perf_counter()
    first, cached = None, -1
    with urllib.request.urlopen(req, timeout=300) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert first is not None
    return first, cached


def probe_cache(url: str, keys: dict[str, str], vocab: int, rounds: int = 6) -> tuple[bool, str, dict]:
    """Each round: alpha caches a new secret prompt; beta sends it once (the probe) and a fresh one."""
    rng = random.Random(11)
    probe, fresh, cached = [], [], []
    ttft(url, keys["beta"], [rng.randrange(200, vocab) for _ in range(512)])  # warm-up
    for _ in range(rounds):
        secret = [rng.randrange(200, vocab) for _ in range(512)]
        ttft(url, keys["alpha"], secret)
        assert ttft(url, keys["alpha"], secret)[1] > 0, "alpha's own prefix should be cached"
        seconds, hit = ttft(url, keys["beta"], secret)
        probe.append(seconds)
        cached.append(hit)
        fresh.append(ttft(url, keys["beta"], [rng.randrange(200, vocab) for _ in range(512)])[0])
    ratio = statistics.median(probe) / statistics.median(fresh)
    ok = all(c == 0 for c in cached) and abs(ratio - 1) <= 0.10
    detail = {"cached_tokens": cached, "probe_ttft_ms": [round(1000 * s, 1) for s in probe],
              "fresh_ttft_ms": [round(1000 * s, 1) for s in fresh], "probe_over_fresh": ratio}
    return ok, f"cached_tokens {cached}, median TTFT probe/fresh {ratio:.3f} (bar within 10 %)", detail


def probe_chunked(url: str, key: str) -> tuple[bool, str, dict]:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    sent = 0
    try:
        sock.sendall(head)
        piece = b"x" * (1 << 20)
        for _ in range(8):
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent += len(piece)
        sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server answered and closed before the rest arrived
    answer = sock.recv(4096).decode(errors="replace")
    sock.close()
    status = int(answer.split()[1]) if answer.startswith("HTTP/") else 0
    return status == 413, f"HTTP {status} after {sent >> 20} MiB sent", {"status": status, "sent_bytes": sent}


def probe_logit_bias(url: str, key: str) -> tuple[bool, str, dict]:
    bias = {str(i): 1.0 for i in range(100_000)}
    status, body, _ = request(url, {"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": bias}, key)
    message = body.get("error", {}).get("message", "")
    ok = status == 400 and "300" in message
    return ok, f"HTTP {status}: {message[:80]}", {"status": status, "message": message}


def series(metrics: str) -> int:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30) as response:
        return sum(1 for line in response.read().decode().splitlines()
                   if line.startswith("tokenfleet_gateway_requests_total{"))


def probe_paths(url: str, metrics: str, n: int = 10_000) -> tuple[bool, str, dict]:
    before = series(metrics)

    async def hammer() -> int:
        host, port = url.removeprefix("http://").split(":")
        sem, statuses = asyncio.Semaphore(32), []

        async def one(i: int) -> None:
            async with sem:
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(f"GET /v1/probe-{i}-{random.random()} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                             .encode())
                await writer.drain()
                statuses.append(int((await reader.readline()).split()[1]))
                writer.close()

        await asyncio.gather(*(one(i) for i in range(n)))
        return sum(1 for s in statuses if s == 404)

    refused = asyncio.run(hammer())
    after = series(metrics)
    ok = refused == n and after - before <= 1
    return ok, f"{refused}/{n} got 404; request-metric series {before} -> {after}", {
        "not_found": refused, "series_before": before, "series_after": after}


def probe_slow_loris(url: str, key: str, vocab: int, n: int = 200) -> tuple[bool, str, dict]:
    rng = random.Random(3)

    def normal() -> float:
        return statistics.median(ttft(url, key, [rng.randrange(200, vocab) for _ in range(64)])[0] for _ in range(5))

    baseline = normal()
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=60)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sockets.append(s)
    opened = time.monotonic()
    for s in sockets:  # a few more bytes: the head is still incomplete
        try:
            s.sendall(b"X-Slow: 1\r\n")
        except OSError:
            pass
    during = normal()
    closed = 0
    for s in sockets:
        s.settimeout(max(0.1, 30 - (time.monotonic() - opened)))
        try:
            if s.recv(1) == b"":
                closed += 1
        except (TimeoutError, OSError):
            pass
        s.close()
    waited = time.monotonic() - opened
    ok = during <= 2 * baseline and closed == n
    return ok, (f"TTFT {1000 * baseline:.0f} -> {1000 * during:.0f} ms with {n} slow connections (bar 2x); "
                f"{closed}/{n} closed by the server within {waited:.0f} s"), {
        "baseline_ttft_ms": 1000 * baseline, "during_ttft_ms": 1000 * during, "closed": closed, "connections": n,
        "closed_within_s": waited}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "security-probe.json"))
    args = parser.parse_args()
    from tokenfleet.cli import launcher
    from tokenfleet.cluster.etcd import EtcdClient
    from tokenfleet.models.gguf_import import ensure_default_model
    from tokenfleet.security.identity import Identity
    from tokenfleet.tenancy.store import EtcdTenantStore
    from tokenfleet.tenancy.tenants import Tenant

    model_dir = str(ensure_default_model())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    certs = Path(tempfile.mkdtemp(prefix="tokenfleet-probe-")) / "certs"
    cluster = launcher.up(1, model_dir, MODEL, 0, 0, record=False, certs=certs, auth=True)
    results = []
    try:
        async def tenants() -> dict[str, str]:
            etcd = EtcdClient(cluster.etcd.endpoint, identity=Identity(certs, "operator"))
            try:
                store = EtcdTenantStore(etcd)
                return {name: await store.add(Tenant(name, max_concurrent=0)) for name in ("alpha", "beta")}
            finally:
                await etcd.close()

        keys = asyncio.run(tenants())
        url = cluster.gateway_url
        deadline = time.monotonic() + 60
        while request(url, {"model": MODEL, "prompt": "hi", "max_tokens": 1}, keys["alpha"])[0] != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway never accepted the new keys")
            time.sleep(0.2)
        probes = [("cross-tenant cache", lambda: probe_cache(url, keys, vocab)),
                  ("chunked 8 MiB body", lambda: probe_chunked(url, keys["alpha"])),
                  ("100k-entry logit_bias", lambda: probe_logit_bias(url, keys["alpha"])),
                  ("10k unauthenticated paths", lambda: probe_paths(url, cluster.gateway_metrics)),
                  ("200 slow-loris connections", lambda: probe_slow_loris(url, keys["alpha"], vocab))]
        for name, run in probes:
            ok, line, detail = run()
            results.append({"probe": name, "refused": ok, "outcome": line, **detail})
            print(f"{'PASS' if ok else 'FAIL'}  {name}: {line}", flush=True)
        status, body, _ = request(url, {"model": MODEL, "prompt": "Still serving?", "max_tokens": 2}, keys["beta"])
        alive = status == 200 and body["usage"]["completion_tokens"] == 2
        print(f"{'PASS' if alive else 'FAIL'}  still serving after the probes: HTTP {status}", flush=True)
    finally:
        cluster.stop()
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "probes": results, "still_serving": alive,
              "all_refused": all(r["refused"] for r in results) and alive}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    lines = [f"# Security probe\n\n{result['started']}; `benchmarks/security_probe.py`: `tokenfleet up --auth on` "
             "(one worker, mutual TLS inside), attacks from outside.\n", "| probe | outcome | result |", "|---|---|---|"]
    lines += [f"| {r['probe']} | {r['outcome']} | {'refused' if r['refused'] else 'NOT REFUSED'} |" for r in results]
    lines.append(f"| still serving afterwards | {'yes' if alive else 'no'} | |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    sys.exit(0 if result["all_refused"] else 1)


if __name__ == "__main__":
    main()
