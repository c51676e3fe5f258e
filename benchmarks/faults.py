"""Faults under load, as one standing report: a real `tokenfleet up` cluster (3 workers, --autoscale, --auth on, two
tenants and an --internal one, two gateways sharing one database, a batch in flight) under a steady open-loop load of
mixed greedy requests (chat, streaming chat, json_schema, a forced tool call, n=2), while each scenario breaks one
thing: SIGKILL of the worker serving the most streams (3x), of the router, of the registry, of a gateway; SIGSTOP of a
worker for 20 s; etcd killed for 10 s and 60 s and restarted with its data. Then a noisy neighbour (one tenant's
full-context prompts beside another's streams) and load (1,024 concurrent streams; 256 streams back to back for 60 s)
through `up` on its defaults.

Per scenario the report counts requests sent, completed, failed (by status), resumed (the gateways' resume counter),
acknowledged responses lost (a response whose final chunk or whole body reached the client but whose ledger record
is missing), ledger records duplicated, streams whose text differs from a fault-free run of the same seeded load,
invalid JSON (schema or tool arguments), streams cut without a finish or an error, batch lines missing or duplicated,
and the time until a new request was served again after the fault.

    python benchmarks/faults.py                      # every scenario (~15 minutes on 2 cores)
    python benchmarks/faults.py --scenarios worker-kill router-kill
    python benchmarks/faults.py --short              # one scenario per kind (what the test suite runs)

Writes benchmarks/reports/<date>-<machine>-faults.md and .json (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.serving.fault_cluster import (  # noqa: E402
    Cluster,
    Disks,
    batch_outcome,
    default_model,
    ledger_rows,
    submit_batch,
)
from benchmarks.serving.fault_load import KINDS, QUESTIONS, Load, Result, probe_until_served, valid  # noqa: E402
from benchmarks.serving.noisy_load import load_scenarios, noisy_neighbour  # noqa: E402
from benchmarks.serving.report import git_head, machine_line  # noqa: E402

REPORTS = Path(__file__).resolve().parent / "reports"


# --- scenarios ------------------------------------------------------------------------------------------------------

@dataclass
class Scenario:
    name: str
    kind: str
    duration: float  # seconds of load
    fault: Callable[[Cluster, Load, float, dict[str, Any]], None] | None  # (cluster, load, t0, notes)
    skipped: str = ""  # why it is not run here


def at(t0: float, seconds: float) -> None:
    time.sleep(max(0.0, t0 + seconds - time.monotonic()))


KILL_BURST = 15  # requests sent at once 1.5 s before a worker's kill: it catches many in flight, not one or two


def kill_busiest_worker(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
    at(t0, 6.5)
    load.burst(KILL_BURST)
    at(t0, 8)
    replica = load.busiest() or "worker-0"
    before = cluster.restarts(replica)
    notes["killed"] = f"{replica} (with {load.open_streams[replica]} open streams seen by the internal tenant)"
    notes["killed_replica"] = replica
    os.kill(cluster.pid_of(f"--replica-id {replica} "), signal.SIGKILL)
    notes["fault_at"] = time.monotonic()
    notes["restarted_after_s"] = cluster.wait_restarted(replica, before, since=notes["fault_at"])


def kill_service(service: str, needle: str) -> Callable[[Cluster, Load, float, dict[str, Any]], None]:
    """SIGKILL of ``service``: the `up` child whose command line has ``needle``, or (a gateway) listens on its URL."""
    def fault(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
        at(t0, 6)
        before = cluster.restarts(service)
        pid = (cluster.pid_listening(cluster.gateways[int(service.rpartition("-")[2])].removeprefix("http://"))
               if service.startswith("gateway-") else cluster.pid_of(needle))
        os.kill(pid, signal.SIGKILL)
        notes["fault_at"] = time.monotonic()
        notes["recovered_s"] = probe_until_served(cluster.gateways, load.keys["ops"], notes["fault_at"])
        notes["restarted_after_s"] = cluster.wait_restarted(service, before, since=notes["fault_at"])
    return fault


def stop_worker(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
    at(t0, 5)
    replica = load.busiest() or "worker-0"
    pid = cluster.pid_of(f"--replica-id {replica} ")
    notes["stopped"] = f"{replica} (with {load.open_streams[replica]} open streams) for 20 s"
    os.kill(pid, signal.SIGSTOP)
    notes["fault_at"] = time.monotonic()
    try:
        notes["recovered_s"] = probe_until_served(cluster.gateways, load.keys["ops"], notes["fault_at"], timeout=19)
        at(notes["fault_at"], 20)
    finally:
        os.kill(pid, signal.SIGCONT)


def etcd_down(seconds: float) -> Callable[[Cluster, Load, float, dict[str, Any]], None]:
    def fault(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
        at(t0, 5)
        before = cluster.members()
        notes["members_before"] = before
        cmdline = cluster.kill_etcd()
        notes["fault_at"] = time.monotonic()
        at(notes["fault_at"], seconds)
        cluster.start_etcd(cmdline)
        back = time.monotonic()
        notes["served_again_after_return_s"] = probe_until_served(cluster.gateways, load.keys["ops"], back)
        # every replica and gateway registered again (their leases expired while etcd was down)
        notes["rejoined_after_return_s"] = cluster.wait_members(before, back) if before else None
    return fault


def disk_full(name: str, seconds: float = 12) -> Callable[[Cluster, Load, float, dict[str, Any]], None]:
    def fault(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
        at(t0, 5)
        assert cluster.disks is not None
        with cluster.disks.full(name) as taken:
            notes["fault_at"] = time.monotonic()
            notes["filled"] = f"{name} file system full for {seconds:g} s ({taken >> 20} MiB written to fill it)"
            at(notes["fault_at"], seconds)
        freed = time.monotonic()
        notes["served_again_after_freed_s"] = probe_until_served(cluster.gateways, load.keys["ops"], freed)
    return fault


def certs_unreadable(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
    """A rotation that cannot be read: every certificate and key replaced by a half-written file for 15 s (services
    keep their loaded pair), then the originals rotated back in."""
    at(t0, 5)
    folder = Path(cluster.state["certs"])
    saved = {p: p.read_bytes() for p in folder.glob("*.pem")} | {p: p.read_bytes() for p in folder.glob("*.key")}
    try:
        for path, data in saved.items():
            path.write_bytes(data[: len(data) // 3])  # a truncated PEM
        notes["fault_at"] = time.monotonic()
        notes["rotated"] = f"{len(saved)} certificate and key files half-written for 15 s"
        at(notes["fault_at"], 15)
    finally:
        for path, data in saved.items():
            path.write_bytes(data)
    back = time.monotonic()
    notes["served_again_after_restored_s"] = probe_until_served(cluster.gateways, load.keys["ops"], back)


def proxy_fault(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any], which: str, mode: str, delay_s: float,
                seconds: float) -> None:
    """The proxy in front of the ``which`` worker set to ``mode`` for ``seconds``, then back to passing bytes."""
    at(t0, 5)
    proxy = cluster.proxies[which]
    before = proxy.forwarded
    proxy.set(mode, delay_s)
    notes["fault_at"] = time.monotonic()
    notes["proxied"] = (f"{mode} {delay_s * 1000:.0f} ms" if mode == "delay" else mode) + \
        f" between the fleet and {proxy.name} for {seconds:g} s"
    at(notes["fault_at"], seconds)
    proxy.set("pass")
    notes["proxied"] += f" ({(proxy.forwarded - before) >> 10} KiB through it meanwhile, {proxy.dropped >> 10} KiB " \
        "dropped)"
    notes["served_again_after_healed_s"] = probe_until_served(cluster.gateways, load.keys["ops"], time.monotonic())


SCENARIOS = [
    Scenario("baseline", "none", 30, None),
    Scenario("worker-kill-1", "process", 16, kill_busiest_worker),
    Scenario("worker-kill-2", "process", 16, kill_busiest_worker),
    Scenario("worker-kill-3", "process", 16, kill_busiest_worker),
    Scenario("router-kill", "process", 16, kill_service("router", "tokenfleet.services.router")),
    Scenario("registry-kill", "process", 14, kill_service("registry", "tokenfleet.services.registry")),
    Scenario("gateway-kill", "process", 14, kill_service("gateway-1", "")),
    Scenario("autoscaler-kill", "process", 0, None, skipped="`tokenfleet up --autoscale` runs the autoscaler inside "
             "its own process (killing it is killing `up`); the standalone `tokenfleet autoscale` service is not "
             "exercised here"),
    Scenario("worker-sigstop-20s", "process", 26, stop_worker),
    Scenario("etcd-down-10s", "etcd", 20, etcd_down(10)),
    Scenario("etcd-down-60s", "etcd", 70, etcd_down(60)),
    Scenario("etcd-disk-full", "disk", 24, disk_full("etcd")),
    Scenario("ledger-disk-full", "disk", 24, disk_full("state")),
    Scenario("kv-tier-disk-full", "disk", 24, disk_full("tier")),
    Scenario("certs-unreadable-at-rotation", "disk", 24, certs_unreadable),
    Scenario("partition-gateway-worker", "network", 30, lambda c, lo, t0, n: proxy_fault(c, lo, t0, n, "decode",
                                                                                          "partition", 0.0, 20)),
    Scenario("kv-transfer-latency-200ms", "network", 30, lambda c, lo, t0, n: proxy_fault(c, lo, t0, n, "prefill",
                                                                                           "delay", 0.2, 20)),
]
SHORT = ["baseline", "worker-kill-1", "router-kill", "etcd-down-10s", "ledger-disk-full"]
SHORT_SECONDS, SHORT_RATE = 12.0, 2.5  # the short version's load per scenario (the baseline's covers every request)


def summarize(results: list[Result], expected: dict[tuple[str, int], dict[int, str]], ledger: list[tuple[str, str, int]]
              ) -> dict[str, Any]:
    rows = collections.defaultdict(list)
    for request_id, status, tokens in ledger:
        rows[request_id].append((status, tokens))
    acknowledged = [r for r in results if r.acknowledged]
    lost = [r for r in acknowledged if not any(s == "ok" for s, _ in rows.get(r.response_id, []))]
    charged_twice = [r for r in acknowledged if len(rows.get(r.response_id, [])) > 1]
    differ = [r for r in acknowledged if r.spec.key in expected and r.texts != expected[r.spec.key]]
    invalid = [r for r in acknowledged if valid(r) is False]
    failed = collections.Counter(r.status for r in results if not r.acknowledged)
    return {
        "sent": len(results), "completed": len(acknowledged), "failed": dict(failed),
        "acknowledged_lost": len(lost), "duplicated_charges": len(charged_twice),
        "differ_from_fault_free": len(differ), "invalid_json": len(invalid),
        "cut_streams": failed.get("cut", 0),
        "constrained_completed": sum(1 for r in acknowledged if r.spec.kind in ("json", "tool")),
        "examples": {"lost": [r.response_id for r in lost[:3]],
                     "differ": [(r.spec.kind, r.spec.prompt, r.texts, expected.get(r.spec.key)) for r in differ[:2]],
                     "errors": sorted({f"{r.status}: {r.error[:200]}" for r in results if not r.acknowledged})[:5]},
    }


def run_scenarios(cluster: Cluster, keys: dict[str, str], chosen: list[Scenario], rate: float, batch_lines: int,
                  max_duration: float | None, out: dict[str, Any], long_prompts: bool = False) -> None:
    """``chosen`` in order on ``cluster`` (the first a fault-free baseline), each under the same seeded load;
    ``max_duration``: every scenario's load at most this long (the short version)."""
    expected: dict[tuple[str, int], dict[int, str]] = {}
    batches = []
    for scenario in chosen:
        if scenario.skipped:
            out[scenario.name] = {"kind": scenario.kind, "skipped": scenario.skipped}
            continue
        tag = scenario.name
        batch_id = submit_batch(cluster.gateways[-1], keys["a"], batch_lines, tag) if batch_lines else ""
        batches.append((scenario.name, batch_id, tag))
        notes: dict[str, Any] = {}
        resumes = cluster.metric("tokenfleet_gateway_resumes_total", '{result="ok"}')
        load = Load(cluster.gateways, keys, rate, long_prompts=scenario.name if long_prompts else "")
        started = time.monotonic()
        fault = scenario.fault
        duration = min(scenario.duration, max_duration or scenario.duration)
        if scenario.kind == "none":  # every (kind, prompt) the others send, once at least
            duration = max(duration, len(KINDS) * len(QUESTIONS) / rate)
        results = load.run(duration, (lambda lo, t0, f=fault: f(cluster, lo, t0, notes)) if fault else None)
        notes["wall_s"] = round(time.monotonic() - started, 1)
        if scenario.kind == "none":
            expected = {r.spec.key: r.texts for r in results if r.acknowledged}
        time.sleep(3)  # the ledger writer's last batch
        summary = summarize(results, expected, ledger_rows(cluster.ledger))
        resumed = int(cluster.metric("tokenfleet_gateway_resumes_total", '{result="ok"}') - resumes)
        summary["resumed"] = resumed if resumed >= 0 else "n/a (a gateway restarted: its counter too)"
        fault_at = notes.pop("fault_at", None)
        if fault_at is not None:  # requests open when the fault struck, and how many of them completed
            caught = [r for r in results if r.started <= fault_at <= r.ended]
            summary["in_flight_at_fault"] = len(caught)
            summary["in_flight_completed"] = sum(r.acknowledged for r in caught)
            killed = notes.pop("killed_replica", None)
            if killed is not None:  # those known (the internal tenant's) to be on the killed worker
                on_killed = [r for r in caught if r.replica == killed]
                summary["in_flight_on_killed"] = len(on_killed)
                summary["in_flight_on_killed_completed"] = sum(r.acknowledged for r in on_killed)
        out[scenario.name] = {"kind": scenario.kind, **summary, **notes}
        print(f"[faults] {scenario.name}: {json.dumps({k: v for k, v in summary.items() if k != 'examples'})}"
              f" {notes}", file=sys.stderr, flush=True)
    for name, batch_id, tag in batches:
        if batch_id:
            out[name]["batch"] = batch_outcome(cluster.gateways, keys["a"], batch_id, batch_lines, tag, timeout=240)


