"""Tool-calling conversations: the Responses API with stored conversations (affinity, KV retention, prefetch)
against the same conversations sent as plain chat completions that resend the transcript.

Fleet (afresh for every run): `tokenfleet up --auth on` with --workers workers x 1 thread, a second KV tier
(`--kv-tier memory --kv-tier-bytes`), and pools sized with `--kv-pool-bytes` so that the pools hold about a third
of the run's distinct prefix tokens (the conversations' final transcripts plus the other tenant's prompts). Two
tenants: `conv` runs the conversations, `other` streams unrelated chats.

Workload (seeded, identical in both modes):
- --conversations conversations at once, each --turns turns. The first prompt is a user message of
  --first-min..--first-max tokens; every later turn adds the model's reply and a user message of about --growth
  tokens standing for a tool's result. Between turns each conversation pauses --pause-min..--pause-max seconds
  (the client running its tool). Replies: temperature 0, at most --output-len tokens.
- Meanwhile tenant `other` streams chats with distinct --other-len-token prompts, --other-concurrency at a
  time, until the conversations end; its distinct prompt tokens are at least twice the pools' capacity.

Modes:
- responses: `POST /v1/responses`, streamed, `previous_response_id` chaining the turns (stored: the gateway
  keeps the conversation on its replica and asks the engine to retain the transcript for the tool pause).
- chat: `POST /v1/chat/completions`, streamed with usage, the whole transcript resent every turn.

Per run: turn-2+ TTFT p50 and p99 of the conversations; the cached share of every turn 2+: its cached prompt
tokens (usage ... cached_tokens) over its transcript, the previous turn's prompt and reply (its new input cannot
be cached); and the other tenant's TTFT p99. Rounds alternate the modes' order (responses first
in odd rounds); every run is reported. Bars, each on the median of per-round ratios: conversation TTFT p50
chat / responses >= 2; cached tokens >= 90 % of the transcript in every turn 2+ of the responses mode (reported
as the share of turns that reach it, and the median share cached); other-tenant TTFT p99 responses / chat
<= 1.1.

Before timing, both modes must agree: the first turn of every conversation is answered identically by the two
APIs (temperature 0; the same prompt tokens), checked on the first round's outputs.

    .venv/bin/python benchmarks/conversations.py [--rounds 3] [--dtype bfloat16] \\
        [--out benchmarks/reports/conversations.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from serving.load import httpx
from serving.report import git_head, machine_line

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
WORDS = ("river stone market signal copper window garden ledger orbit canvas harbor velvet summit lantern "
         "meadow engine crystal thunder silver falcon timber marble anchor beacon cobalt prairie ember glacier "
         "harvest compass quartz willow saddle cinder meteor tundra violet granite bramble oyster pepper").split()
KV_BYTES_PER_TOKEN = {"bfloat16": 2, "float16": 2, "float32": 4}  # x layers x 2 x kv heads x head dim


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str = ""
    expected_cached: int | None = None
    text: str = ""
    error: str | None = None


@dataclass
class Conversation:
    first: str
    tool_results: list[str]
    pauses: list[float]
    previous: str | None = None
    messages: list[dict] = field(default_factory=list)


def words(rng: random.Random, n: int) -> str:
    """About ``n`` tokens of text (SmolLM2's tokenizer: these words, with their spaces, are ~1.1 tokens each)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n * 9 // 10)))


def workload(args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(args.seed)
    return [Conversation(f"Conversation {i}. Read this log, then answer briefly: "
                         + words(rng, rng.randint(args.first_min, args.first_max)),
                         [f"Tool result {t}: " + words(rng, args.growth) for t in range(args.turns - 1)],
                         [rng.uniform(args.pause_min, args.pause_max) for _ in range(args.turns - 1)])
            for i in range(args.conversations)]


def pool_bytes(args: argparse.Namespace, model_dir: Path) -> tuple[int, int, int]:
    """(pool bytes per worker, the conversations' distinct tokens, the other tenant's distinct tokens): the pools
    hold a third of the distinct prefix tokens, and the other tenant's are twice the pools."""
    config = json.loads((model_dir / "config.json").read_text())
    per_token = (config["num_hidden_layers"] * 2 * config["num_key_value_heads"]
                 * (config["hidden_size"] // config["num_attention_heads"]) * KV_BYTES_PER_TOKEN[args.dtype])
    conversations = args.conversations * ((args.first_min + args.first_max) // 2
                                          + (args.turns - 1) * (args.growth + args.output_len))
    pools = conversations  # pools = (conversations + 2 x pools) / 3
    return pools * per_token // args.workers, conversations, 2 * pools


async def stream_turn(client: httpx.AsyncClient, mode: str, convo: Conversation, turn: Turn, args: argparse.Namespace,
                      headers: dict) -> None:
    if mode == "responses":
        text = convo.first if turn.turn == 0 else convo.tool_results[turn.turn - 1]
        body: dict = {"model": MODEL, "input": text, "max_output_tokens": args.output_len, "temperature": 0,
                      "stream": True}
        if convo.previous is not None:
            body["previous_response_id"] = convo.previous
        path = "/v1/responses"
    else:
        if turn.turn == 0:
            convo.messages = [{"role": "user", "content": convo.first}]
        else:
            convo.messages.append({"role": "user", "content": convo.tool_results[turn.turn - 1]})
        body = {"model": MODEL, "messages": convo.messages, "max_tokens": args.output_len, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        path = "/v1/chat/completions"
    sent = time.perf_counter()
    pieces: list[str] = []
    try:
        async with client.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            turn.replica = response.headers.get("x-tokenfleet-replica", "")
            expected = response.headers.get("x-tokenfleet-prefix-expected")
            turn.expected_cached = int(expected) if expected else None
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                delta = ""
                if mode == "responses":
                    if event["type"] == "response.output_text.delta":
                        delta = event["delta"]
                    elif event["type"] in ("response.completed", "response.incomplete"):
                        usage = event["response"]["usage"]
                        turn.prompt_tokens = usage["input_tokens"]
                        turn.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
                        turn.completion_tokens = usage["output_tokens"]
                        convo.previous = event["response"]["id"]
                    elif event["type"] in ("error", "response.failed"):
                        turn.error = json.dumps(event)[:200]
                else:
                    if event.get("choices"):
                        delta = event["choices"][0]["delta"].get("content") or ""
                    if event.get("usage"):
                        turn.prompt_tokens = event["usage"]["prompt_tokens"]
                        turn.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                        turn.completion_tokens = event["usage"]["completion_tokens"]
                if delta:
                    if turn.ttft_s is None:
                        turn.ttft_s = time.perf_counter() - sent
                    pieces.append(delta)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        turn.error = f"{type(e).__name__}: {e}"[:200]
    turn.text = "".join(pieces)
    if mode == "chat":
        convo.messages.append({"role": "assistant", "content": turn.text})


async def run_mode(url: str, mode: str, args: argparse.Namespace, keys: dict[str, str], other_tokens: int
                   ) -> dict:
    convos = workload(args)
    turns: list[Turn] = []
    other_ttft: list[float] = []
    other_errors = 0
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=args.conversations + args.other_concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        async def conversation(i: int) -> None:
            convo = convos[i]
            for t in range(args.turns):
                turn = Turn(i, t)
                turns.append(turn)
                await stream_turn(client, mode, convo, turn, args, {"authorization": f"Bearer {keys['conv']}"})
                if turn.error is not None:
                    return
                if t < args.turns - 1:
                    await asyncio.sleep(convo.pauses[t])

        async def other(slot: int) -> None:
            nonlocal other_errors
            rng = random.Random(1000 + slot)
            n = 0
            while not done.is_set():
                prompt = f"Other tenant request {slot}-{n}. " + words(rng, args.other_len)
                n += 1
                body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                        "temperature": 0, "stream": True}
                sent = time.perf_counter()
                try:
                    async with client.stream("POST", "/v1/chat/completions", json=body,
                                             headers={"authorization": f"Bearer {keys['other']}"}) as response:
                        if response.status_code != 200:
                            other_errors += 1
                            await response.aread()
                            continue
                        async for line in response.aiter_lines():
                            if line.startswith("data:") and '"content"' in line and line[5:].strip() != "[DONE]":
                                event = json.loads(line[5:])
                                if event.get("choices") and event["choices"][0]["delta"].get("content"):
                                    other_ttft.append(time.perf_counter() - sent)
                                    break
                except httpx.HTTPError:
                    other_errors += 1

        start = time.perf_counter()
        others = [asyncio.create_task(other(s)) for s in range(args.other_concurrency)]
        await asyncio.gather(*(conversation(i) for i in range(args.conversations)))
        done.set()
        await asyncio.gather(*others)
        wall = time.perf_counter() - start
    later = [t for t in turns if t.turn > 0 and t.error is None]
    ttft = sorted(t.ttft_s * 1000 for t in later if t.ttft_s is not None)
    # a turn's transcript: the previous turn's prompt and reply (what the cache could hold); its new input cannot be
    previous = {(t.conversation, t.turn): t for t in turns}
    shares = []
    for t in later:
        before = previous.get((t.conversation, t.turn - 1))
        if before is not None and before.prompt_tokens:
            shares.append(min(1.0, t.cached_tokens / (before.prompt_tokens + before.completion_tokens)))
    first = [t.prompt_tokens for t in turns if t.turn == 0 and t.prompt_tokens]
    moved = sum(1 for t in later if (b := previous.get((t.conversation, t.turn - 1))) and b.replica != t.replica)
    last = [t.prompt_tokens for t in turns if t.turn == args.turns - 1 and t.prompt_tokens]
    return {"mode": mode, "wall_s": round(wall, 1), "turns": len(turns), "errors": sum(t.error is not None for t in turns),
            "first_error": next((t.error for t in turns if t.error), None),
            "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)} if ttft else None,
            "cached_share": {"median": statistics.median(shares) if shares else None,
                             "turns_at_90": sum(s >= 0.9 for s in shares) / len(shares) if shares else None,
                             "min": min(shares) if shares else None},
            "moved_turns": moved,  # turns 2+ served on another replica than the turn before
            "ttft_p50_ms_by_turn": [percentile(sorted(t.ttft_s * 1000 for t in turns if t.turn == k and t.ttft_s), 50)
                                    for k in range(args.turns)],
            "prompt_tokens": {"first_turn": [min(first, default=0), max(first, default=0)],
                              "last_turn": [min(last, default=0), max(last, default=0)]},
            "other": {"requests": len(other_ttft), "errors": other_errors,
                      "distinct_tokens_sent_approx": len(other_ttft) * args.other_len,
                      "ttft_p99_ms": percentile(sorted(x * 1000 for x in other_ttft), 99) if other_ttft else None,
                      "distinct_tokens_target": other_tokens},
            "first_turns": {t.conversation: t.text for t in turns if t.turn == 0}}


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def start_cluster(args: argparse.Namespace, cache: Path, pool: int) -> tuple[subprocess.Popen, str, dict[str, str]]:
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "tokenfleet.cli", "up", "--workers", str(args.workers), "--threads", "1",
           "--port", "0", "--auth", "on", "--dtype", args.dtype, "--kv-tier", "memory",
           "--kv-tier-bytes", str(args.tier_bytes or pool), "--kv-pool-bytes", str(pool)]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(cache / "up.stderr", "w"), text=True, env=env,
                          start_new_session=True)
    assert up.stdout is not None
    gateway = ""
    while not gateway:
        line = up.stdout.readline()
        if not line:
            raise RuntimeError(f"tokenfleet up exited: {(cache / 'up.stderr').read_text()[-3000:]}")
        if line.startswith("gateway:"):
            gateway = line.split()[1]
    threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()  # type: ignore[union-attr]
    keys = {}
    for tenant in ("conv", "other"):  # conv is internal: its responses name their replica (moves are counted)
        extra = ["--internal"] if tenant == "conv" else []
        done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "tenants", "add", tenant, *extra], env=env,
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
        keys[tenant] = done.stdout.strip().splitlines()[-1]
    url = gateway.removesuffix("/v1")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the gateway knows the keys and a worker answers
        try:
            answer = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"authorization": f"Bearer {keys['conv']}"},
                                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            if answer.status_code == 200:
                return up, url, keys
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError("the cluster did not serve")


