"""Autoscaling under a load ramp: real processes, `tokenfleet up` with --autoscale against a fixed fleet sized for
the peak (--max-workers workers, always up).

A ramp of concurrent streaming chat requests, 1 -> --peak over --up seconds, held --hold seconds, back to 0 over
--down seconds, then --tail seconds idle; each user sends requests back to back while it is active. Per run: every
request's TTFT, whether it completed with exactly --max-tokens tokens (nothing failed or truncated), the serving and
started worker counts over time (serving: the autoscaler's gauge, --max-workers for the fixed fleet; started: the
worker processes alive, counted from the process table: serving, standby in the warm pool, and starting), and
worker-seconds over the whole run (ramp and tail) of each (a warm or starting worker holds its memory and weights,
and a starting one also loads them on the same cores). Runs alternate autoscaled / fixed; the figures are the
medians over runs of each run's TTFT p99 and worker-seconds, and the report lists every run and plots the replica
count of the first autoscaled run. The policy earns its place if it keeps TTFT near the fixed fleet's with fewer
worker-seconds. With --max-workers 2 and --warm-pool 1 (the defaults here) the started count cannot fall below two
workers: the serving count shows what scaling saves, the started one what the warm pool costs (--warm-pool 0 trades
it for cold starts under load).

    .venv/bin/python benchmarks/autoscale_ramp.py --runs 3      # ~25 min here
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import openai
from serving.procs import worker_pids

REPORTS = Path(__file__).parent / "reports"
FILLER = ("The harbour town woke before the sun. Fishing boats slid out past the breakwater while the baker lit his "
          "ovens and the gulls argued over the night's scraps. By the time the church bell rang six, the market "
          "square was full of carts, crates of lemons, nets to mend and people trading the news of the coast.")


def start_cluster(autoscale: bool, args: argparse.Namespace, cache: Path) -> tuple[subprocess.Popen, str, str]:
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    workers = 1 if autoscale else args.max_workers  # the fixed fleet is sized for the peak
    cmd = [sys.executable, "-m", "tokenfleet.cli", "up", "--workers", str(workers), "--threads", "1", "--port", "0"]
    if autoscale:
        cmd += ["--autoscale", "--max-workers", str(args.max_workers), "--target-concurrency",
                str(args.target_concurrency), "--autoscale-metrics-port", "0", "--warm-pool", str(args.warm_pool),
                "--ttft-objective", str(args.ttft_objective)]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(cache / "up.stderr", "w"), text=True, env=env)
    assert up.stdout is not None
    gateway = metrics = ""
    while not gateway or (autoscale and not metrics):
        line = up.stdout.readline()
        if not line:
            raise RuntimeError(f"tokenfleet up exited: {(cache / 'up.stderr').read_text()[-2000:]}")
        if line.startswith("gateway:"):
            gateway = line.split()[1]
        if line.startswith("autoscaler metrics:"):
            metrics = line.split()[2]
    said: list[str] = []
    threading.Thread(target=lambda: said.extend(up.stdout), daemon=True).start()  # the launcher's log (JSON lines)
    up.said = said  # type: ignore[attr-defined]
    deadline = time.monotonic() + 300
    while autoscale and args.warm_pool and time.monotonic() < deadline:  # a warm pool is filled before traffic
        if (gauge(metrics, "tokenfleet_autoscaler_standby_replicas") or 0) >= args.warm_pool:
            break
        time.sleep(1.0)
    return up, gateway, metrics


def gauge(metrics: str, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(metrics, timeout=5).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def started_workers(up_pid: int) -> int:
    """Engine worker processes alive under ``up``: serving, standby and starting alike."""
    return len(worker_pids(up_pid))


def replicas(metrics: str, fixed: int, up_pid: int) -> tuple[float | None, float]:
    """(serving, started) workers: the autoscaler's serving gauge (the fixed fleet's size without one) and the worker
    processes alive."""
    serving = gauge(metrics, "tokenfleet_autoscaler_serving_replicas") if metrics else float(fixed)
    return serving, float(started_workers(up_pid))


def worker_seconds(timeline: list) -> tuple[float, float]:
    """(serving, started) worker-seconds: each sample's counts held until the next (a missing reading holds the
    last one)."""
    serving = started = 0.0
    last = (0.0, 0.0)
    for (t, _, s, w), (t_next, *_) in zip(timeline, timeline[1:]):
        last = (s if s is not None else last[0], w if w is not None else last[1])
        serving += last[0] * (t_next - t)
        started += last[1] * (t_next - t)
    return serving, started


def concurrency_at(t: float, args: argparse.Namespace) -> int:
    if t < args.up:
        return 1 + int((args.peak - 1) * t / args.up)
    if t < args.up + args.hold:
        return args.peak
    if t < args.up + args.hold + args.down:
        return max(0, int(args.peak * (1 - (t - args.up - args.hold) / args.down)))
    return 0


def ramp(gateway: str, metrics: str, up_pid: int, args: argparse.Namespace) -> dict:
    client = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=300)
    start = time.monotonic()
    results: list[dict] = []
    lock = threading.Lock()
    total = args.up + args.hold + args.down

    filler = " ".join(FILLER.split() * 40)[: args.prompt_chars]

    def user(i: int) -> None:
        k = 0
        while True:
            t = time.monotonic() - start
            if t >= total:
                return
            if i >= concurrency_at(t, args):
                time.sleep(0.2)
                continue
            sent = time.monotonic()
            first, tokens, error = None, 0, ""
            k += 1  # the unique part first: no prefix-cache hits, every prompt is computed
            content = f"Request {i}-{k}. {filler} Now tell story number {i}." if filler else f"Tell story number {i}."
            try:
                stream = client.chat.completions.create(
                    model="smollm2-135m-instruct", messages=[{"role": "user", "content": content}],
                    max_tokens=args.max_tokens, stream=True, extra_body={"ignore_eos": True},
                    stream_options={"include_usage": True})
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content and first is None:
                        first = time.monotonic()
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            except openai.APIError as e:
                error = f"{type(e).__name__}: {e}"
            with lock:
                results.append({"user": i, "sent": sent - start, "ttft": (first - sent) if first else None,
                                "tokens": tokens, "error": error})

    threads = [threading.Thread(target=user, args=(i,)) for i in range(args.peak)]
    for th in threads:
        th.start()
    timeline = []
    while any(th.is_alive() for th in threads):
        t = time.monotonic() - start
        timeline.append((t, concurrency_at(t, args), *replicas(metrics, args.max_workers, up_pid)))
        time.sleep(1.0)
    for th in threads:
        th.join()
    after = []  # the scale-down after the ramp (the fixed fleet stays up: its worker-seconds count the tail too)
    while time.monotonic() - start < total + args.tail:
        t = time.monotonic() - start
        after.append((t, 0, *replicas(metrics, args.max_workers, up_pid)))
        time.sleep(1.0)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    bad = [r for r in results if r["error"] or r["tokens"] != args.max_tokens]
    serving_s, started_s = worker_seconds(timeline + after)
    return {"worker_seconds": serving_s, "worker_seconds_started": started_s,
            "requests": len(results), "failed_or_truncated": len(bad), "bad": bad[:5],
            "per_request": [(round(r["sent"], 2), None if r["ttft"] is None else round(r["ttft"], 3))
                            for r in sorted(results, key=lambda r: r["sent"])],
            "ttft_p50": statistics.median(ttfts) if ttfts else None,
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
            "timeline": timeline + after}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--peak", type=int, default=16)
    p.add_argument("--up", type=float, default=60)
    p.add_argument("--hold", type=float, default=40)
    p.add_argument("--down", type=float, default=60)
    p.add_argument("--tail", type=float, default=60, help="seconds watched after the ramp (the scale-down)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-chars", type=int, default=1000, help="filler text per prompt (about 4 characters a "
                   "token): enough prefill that one worker queues at the peak; 0: a one-line prompt")
    p.add_argument("--warm-pool", type=int, default=1)
    p.add_argument("--ttft-objective", type=float, default=1.0)
    p.add_argument("--max-workers", type=int, default=2)
    p.add_argument("--target-concurrency", type=float, default=4.0)
    p.add_argument("--name", default="cpu-autoscale-ramp")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"autoscale": [], "fixed": []}
    for k in range(args.runs):
        for mode in ("autoscale", "fixed"):
            with tempfile.TemporaryDirectory() as cache:
                up, gateway, metrics = start_cluster(mode == "autoscale", args, Path(cache))
                try:
                    result = ramp(gateway, metrics, up.pid, args)
                finally:
                    up.terminate()
                    up.wait(timeout=120)
                result["scale_events"] = [line.strip() for line in up.said  # type: ignore[attr-defined]
                                          if "autoscale" in line or "warm pool" in line][:40]
            runs[mode].append(result)
            print(f"run {k} {mode}: {result['requests']} requests, {result['failed_or_truncated']} failed/truncated, "
                  f"TTFT p50 {result['ttft_p50']:.2f} s p99 {result['ttft_p99']:.2f} s, max workers "
                  f"{max((r for _, _, r, _ in result['timeline'] if r is not None), default=0):.0f}, worker-seconds "
                  f"{result['worker_seconds']:.0f} serving, {result['worker_seconds_started']:.0f} started",
                  flush=True)
    summary = {mode: {"ttft_p99_median": statistics.median(r["ttft_p99"] for r in rs),
                      "worker_seconds_median": statistics.median(r["worker_seconds"] for r in rs),
                      "worker_seconds_started_median": statistics.median(r["worker_seconds_started"] for r in rs),
                      "failed_or_truncated": sum(r["failed_or_truncated"] for r in rs),
                      "requests": sum(r["requests"] for r in rs)} for mode, rs in runs.items()}
    stamp = time.strftime("%Y-%m-%d")
    out = {"args": vars(args), "summary": summary, "runs": runs}
    (REPORTS / f"{stamp}-{args.name}.json").write_text(json.dumps(out, indent=1))
    plot(runs["autoscale"][0]["timeline"], REPORTS / f"{stamp}-{args.name}.png")
    (REPORTS / f"{stamp}-{args.name}.md").write_text(report(out, f"{stamp}-{args.name}.png"))
    print(report(out, ""))


def plot(timeline: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x[0] for x in timeline]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(t, [x[1] for x in timeline], label="concurrent streams (load)", color="tab:gray")
    ax.set_xlabel("seconds")
    ax.set_ylabel("streams")
    ax2 = ax.twinx()
    ax2.step(t, [x[2] if x[2] is not None else float("nan") for x in timeline], where="post", color="tab:blue",
             label="serving workers")
    ax2.step(t, [x[3] for x in timeline], where="post", color="tab:orange", linestyle="--",
             label="started workers (with standby and starting)")
    ax2.set_ylabel("workers")
    ax2.set_ylim(0, max([x[3] for x in timeline] + [x[2] or 0 for x in timeline] + [2]) + 1)
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def ratio_line(values: list[float]) -> str:
    return " · ".join(f"{v:.2f}" for v in values) + f" (**{statistics.median(values):.2f}**)"


def report(out: dict, png: str) -> str:
    s, a = out["summary"], out["args"]
    lines = ["## Autoscaling under a load ramp, against a fleet sized for the peak", "",
             f"`tokenfleet up --workers 1 --threads 1 --autoscale --max-workers {a['max_workers']} "
             f"--target-concurrency {a['target_concurrency']:g} --warm-pool {a.get('warm_pool', 0)} --ttft-objective "
             f"{a.get('ttft_objective', 0):g}` vs `tokenfleet up --workers {a['max_workers']} --threads 1` (fixed, "
             f"sized for the peak). The ramp: "
             f"1 -> {a['peak']} concurrent streams over {a['up']:.0f} s, held {a['hold']:.0f} s, down to 0 over "
             f"{a['down']:.0f} s; each request sends a prompt of about {a.get('prompt_chars', 0) // 4 + 20} tokens "
             f"(unique from its first block: no prefix-cache hits) and streams exactly {a['max_tokens']} tokens. "
             f"Worker-seconds cover the ramp and {a['tail']:.0f} s after it. The runs alternate, on one 2-core "
             f"machine.", "",
             "| mode | TTFT p99 (median of runs) | worker-seconds serving (median) | started (median) | requests "
             "| failed or truncated |", "|---|---|---|---|---|---|"]
    for mode in ("autoscale", "fixed"):
        lines.append(f"| {mode} | {s[mode]['ttft_p99_median']:.2f} s | {s[mode]['worker_seconds_median']:.0f} | "
                     f"{s[mode]['worker_seconds_started_median']:.0f} | {s[mode]['requests']} | "
                     f"{s[mode]['failed_or_truncated']} |")
    pairs = list(zip(out["runs"]["autoscale"], out["runs"]["fixed"]))
    lines += ["", "Autoscaled / fixed, per run (median): TTFT p99 "
              + ratio_line([a_["ttft_p99"] / f["ttft_p99"] for a_, f in pairs])
              + "; worker-seconds started "
              + ratio_line([a_["worker_seconds_started"] / f["worker_seconds_started"] for a_, f in pairs]),
              "", "Every run:", "",
              "| run | mode | requests | failed/truncated | TTFT p50 | TTFT p99 | max workers | worker-seconds serving "
              "(started) |", "|---|---|---|---|---|---|---|---|"]
    for mode, rs in out["runs"].items():
        for k, r in enumerate(rs):
            top = max((x[2] for x in r["timeline"] if x[2] is not None), default=1)
            end = next((x[2] for x in reversed(r["timeline"]) if x[2] is not None), None)
            lines.append(f"| {k} | {mode} | {r['requests']} | {r['failed_or_truncated']} | {r['ttft_p50']:.2f} s | "
                         f"{r['ttft_p99']:.2f} s | {top:.0f} (at the end: {end if end is not None else '-'}) | "
                         f"{r['worker_seconds']:.0f} ({r['worker_seconds_started']:.0f}) |")
    if png:
        lines += ["", f"![workers over time, first autoscaled run]({png})"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