def _tenants(cluster: Cluster) -> dict[str, str]:
    keys = {"a": cluster.add_tenant("a"), "b": cluster.add_tenant("b"), "ops": cluster.add_tenant("ops", "--internal")}
    probe_until_served(cluster.gateways, keys["ops"], time.monotonic(), timeout=120)
    return keys


def _ledger_duplicates(cluster: Cluster) -> int:
    return sum(1 for n in collections.Counter(r[0] for r in ledger_rows(cluster.ledger)).values() if n > 1)


MAIN_CLUSTER = ("tokenfleet up --dtype float32 --workers 3 --autoscale --max-workers 3 --auth on --gateways 2 --kv-tier disk:DIR "
                "--kv-tier-bytes 16777216 (tenants a, b and --internal ops)")
NETWORK_CLUSTER = ("tokenfleet up --dtype float32 --workers 1 --role decode --threads 1 --auth on, plus a decode worker and a "
                   "prefill worker each behind a fault proxy (their advertised address), prompts of ~200 tokens of "
                   "their own (prefilled on the prefill worker, their KV pulled through its proxy)")


KEEP = os.environ.get("TOKENFLEET_FAULTS_KEEP") == "1"  # keep the clusters' folders (logs, ledger) to read after


@contextlib.contextmanager
def _workdir(prefix: str) -> Iterator[str]:
    if KEEP:
        path = tempfile.mkdtemp(prefix=prefix)
        print(f"[faults] cluster folder kept: {path}", file=sys.stderr, flush=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


def run_fault_scenarios(names: list[str], rate: float, model_dir: str, batch_lines: int,
                        max_duration: float | None = None) -> dict[str, Any]:
    chosen = [dataclasses.replace(s) for s in SCENARIOS if s.name in names and s.kind != "network"]
    out: dict[str, Any] = {"scenarios": {}, "cluster": MAIN_CLUSTER, "rate": rate}
    with _workdir("tokenfleet-faults-") as tmp:
        disks = Disks(Path(tmp)) if any(s.kind == "disk" for s in chosen) else None
        if disks is not None and not disks.ok:
            for s in chosen:
                s.skipped = s.skipped or (disks.reason if s.kind == "disk" else "")
            disks.unmount()
            disks = None
        workdir = disks.path("state") if disks else Path(tmp) / "state"
        workdir.mkdir(exist_ok=True)
        tier = disks.path("tier") if disks else Path(tmp) / "tier"
        cluster = Cluster(["--workers", "3", "--autoscale", "--max-workers", "3", "--auth", "on", "--gateways", "2",
                           "--kv-tier", f"disk:{tier}", "--kv-tier-bytes", str(16 << 20)], workdir, model_dir,
                          tmpdir=disks.path("etcd") if disks else None)
        cluster.disks = disks
        try:
            run_scenarios(cluster, _tenants(cluster), chosen, rate, batch_lines, max_duration, out["scenarios"])
            out["ledger_duplicates_overall"] = _ledger_duplicates(cluster)
        finally:
            cluster.stop()
            if disks is not None:
                disks.unmount()
    network = [s for s in SCENARIOS if s.name in names and s.kind == "network"]
    if network:
        out["network_cluster"] = NETWORK_CLUSTER
        baseline = Scenario("network-baseline", "none", 30, None)
        with tempfile.TemporaryDirectory(prefix="tokenfleet-faults-net-") as tmp:
            cluster = Cluster(["--workers", "1", "--role", "decode", "--threads", "1", "--auth", "on"], Path(tmp),
                              model_dir)
            try:
                cluster.add_proxied_worker("decode")
                cluster.add_proxied_worker("prefill")
                keys = _tenants(cluster)
                run_scenarios(cluster, keys, [baseline, *network], rate, batch_lines, max_duration, out["scenarios"],
                              long_prompts=True)
                out["ledger_duplicates_overall"] = out.get("ledger_duplicates_overall", 0) + _ledger_duplicates(cluster)
            finally:
                cluster.stop()
    return out


# --- the report -----------------------------------------------------------------------------------------------------

COLUMNS = [("sent", "sent"), ("completed", "completed"), ("failed", "failed (by status)"),
           ("in_flight", "in flight at the fault: completed"), ("resumed", "resumed"),
           ("acknowledged_lost", "ack. lost"), ("duplicated_charges", "dup. charges"),
           ("differ_from_fault_free", "text differs"), ("invalid_json", "invalid JSON"), ("cut_streams", "cut"),
           ("batch", "batch lines missing / dup."), ("recovery", "recovery")]


def _recovery(s: dict[str, Any]) -> str:
    parts = []
    for key, label in (("recovered_s", "served again"), ("served_again_after_return_s", "served after etcd's return"),
                       ("rejoined_after_return_s", "every replica and gateway registered again"),
                       ("served_again_after_freed_s", "served after the disk was freed"),
                       ("served_again_after_restored_s", "served after the certificates were restored"),
                       ("served_again_after_healed_s", "served after the path healed"),
                       ("restarted_after_s", "restarted")):
        if s.get(key) is not None:
            parts.append(f"{label} {s[key]:.1f} s")
    return "; ".join(parts) or "-"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Faults under load ({report['date']}, commit {report.get('commit', '?')})", "",
             f"Machine: {report['machine']}.", "",
             f"Command: `{report['command']}`", "",
             f"Cluster: `{report['faults'].get('cluster', '-')}`, open-loop load {report['faults'].get('rate')} "
             "requests/s of chat, streaming chat, json_schema, forced tool call and n=2 (greedy), the official "
             "`openai` client with retries off. Texts are compared with the fault-free `baseline` run of the same "
             "seeded load; ledger records are read from the gateways' shared database.", "",
             *([f"Network scenarios: `{report['faults']['network_cluster']}`, compared with their own fault-free "
                "`network-baseline`.", ""] if report["faults"].get("network_cluster") else []),
             "| scenario | " + " | ".join(label for _, label in COLUMNS) + " | notes |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for name, s in report["faults"].get("scenarios", {}).items():
        if "skipped" in s:
            lines.append(f"| {name} | skipped: {s['skipped']} |" + " |" * len(COLUMNS))
            continue
        cells = []
        for key, _ in COLUMNS:
            if key == "failed":
                cells.append(", ".join(f"{k}: {v}" for k, v in s["failed"].items()) or "0")
            elif key == "batch":
                b = s.get("batch")
                cells.append(f"{b['missing']} / {b['duplicated']} ({b['status']})" if b else "-")
            elif key == "in_flight":
                cell = f"{s['in_flight_at_fault']}: {s['in_flight_completed']}" if "in_flight_at_fault" in s else "-"
                if "in_flight_on_killed" in s:
                    cell += f" (on the killed worker: {s['in_flight_on_killed']}: {s['in_flight_on_killed_completed']})"
                cells.append(cell)
            elif key == "recovery":
                cells.append(_recovery(s))
            else:
                cells.append(str(s.get(key, "-")))
        notes = "; ".join(str(s[k]) for k in ("killed", "stopped", "filled", "rotated", "proxied") if s.get(k))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {notes} |")
    errors = {name: s["examples"]["errors"] for name, s in report["faults"].get("scenarios", {}).items()
              if s.get("examples", {}).get("errors")}
    if errors:
        lines += ["", "Failed requests' errors (up to 5 distinct per scenario):", ""]
        lines += [f"- {name}: " + "; ".join(f"`{e}`" for e in errs) for name, errs in errors.items()]
    if "noisy" in report:
        n = report["noisy"]
        lines += ["", "## Noisy neighbour", "",
                  f"Tenant B sends {n['b_with_a']['requests']} prompts of {n['prompt_tokens_b']} tokens at once "
                  "(chunked prefill) while tenant A streams 4 requests at a time back to back (32 tokens each; "
                  f"{n['a_with_b']['requests']} of them started while B's ran); `tokenfleet up --auth on` on its "
                  "defaults.", "",
                  "| | requests | failed | TTFT p99 (s) | ITL p99 (s) | slowest (s) |", "|---|---|---|---|---|---|"]
        for key in ("a_alone", "a_with_b", "b_alone", "b_with_a"):
            r = n[key]
            lines.append(f"| {key.replace('_', ' ')} | {r['requests']} | {r['failed']} | {_fmt(r['ttft_p99_s'])} | "
                         f"{_fmt(r['itl_p99_s'])} | {_fmt(r['total_max_s'])} |")
        ratios = n["ratios"]
        lines += ["", f"A's ITL p99 with B / alone: **{ratios['a_itl_p99']}x** (bar <= 1.5x); A's TTFT p99: "
                  f"**{ratios['a_ttft_p99']}x** (bar <= 2x); B's slowest completion with A / alone: "
                  f"**{ratios['b_completion_max']}x** (bar <= 3x). One run."]
    if "load" in report:
        b, lo = report["load"]["burst"], report["load"]["loop"]
        lines += ["", "## Load through `tokenfleet up` on its defaults", "",
                  f"- {b['streams']} concurrent streams (one request each, 64 tokens): failed {b['failed'] or 0}, "
                  f"all done in {b['wall_s']} s, TTFT p99 {_fmt(b['ttft_p99_s'])} s.",
                  f"- {lo['streams']} streams sending requests back to back for {lo['seconds']:g} s (48 tokens): "
                  f"{lo['requests']} requests, failed {lo['failed'] or 0}, {lo['wall_s']} s."]
    if report.get("wall_s") is not None:
        lines += ["", f"Wall time of the whole run: {report['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="*", default=None,
                   help=f"fault scenarios (default: all): {' '.join(s.name for s in SCENARIOS)}; "
                   "`noisy` and `load` name the last two parts")
    p.add_argument("--short", action="store_true", help=f"one scenario per kind: {' '.join(SHORT)}, no noisy/load, "
                   f"each {SHORT_SECONDS:g} s of load at {SHORT_RATE:g} requests/s")
    p.add_argument("--rate", type=float, default=None, help="requests/s of the fault scenarios' load (default 1.5)")
    p.add_argument("--batch-lines", type=int, default=8, help="lines of the batch each scenario submits")
    p.add_argument("--noisy-tokens", type=int, default=0, help="tenant B's prompt length (default: the model's "
                   "context, less room for the template and 16 output tokens)")
    p.add_argument("--burst", type=int, default=1024)
    p.add_argument("--loop-streams", type=int, default=256)
    p.add_argument("--loop-seconds", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=REPORTS)
    p.add_argument("--model", default="", help="model folder (default: the imported default model)")
    args = p.parse_args(argv)
    names = SHORT if args.short else (args.scenarios if args.scenarios is not None
                                      else [s.name for s in SCENARIOS] + ["noisy", "load"])
    model_dir = args.model or default_model()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "machine": machine_line(), "commit": git_head(),
                              "command": "python benchmarks/faults.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:])}
    fault_names = [n for n in names if n not in ("noisy", "load")]
    if fault_names and "baseline" not in fault_names:
        fault_names.insert(0, "baseline")
    started = time.monotonic()
    rate = args.rate or (SHORT_RATE if args.short else 1.5)
    report["faults"] = (run_fault_scenarios(fault_names, rate, model_dir, args.batch_lines,
                                            max_duration=SHORT_SECONDS if args.short else None) if fault_names else {})
    if "noisy" in names:
        report["noisy"] = noisy_neighbour(model_dir, b_prompts=4, b_tokens=args.noisy_tokens)
    if "load" in names:
        report["load"] = load_scenarios(model_dir, args.burst, args.loop_streams, args.loop_seconds)
    report["wall_s"] = round(time.monotonic() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{time.strftime('%Y-%m-%d-%H%M%S')}-cpu-faults{'-short' if args.short else ''}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(report))
    print(stem.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