def stop_cluster(up: subprocess.Popen) -> None:
    if up.poll() is None:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def markdown(result: dict) -> str:
    a, bar = result["args"], result["bar"]
    lines = ["# Tool-calling conversations: Responses API (stored, retained) vs plain chat resending the transcript",
             "", f"{result['started']}, git {result['git']}, {result['machine']}", "",
             f"`tokenfleet up --auth on --workers {a['workers']} --threads 1 --dtype {a['dtype']} --kv-tier memory "
             f"--kv-tier-bytes {result['tier_bytes']} --kv-pool-bytes {result['pool_bytes']}`. {a['conversations']} "
             f"conversations x {a['turns']} turns, first prompt {a['first_min']}-{a['first_max']} tokens, +~{a['growth']} "
             f"tokens a turn, tool pause {a['pause_min']}-{a['pause_max']} s, replies <= {a['output_len']} tokens. "
             f"Distinct prefix tokens: conversations ~{result['conversation_tokens']}, other tenant target "
             f"{result['other_tokens']} (pools: ~{result['conversation_tokens']} tokens in all). Other tenant: "
             f"{a['other_concurrency']} streams of {a['other_len']}-token distinct prompts. The cached share of a turn is its "
             "cached prompt tokens over the previous turn's prompt and reply.", "",
             f"Outputs check: {result['agreement']}", "",
             "| round | mode | turn 2+ TTFT p50 ms | p99 ms | cached share median | turns >= 90 % cached | min share | "
             "turns moved | other TTFT p99 ms | other requests | wall s | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        t = r["ttft_ms"] or {"p50": float("nan"), "p99": float("nan")}
        c, o = r["cached_share"], r["other"]
        lines.append(f"| {r['round']} | {r['mode']} | {t['p50']:.0f} | {t['p99']:.0f} | {fmt(c['median'])} | "
                     f"{fmt(c['turns_at_90'])} | {fmt(c['min'])} | {r.get('moved_turns', '-')} | "
                     f"{o['ttft_p99_ms'] or float('nan'):.0f} | "
                     f"{o['requests']} | {r['wall_s']} | {r['errors']} |")
    lines += ["", "Per round (chat / responses TTFT p50; responses / chat other-tenant TTFT p99): "
              + "; ".join(f"round {i + 1}: {x:.2f}x, {y:.2f}x" for i, (x, y) in
                          enumerate(zip(bar["ttft_ratios"], bar["other_ratios"], strict=True))), "",
              f"- Turn 2+ TTFT p50, chat / responses, median of per-round ratios: **{bar['ttft_ratio']:.2f}x** "
              f"(bar >= 2: {'pass' if bar['ttft_ok'] else 'MISS'}).",
              f"- Cached share of each turn 2+ in the responses mode: median {fmt(bar['cached_median'])}, turns at "
              f">= 90 %: {fmt(bar['turns_at_90'])} (bar: every turn: {'pass' if bar['cached_ok'] else 'MISS'}).",
              f"- Other tenant's TTFT p99, responses / chat, median of per-round ratios: **{bar['other_ratio']:.2f}x** "
              f"(bar <= 1.1: {'pass' if bar['other_ok'] else 'MISS'}).", "",
              "Turns moved: turns 2+ served on another replica than the conversation's previous turn (the router left an "
              "overloaded home, or in chat mode placed by prefix and load alone)."]
    return "\n".join(lines) + "\n"


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(KV_BYTES_PER_TOKEN))
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-min", type=int, default=600)
    parser.add_argument("--first-max", type=int, default=1500)
    parser.add_argument("--growth", type=int, default=150)
    parser.add_argument("--pause-min", type=float, default=2.0)
    parser.add_argument("--pause-max", type=float, default=8.0)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--other-concurrency", type=int, default=2)
    parser.add_argument("--other-len", type=int, default=400)
    parser.add_argument("--tier-bytes", type=int, default=0, help="each worker's memory tier (default: its pool's size)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--render", help="only write the markdown of an existing JSON report (beside it)")
    parser.add_argument("--modes", nargs="+", default=["responses", "chat"], choices=["responses", "chat"],
                        help="run only these modes (profiling one; the bars need both)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "conversations.json"))
    args = parser.parse_args()
    if args.render:
        report = Path(args.render)
        report.with_suffix(".md").write_text(markdown(json.loads(report.read_text())))
        return
    from tokenfleet.models.gguf_import import ensure_default_model

    model_dir = Path(ensure_default_model()).resolve()
    pool, conversation_tokens, other_tokens = pool_bytes(args, model_dir)

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": git_head(),
                    "machine": machine_line(), "pool_bytes": pool, "tier_bytes": args.tier_bytes or pool,
                    "conversation_tokens": conversation_tokens, "other_tokens": other_tokens, "runs": [],
                    "command": "benchmarks/conversations.py " + " ".join(sys.argv[1:])}
    root = Path(tempfile.mkdtemp(prefix="tokenfleet-conversations-"))
    models = Path(os.environ.get("TOKENFLEET_CACHE_DIR", Path.home() / ".cache" / "tokenfleet")) / "models"
    try:
        for rnd in range(args.rounds):
            for mode in (("responses", "chat") if rnd % 2 == 0 else ("chat", "responses")):
                if mode not in args.modes:
                    continue
                cache = root / f"r{rnd}-{mode}"
                cache.mkdir()
                (cache / "models").symlink_to(models)  # the imported model, not imported again
                print(f"round {rnd + 1} {mode}: starting a fresh cluster ...", flush=True)
                up, url, keys = start_cluster(args, cache, pool)
                try:
                    summary = asyncio.run(run_mode(url, mode, args, keys, other_tokens))
                finally:
                    stop_cluster(up)
                summary["round"] = rnd + 1
                result["runs"].append(summary)
                print(json.dumps({k: v for k, v in summary.items() if k != "first_turns"}), flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs = result["runs"]
    first = {r["mode"]: r["first_turns"] for r in runs[:2]}
    if len(first) == 2:
        same = sum(first["responses"].get(k) == v for k, v in first["chat"].items())
        result["agreement"] = (f"{same} of {len(first['chat'])} first turns answered identically by the Responses "
                               "API and chat completions (round 1)")
    else:
        result["agreement"] = "not checked (round 1 did not finish)"
    by_round: dict[int, dict[str, dict]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["mode"]] = r
    complete = [m for m in by_round.values() if len(m) == 2 and m["chat"]["ttft_ms"] and m["responses"]["ttft_ms"]]
    ttft_ratios = [m["chat"]["ttft_ms"]["p50"] / m["responses"]["ttft_ms"]["p50"] for m in complete]
    other_ratios = [(m["responses"]["other"]["ttft_p99_ms"] or float("nan")) / (m["chat"]["other"]["ttft_p99_ms"]
                                                                                   or float("nan")) for m in complete]
    responses_runs = [r for r in runs if r["mode"] == "responses" and r["cached_share"]["median"] is not None]
    cached_median = statistics.median(r["cached_share"]["median"] for r in responses_runs) if responses_runs else None
    at_90 = statistics.median(r["cached_share"]["turns_at_90"] for r in responses_runs) if responses_runs else None
    result["bar"] = {"ttft_ratios": ttft_ratios, "other_ratios": other_ratios,
                     "ttft_ratio": statistics.median(ttft_ratios) if ttft_ratios else float("nan"),
                     "other_ratio": statistics.median(other_ratios) if other_ratios else float("nan"),
                     "cached_median": cached_median, "turns_at_90": at_90}
    bar = result["bar"]
    bar.update(ttft_ok=bar["ttft_ratio"] >= 2, other_ok=bar["other_ratio"] <= 1.1, cached_ok=at_90 == 1.0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
