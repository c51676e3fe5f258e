"""Serving benchmark load: fresh random prompts, OpenAI /v1/completions over SSE and tokenfleet's
gRPC Generate as asyncio load generators, per-request TTFT/TPOT and their summary."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import httpx2 as httpx  # what this venv has (the openai client's transport)
except ImportError:  # pragma: no cover - older installs
    import httpx  # type: ignore[no-redef]


def fresh_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids (no special tokens): each seed gives prompts no other run shares."""
    rng = random.Random(seed)
    return [[rng.randrange(200, vocab) for _ in range(length)] for _ in range(n)]


@dataclass
class RequestResult:
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None
    text: str = ""  # the completion (greedy: the same prompt gives the same text on a correct server)


def token_timing(start: float, first: float | None, last: float | None, n_out: int, result: RequestResult) -> None:
    result.output_tokens = n_out
    if first is not None:
        result.ttft_s = first - start
        if n_out > 1 and last is not None:
            result.tpot_s = (last - first) / (n_out - 1)


def summarize(results: list[RequestResult], wall: float, expected_tokens: int) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s * 1000 for r in ok if r.tpot_s is not None]
    latency = [r.latency_s * 1000 for r in ok]
    tokens = sum(r.output_tokens for r in ok)

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    errors = Counter(r.error for r in results if r.error is not None)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": dict(errors),
        "short_outputs": sum(1 for r in ok if r.output_tokens != expected_tokens),
        "wall_s": wall,
        "output_tokens": tokens,
        "out_tok_s": tokens / wall if wall > 0 else 0.0,
        "req_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_ms": {"mean": float(np.mean(ttft)) if ttft else None, "p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_ms": {"mean": float(np.mean(tpot)) if tpot else None, "p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "latency_ms": {"p50": pct(latency, 50), "p99": pct(latency, 99)},
    }


# ---------------------------------------------------------------------------------------------
# Load generators (asyncio): OpenAI /v1/completions over SSE, and tokenfleet's gRPC Generate


async def sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON events of an OpenAI server-sent-events stream, up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> RequestResult:
    """One streamed /v1/completions request of exactly ``output_len`` tokens (ignore_eos), timed."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult()
    start = time.perf_counter()
    first = last = None
    n_out = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for event in sse_events(response):
                if event.get("choices"):  # a token chunk (or the last one, with finish_reason)
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    result.text += event["choices"][0].get("text") or ""
                if event.get("usage"):
                    n_out = int(event["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    result.latency_s = time.perf_counter() - start
    if n_out == 0:
        result.error = "no usage chunk"
    token_timing(start, first, last, n_out, result)
    return result


async def http_load(base_url: str, model: str, prompts: list[list[int]], concurrency: int, output_len: int
                    ) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def one(prompt: list[int]) -> RequestResult:
            async with gate:
                return await stream_completion(client, model, prompt, output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - start


async def grpc_load(address: str, prompts: list[list[int]], concurrency: int, output_len: int, plane: Any
                    ) -> tuple[list[RequestResult], float]:
    """Straight to a worker's Generate, as a gateway would (``plane``: tokenfleet.security.plane.Plane)."""
    import grpc

    from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    gate = asyncio.Semaphore(concurrency)
    sampling = common_pb2.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    async with plane.channel(address, "worker") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        async def one(prompt: list[int]) -> RequestResult:
            result = RequestResult()
            async with gate:
                start = time.perf_counter()
                first = last = None
                n_out = 0
                try:
                    call = stub.Generate(engine_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling))
                    async for response in call:
                        if response.HasField("chunk") and response.chunk.token_ids:
                            now = time.perf_counter()
                            first = now if first is None else first
                            last = now
                        elif response.HasField("final"):
                            n_out = response.final.usage.completion_tokens
                        elif response.HasField("error"):
                            result.error = f"engine error: {response.error.message}"[:200]
                            return result
                except grpc.aio.AioRpcError as e:
                    result.error = f"gRPC {e.code().name}: {e.details()}"[:200]
                    return result
                result.latency_s = time.perf_counter() - start
                token_timing(start, first, last, n_out, result)
                return result

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - start


