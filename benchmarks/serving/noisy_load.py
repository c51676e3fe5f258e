"""The fault benchmark's last two parts (benchmarks/faults.py): a noisy neighbour (one tenant's full-context prompts
beside another's streams, each against itself alone) and load (a burst of concurrent streams; streams sending
requests back to back) through `tokenfleet up`."""

from __future__ import annotations

import collections
import json
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from benchmarks.serving.fault_cluster import Cluster
from benchmarks.serving.fault_load import MODEL, QUESTIONS, words

# --- noisy neighbour and load through `up` on its defaults ---------------------------------------------------------

def _streams(url: str, key: str, count: int, max_tokens: int, concurrency: int, content: Callable[[int], str],
             timeout: float = 600.0) -> list[dict[str, Any]]:
    """``count`` streaming chats, ``concurrency`` at a time: per request TTFT, inter-token gaps, status."""
    def one(i: int) -> dict[str, Any]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout)
        start, stamps, status = time.monotonic(), [], "ok"
        try:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content(i)}],
                                                    max_tokens=max_tokens, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.monotonic())
        except openai.APIStatusError as e:
            status = str(e.status_code)
        except openai.APIError as e:
            status = type(e).__name__
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        return {"status": status, "started": start, "ttft": (stamps[0] - start) if stamps else None, "gaps": gaps,
                "total": time.monotonic() - start}

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, range(count)))


def _p(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


B_TIMEOUT_S = 1800.0  # tenant B's client timeout (the others': 600 s)


def noisy_neighbour(model_dir: str, b_prompts: int, b_tokens: int = 0, a_alone_s: float = 20.0) -> dict[str, Any]:
    """Tenant B's prompts of the model's full context (``b_tokens``, 0: the context less room for the template and
    16 output tokens), all at once, while tenant A streams 4 requests at a time back to back; against A alone (for
    ``a_alone_s``) and B alone. A's figures with B are those of its requests started while B's ran."""
    from tokenfleet.models.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="tokenfleet-noisy-") as tmp:
        cluster = Cluster(["--auth", "on", "--dtype", "auto"], Path(tmp), model_dir)  # the default path
        try:
            keys = {"a": cluster.add_tenant("a"), "b": cluster.add_tenant("b")}
            tokenizer = Tokenizer(model_dir)
            context = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 8192)
            text = " ".join(words())
            while len(tokenizer.encode(text)) < context:
                text += " " + text
            ids = tokenizer.encode(text)[: b_tokens or context - 200]
            long_prompt = tokenizer.decode(ids)
            url = cluster.gateways[0]

            def a_steady(stop: threading.Event) -> list[dict[str, Any]]:
                rows: list[dict[str, Any]] = []

                def loop(i: int) -> None:
                    while not stop.is_set():
                        rows.extend(_streams(url, keys["a"], 1, 32, 1, lambda _: QUESTIONS[(i + len(rows)) % 6]))

                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(loop, range(4)))
                return rows

            def b_load() -> list[dict[str, Any]]:
                # B's last prompt may take several times its time alone: its client waits long enough to tell how long
                return _streams(url, keys["b"], b_prompts, 16, b_prompts, lambda i: f"({i}) Summarize: {long_prompt}",
                                timeout=B_TIMEOUT_S)

            stop = threading.Event()
            threading.Timer(a_alone_s, stop.set).start()
            a_alone = a_steady(stop)
            b_alone = b_load()
            stop = threading.Event()
            with ThreadPoolExecutor(1) as pool:
                a_future = pool.submit(a_steady, stop)
                time.sleep(2)
                b_started = time.monotonic()
                b_with = b_load()
                b_ended = time.monotonic()
                stop.set()
                a_with = [r for r in a_future.result() if b_started <= r["started"] <= b_ended]
        finally:
            cluster.stop()

    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"requests": len(rows), "failed": sum(r["status"] != "ok" for r in rows),
                "ttft_p99_s": _p([r["ttft"] for r in rows], 0.99),
                "itl_p99_s": _p([g for r in rows for g in r["gaps"]], 0.99),
                "total_max_s": max((r["total"] for r in rows), default=None)}

    out = {"a_alone": stats(a_alone), "a_with_b": stats(a_with), "b_alone": stats(b_alone), "b_with_a": stats(b_with),
           "prompt_tokens_b": len(ids)}
    out["ratios"] = {"a_itl_p99": _ratio(out["a_with_b"]["itl_p99_s"], out["a_alone"]["itl_p99_s"]),
                     "a_ttft_p99": _ratio(out["a_with_b"]["ttft_p99_s"], out["a_alone"]["ttft_p99_s"]),
                     "b_completion_max": _ratio(out["b_with_a"]["total_max_s"], out["b_alone"]["total_max_s"])}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def load_scenarios(model_dir: str, burst: int, loop_streams: int, loop_seconds: float) -> dict[str, Any]:
    """`up` on its defaults: ``burst`` concurrent streams (one request each, 64 tokens); ``loop_streams`` streams
    sending requests back to back for ``loop_seconds`` (48 tokens)."""
    with tempfile.TemporaryDirectory(prefix="tokenfleet-load-") as tmp:
        cluster = Cluster(["--dtype", "auto"], Path(tmp), model_dir)  # the default path
        try:
            url = cluster.gateways[0]
            start = time.monotonic()
            rows = _streams(url, "unused", burst, 64, burst, lambda i: QUESTIONS[i % 6])
            burst_out = {"streams": burst, "failed": collections.Counter(r["status"] for r in rows if r["status"] != "ok"),
                         "wall_s": round(time.monotonic() - start, 1), "ttft_p99_s": _p([r["ttft"] for r in rows], 0.99)}
            stop_at = time.monotonic() + loop_seconds
            statuses: collections.Counter[str] = collections.Counter()
            lock = threading.Lock()

            def loop(i: int) -> None:
                while time.monotonic() < stop_at:
                    (row,) = _streams(url, "unused", 1, 48, 1, lambda _: QUESTIONS[i % 6])
                    with lock:
                        statuses[row["status"]] += 1

            start = time.monotonic()
            with ThreadPoolExecutor(loop_streams) as pool:
                list(pool.map(loop, range(loop_streams)))
            loop_out = {"streams": loop_streams, "seconds": loop_seconds, "requests": sum(statuses.values()),
                        "failed": {k: v for k, v in statuses.items() if k != "ok"},
                        "wall_s": round(time.monotonic() - start, 1)}
        finally:
            cluster.stop()
    return {"burst": {**burst_out, "failed": dict(burst_out["failed"])}, "loop": loop_out}
