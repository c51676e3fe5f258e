"""benchmarks/goodput.py's results: per-round ratios, the attainment curve (PNG) and the markdown report; the
cells and objective wording benchmarks/publish.py reuses for the benchmarks page."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from tokenfleet.planning.metrics import ATTAINMENT_TARGET

TOKENFLEET = {"tokenfleet": ["--dtype", "auto"], "tokenfleet:bf16": ["--dtype", "bfloat16"]}  # `up` arguments


def round_ratio(ours: dict, theirs: dict, name: str) -> tuple[str, float] | None:
    """One round's tokenfleet / peer goodput as (text, conservative value), or None when both missed at the lowest
    rate. A goodput below the lowest rate offered is only known to lie in [0, lowest), and one reached at the last
    rate tried only to be at least that (``censored_by``), so the ratio may be a bound: "> x" / ">= x" (at least
    x; its value for the median is x) or "< x" / "<= x" (at most x; its value for the median is 0: nothing
    lower is ruled out)."""
    a, b = ours["goodput"][name], theirs["goodput"][name]
    if a is None and b is None:
        return None
    lowest = min(r["rate"] for e in (ours, theirs) for r in e["runs"])
    if b is None:  # the peer's goodput is under the lowest rate: the ratio exceeds a / lowest
        return f"> {a / lowest:.2f}", a / lowest
    if a is None:
        return f"< {lowest / b:.2f}", 0.0
    if theirs["censored_by"][name] and not ours["censored_by"][name]:
        return f"<= {a / b:.2f}", 0.0
    if ours["censored_by"][name] and not theirs["censored_by"][name]:
        return f">= {a / b:.2f}", a / b
    return f"{a / b:.2f}", a / b


def ratios(entries: list[dict], systems: list[str], rounds: int, name: str = "fixed") -> dict[str, dict]:
    """Per peer: each round's tokenfleet goodput / the peer's (``round_ratio``: exact or a bound), and the lower
    median of their conservative values (the bar: a bound never counts for more than it proves; with a bound among
    the rounds the median reads ">= x"). A round where either failed to run, or both missed at the lowest rate, has
    no ratio and is listed as skipped."""
    out: dict[str, dict] = {}
    ours_name = next((s for s in systems if s in TOKENFLEET), None)
    for peer in systems:
        if peer in TOKENFLEET:
            continue
        per_round, skipped = [], []
        for r in range(rounds):
            ours = next((e for e in entries if e["system"] == ours_name and e["round"] == r), None)
            theirs = next((e for e in entries if e["system"] == peer and e["round"] == r), None)
            if not ours or not theirs or "error" in ours or "error" in theirs:
                skipped.append(r)
                continue
            ratio = round_ratio(ours, theirs, name)
            if ratio is None:
                skipped.append(r)
                continue
            per_round.append(ratio)
        # every conservative value is at most its round's true ratio, so their lower median is at most the true one
        median = statistics.median_low(v for _, v in per_round) if per_round else None
        exact = all(t[0] not in "<>" for t, _ in per_round)
        median_text = None if median is None else f"{median:.2f}" if exact else f">= {median:.2f}"
        out[peer] = {"rounds": [v for _, v in per_round], "cells": [t for t, _ in per_round],
                     "skipped_rounds": skipped, "median": median, "median_text": median_text}
    return out


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no curve drawn", file=sys.stderr)
        return
    names = list(result["objectives"])
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 5), squeeze=False)
    colors = {s: f"C{i}" for i, s in enumerate(result["args"]["systems"])}
    for ax, name in zip(axes[0], names):
        for e in result["entries"]:
            if not e["runs"]:
                continue
            ax.plot([r["rate"] for r in e["runs"]], [r["attainment_by"][name] for r in e["runs"]], marker="o",
                    color=colors[e["system"]], alpha=0.8, label=e["system"] if e["round"] == 0 else None,
                    linestyle=["-", "--", ":"][e["round"] % 3])
        ax.axhline(ATTAINMENT_TARGET, color="grey", linewidth=0.8)
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("share of requests meeting TTFT and TPOT objectives")
        ax.set_title(f"{name}: {objectives_text(result['objectives'][name])}", fontsize=9)
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8)
    fig.suptitle("SLO attainment vs offered rate (one line per system and round)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def objectives_text(o: dict) -> str:
    return (f"TTFT <= {o['ttft_s']:g} s + {1000 * o['ttft_per_prompt_token_s']:g} ms per prompt token, "
            f"TPOT <= {1000 * o['tpot_s']:g} ms")


def goodput_cell(entry: dict | None, name: str) -> str:
    if entry is None:
        return "–"
    if "error" in entry and not entry["runs"]:
        return "failed"
    value = entry["goodput"][name]
    if value is None:
        return "< lowest rate"
    return ("≥ " if entry["censored_by"][name] else "") + f"{value:.3f}"


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Goodput under SLO ({result['started']})", "",
             f"Workload: benchmarks/serving/mixed_workload.py (seed {result['seed']}), {a['requests']} requests per "
             f"rate, rates {a['start_rate']} x {a['factor']}^i, stepped up until the `{a['control']}` objectives' "
             f"attainment fell below {ATTAINMENT_TARGET:.0%}. Goodput = the highest rate before the first with "
             f"attainment < {ATTAINMENT_TARGET:.0%}. {a['rounds']} rounds, servers restarted per round, order "
             f"alternating. Machine: {result['machine']}. git {result['git']}.", "", "Objective sets:"]
    lines += [f"- `{name}`: {objectives_text(o)}" + (" (the bar's)" if name == "fixed" else "")
              for name, o in result["objectives"].items()]
    lines += ["", "`tokenfleet`: `tokenfleet up` on its defaults (dtype auto: the machine's fastest, models.auto_dtype); "
              "`tokenfleet:bf16`: with "
              f"`--dtype bfloat16`. vLLM-CPU {result.get('vllm_version', '?')}: `vllm serve --max-model-len 4096` in "
              "the named configuration (benchmarks/serving/vllm_configs.py; bf16 unless it says dtype=float32).", ""]
    for name in result["objectives"]:
        lines += [f"## Goodput, `{name}` objectives (requests/s)", "",
                  "| system | " + " | ".join(f"round {r}" for r in range(a["rounds"])) + " |",
                  "|---|" + "---|" * a["rounds"]]
        for system in a["systems"]:
            cells = [goodput_cell(next((x for x in result["entries"] if x["system"] == system and x["round"] == r),
                                       None), name) for r in range(a["rounds"])]
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
        lines += ["", f"{result['ratio_of']} / peer, per round (median; the bar is >= 1.2 on `fixed`):"]
        for peer, entry in result["ratios"][name].items():
            rounds = " · ".join(entry.get("cells") or [f"{x:.2f}" for x in entry["rounds"]]) or "–"
            median = f"**{entry.get('median_text') or format(entry['median'], '.2f')}**" \
                if entry["median"] is not None else "–"
            skipped = f"; rounds without a ratio: {entry['skipped_rounds']}" if entry["skipped_rounds"] else ""
            lines.append(f"- vs `{peer}`: {rounds} (median {median}{skipped})")
        lines.append("")
    failed = [f"{e['system']} round {e['round']}: {e['error']}" for e in result["entries"] if "error" in e]
    if failed:
        lines += ["Failures:", *(f"- {f}" for f in failed), ""]
    names = list(result["objectives"])
    lines += [f"Curve: `{Path(result['plot']).name}`.", "", "## Every run", "",
              "Attainment per objective set; requests met by class (chat, shared prefix, long) per set; a run stopped "
              "early (more certain misses than 90 % allows, or not drained in time) counts as a miss.", "",
              "| system | round | rate/s | attainment (" + ", ".join(names) + ") | met by class | TTFT p50/p90 s | "
              "TPOT p50/p90 ms | errors | CPU % |", "|---|---|---|---|---|---|---|---|---|"]
    for e in result["entries"]:
        for r in e["runs"]:
            att = " / ".join(f"{r['attainment_by'][n]:.2f}" for n in names) + (" (stopped early)" if r["aborted"] else "")
            kinds = " / ".join(", ".join(f"{r['by_kind'][n][k]['met']}/{r['by_kind'][n][k]['of']}"
                                         if k in r["by_kind"][n] else "–" for k in ("chat", "shared_prefix", "long"))
                               for n in names)
            cpu = ", ".join(f"{label} {v:.0f}" for label, v in r["cpu_pct"].items())
            lines.append(f"| {e['system']} | {e['round']} | {r['rate']:.3f} | {att} | {kinds} | "
                         f"{r['ttft_p50_s'] or 0:.2f}/{r['ttft_p90_s'] or 0:.2f} | "
                         f"{1000 * (r['tpot_p50_s'] or 0):.0f}/{1000 * (r['tpot_p90_s'] or 0):.0f} | "
                         f"{r['num_errors']} | {cpu} |")
    wrong = [f"{e['system']} round {e['round']}" for e in result["entries"] if not e.get("tokyo", e.get("paris", True))]
    lines += ["", "## Answers (greedy, first 16 tokens, checked before timing)", "",
              "Japan answers without Tokyo: " + (", ".join(wrong) if wrong else "none") + ".", ""]
    texts: dict[str, dict[str, str]] = {}
    for e in result["entries"]:
        texts.setdefault(e["system"], e.get("answers", {}))
    for system, answers in texts.items():
        for pid, text in answers.items():
            lines.append(f"- {system}, {pid}: {text!r}")
    if "answer_match" in result:
        lines += ["", f"Identical 16-token answers (round 0), {result['ratio_of']} vs each peer: "
                  f"{result['answer_match']}"]
    return "\n".join(lines) + "\n"


def answer_match(entries: list[dict]) -> dict[str, str]:
    ours_name = next((e["system"] for e in entries if e["system"] in TOKENFLEET), None)
    ours = [e for e in entries if e["system"] == ours_name and e.get("answers")]
    out = {}
    for peer in sorted({e["system"] for e in entries} - {ours_name}):
        theirs = [e for e in entries if e["system"] == peer and e.get("answers")]
        if ours and theirs:
            a, b = ours[0]["answers"], theirs[0]["answers"]
            same = sum(a[k] == b.get(k) for k in a)
            out[peer] = f"{same}/{len(a)}"
    return out
