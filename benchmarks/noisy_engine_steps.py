"""The noisy neighbour inside one engine, step by step (no gateway, no client): tenant A's 4 streams (32 tokens, back to
back) alone for 20 s, then beside 4 prompts of B_TOKENS random tokens (16 output tokens each); with --b-alone, B alone
first. Prints A's inter-token gaps (p50/p90/p99) in both phases, the guard's figures, the slowest steps with what they
held ((start, tokens, tenant) of each prompt chunk; a-dec: A's decodes) and the step times grouped by what they held;
writes every step's time and composition to steps-<factor>.json in the temporary folder's tokenfleet-noisy/.

    .venv/bin/python benchmarks/noisy_engine_steps.py 1.5 7992 --b-alone    # FACTOR B_TOKENS

Both tenants are the anonymous one here (one fair-queue counter), unlike the fault benchmark's A and B.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenfleet.backends.torch.builder import build_engine_core
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.gguf_import import ensure_default_model

OUT = Path(tempfile.gettempdir()) / "tokenfleet-noisy"


def q(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def main() -> None:
    factor = float(sys.argv[1]) if len(sys.argv) > 1 else 1.5
    b_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 7992
    core = build_engine_core(EngineConfig(model=str(ensure_default_model()), num_threads=2, itl_guard=factor))
    print("pair_cost", core.itl_guard.pair_cost if core.itl_guard else None)
    a_prompt = core.tokenizer.encode("Write a short poem about the sea and the wind, please.")
    a_params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    b_params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    owner: dict[str, str] = {}
    last: dict[str, float] = {}
    gaps: dict[str, list[float]] = {"alone": [], "with": [], "b": []}
    steps: list[tuple[str, float]] = []
    comp: list[list[tuple[int, int, str]]] = []
    b_done: list[float] = []

    def add_a() -> None:
        owner[core.add_request(RequestSpec(list(a_prompt), a_params))] = "a"

    def add_b(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(4):
            owner[core.add_request(RequestSpec([rng.randrange(100, 40000) for _ in range(b_tokens)], b_params))] = "b"

    schedule = core.scheduler.schedule

    def recorded(now: float) -> Any:
        out = schedule(now)
        comp.append([(s.start, s.num_new_tokens, owner.get(s.request_id, "?")) for s in out.scheduled])
        return out

    core.scheduler.schedule = recorded  # type: ignore[method-assign]

    def run(phase: str, until: Any) -> None:
        while until():
            t0 = time.perf_counter()
            outs = core.step()
            now = time.perf_counter()
            steps.append((phase, now - t0))
            for o in outs:
                if owner.get(o.request_id) == "a" and o.new_token_ids:
                    if o.request_id in last:
                        gaps[phase].append(now - last[o.request_id])
                    last[o.request_id] = now
                if o.finished:
                    if owner.get(o.request_id) == "a":
                        add_a()
                    else:
                        b_done.append(now)

    if "--b-alone" in sys.argv:
        add_b(1)
        t = time.perf_counter()
        run("b", lambda: len(b_done) < 4)
        print("B alone took", round(time.perf_counter() - t, 1), flush=True)
        b_done.clear(), steps.clear(), comp.clear()
    for _ in range(4):
        add_a()
    t = time.perf_counter()
    run("alone", lambda: time.perf_counter() - t < 20)
    add_b(2)
    t = time.perf_counter()
    run("with", lambda: len(b_done) < 4)
    print("B took", round(time.perf_counter() - t, 1))
    for phase in ("alone", "with"):
        g = gaps[phase]
        print(phase, "gaps", len(g), f"p50 {q(g, .5):.3f} p90 {q(g, .9):.3f} p99 {q(g, .99):.3f} max {max(g):.3f}")
    if core.itl_guard is not None:
        print("decode_s", core.itl_guard.decode_s, "work_s", core.itl_guard.work_s)
    beside = sorted(((dt, comp[i]) for i, (ph, dt) in enumerate(steps) if ph == "with"), key=lambda x: -x[0])
    for dt, c in beside[:25]:
        print(f"{dt:.3f}", [(s, n, o) for s, n, o in c if n > 1 or o != "a"][:6],
              "a-dec", sum(1 for _, n, o in c if o == "a" and n == 1))
    groups: dict[tuple[Any, ...], list[float]] = {}
    for (phase, seconds), entries in zip(steps, comp, strict=False):
        if phase != "with":
            continue
        b_rows = [(s, n) for s, n, o in entries if o == "b"]
        key = (sum(1 for _, n, o in entries if o == "a" and n == 1), sum(1 for _, n, o in entries if o == "a" and n > 1),
               sum(1 for s, n in b_rows if n == 1 and s >= b_tokens), sum(1 for s, n in b_rows if n == 1 and s < b_tokens),
               "chunk" if any(n > 1 for _, n in b_rows) else "")
        groups.setdefault(key, []).append(seconds)
    print("(A decodes, A prompts, B decodes, B single prompt tokens, B chunk): steps, median, p90")
    for key, times in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:15]:
        print(key, len(times), f"median {statistics.median(times):.3f} p90 {q(times, 0.9):.3f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"steps-{factor}.json").write_text(json.dumps({"steps": steps, "comp": comp}))


if __name__ == "__main__":
    main()
