"""The fault benchmark's load (benchmarks/faults.py): a seeded mix of requests (chat, streaming chat, json_schema, a
forced tool call, n=2; greedy) sent open-loop through the official `openai` client with retries off, each one's outcome
as the client saw it, and the check that constrained output is valid."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import openai

TEXT = Path(__file__).resolve().parents[1] / "data" / "perplexity_text.txt"
MODEL = "smol"
CITY = {"type": "object", "properties": {"city": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "country": {"enum": ["FR", "IT", "DE", "ES"]}},
    "required": ["name", "country"], "additionalProperties": False}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"], "additionalProperties": False}
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.", "Why is the sky blue?",
             "Give me a tip for learning to cook.", "What is two plus two?", "Describe a cat in one sentence."]
CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Lyon", "Milan"]
KINDS = ("chat", "stream", "json", "tool", "n2")
CLIENT_TIMEOUT_S = 120.0


# --- the load -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """One request of the seeded load: the i-th of a scenario is the same in every scenario (kind, prompt, tenant)."""

    index: int
    kind: str
    prompt: int
    tenant: str

    @property
    def key(self) -> tuple[str, int]:
        return self.kind, self.prompt

    @staticmethod
    def of(i: int, tenants: tuple[str, ...]) -> Spec:
        return Spec(i, KINDS[i % len(KINDS)], (i // len(KINDS)) % len(QUESTIONS), tenants[i % len(tenants)])

    def body(self) -> dict[str, Any]:
        q, city = QUESTIONS[self.prompt], CITIES[self.prompt]
        if self.kind == "json":
            return dict(messages=[{"role": "user", "content": f"Describe the weather in {city} as JSON."}],
                        max_tokens=60, response_format={"type": "json_schema", "json_schema": {
                            "name": "city", "schema": CITY, "strict": True}})
        if self.kind == "tool":
            return dict(messages=[{"role": "user", "content": f"What's the weather in {city}?"}], max_tokens=60,
                        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                        parallel_tool_calls=False)
        return dict(messages=[{"role": "user", "content": q}], max_tokens=24, **({"n": 2} if self.kind == "n2" else {}))


@dataclass
class Result:
    spec: Spec
    gateway: str
    started: float
    ended: float = 0.0
    status: str = ""  # "ok", an HTTP status, "connection", "timeout", "cut" (a stream ended without a finish)
    response_id: str = ""
    replica: str = ""
    texts: dict[int, str] = field(default_factory=dict)  # per choice: content, or the tool call's arguments
    finish: dict[int, str] = field(default_factory=dict)
    completion_tokens: int | None = None
    error: str = ""

    @property
    def acknowledged(self) -> bool:
        """Its final chunk (every choice's finish) or whole body reached the client."""
        return self.status == "ok"


def run_one(spec: Spec, gateway: str, key: str, on_replica: Callable[[str, int], None] | None = None,
            preamble: str = "", salt: str = "") -> Result:
    """One request through the official client (retries off); a stream's replica is told to ``on_replica`` (+1 when it
    starts, -1 when it ends) so a scenario can kill the busiest worker. ``preamble``: a system message before the
    request's own (a prompt long enough to be prefilled on a prefill worker); ``salt``: its prefix-cache salt."""
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)
    result = Result(spec, gateway, time.monotonic())
    body = dict(model=MODEL, temperature=0, **spec.body())
    if preamble:
        body["messages"] = [{"role": "system", "content": preamble}, *body["messages"]]
    if salt:
        body["extra_body"] = {"cache_salt": salt}
    try:
        if spec.kind == "chat":
            raw = client.chat.completions.with_raw_response.create(**body)
            result.replica = raw.headers.get("x-tokenfleet-replica", "")
            reply = raw.parse()
            result.response_id = reply.id
            for choice in reply.choices:
                result.texts[choice.index] = choice.message.content or ""
                result.finish[choice.index] = choice.finish_reason
            result.completion_tokens = reply.usage.completion_tokens if reply.usage else None
            result.status = "ok"
        else:
            _stream(client, body, result, on_replica)
    except openai.APIStatusError as e:
        result.status, result.error = str(e.status_code), _message(e)
    except openai.APITimeoutError as e:
        result.status, result.error = "timeout", str(e)
    except openai.APIConnectionError as e:
        result.status, result.error = "connection", str(e)
    except openai.APIError as e:  # an error event inside the stream
        code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        result.status, result.error = f"stream-error:{code or 'error'}", str(e)
    result.ended = time.monotonic()
    return result


def _stream(client: openai.OpenAI, body: dict[str, Any], result: Result,
            on_replica: Callable[[str, int], None] | None) -> None:
    n = body.get("n", 1)
    with client.chat.completions.with_streaming_response.create(
            stream=True, stream_options={"include_usage": True}, **body) as response:
        result.replica = response.headers.get("x-tokenfleet-replica", "")
        if on_replica is not None and result.replica:
            on_replica(result.replica, +1)
        try:
            for chunk in response.parse():
                result.response_id = result.response_id or chunk.id
                for choice in chunk.choices:
                    calls = choice.delta.tool_calls or []
                    piece = choice.delta.content or "".join(c.function.arguments or "" for c in calls if c.function)
                    result.texts[choice.index] = result.texts.get(choice.index, "") + piece
                    if choice.finish_reason:
                        result.finish[choice.index] = choice.finish_reason
                if chunk.usage:
                    result.completion_tokens = chunk.usage.completion_tokens
        finally:
            if on_replica is not None and result.replica:
                on_replica(result.replica, -1)
    result.status = "ok" if len(result.finish) == n and result.completion_tokens is not None else "cut"


def _message(e: openai.APIStatusError) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    retry_after = e.response.headers.get("retry-after")
    return f"{body.get('message', str(e))[:160]} (retry-after {retry_after})"


def valid(result: Result) -> bool | None:
    """Whether a constrained completion's output is valid (JSON that fits the schema / the tool's parameters)."""
    if result.spec.kind not in ("json", "tool") or not result.acknowledged:
        return None
    schema = CITY if result.spec.kind == "json" else WEATHER_PARAMETERS
    try:
        for text in result.texts.values():
            jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


class Load:
    """A steady open-loop load: request i starts at i / rate seconds, whatever the others do."""

    def __init__(self, gateways: list[str], keys: dict[str, str], rate: float, long_prompts: str = ""):
        """``long_prompts``: a name; each request then starts with a system message of its own (~200 tokens) and a
        cache salt of that name (nothing cached from another scenario: every prompt is prefilled in full)."""
        self.gateways, self.keys, self.rate, self.long_prompts = gateways, keys, rate, long_prompts
        self.results: list[Result] = []
        self.open_streams: Counter[str] = Counter()  # replica -> streams open on it
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._extra: list[Any] = []  # futures of burst()

    def burst(self, n: int) -> None:
        """``n`` more requests of the seeded mix at once (while ``run`` sends): a fault then catches many in flight.
        They cycle through the kinds and prompts the baseline sent, as the internal tenant (whose responses name
        their replica)."""
        assert self._pool is not None, "burst() while run() sends"
        for j in range(n):
            k = len(self._extra)
            spec = Spec.of(k, ("ops",))
            spec = Spec(100_000 + k, spec.kind, (spec.prompt + k) % len(QUESTIONS), "ops")
            self._extra.append(self._pool.submit(run_one, spec, self.gateways[j % len(self.gateways)],
                                                 self.keys["ops"], self._on_replica))

    def _on_replica(self, replica: str, delta: int) -> None:
        with self._lock:
            self.open_streams[replica] += delta

    def busiest(self, wait: float = 10.0) -> str | None:
        """The replica with the most open streams (waiting up to ``wait`` s for one to have any)."""
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                ranked = [r for r, n in self.open_streams.most_common() if n > 0]
            if ranked or time.monotonic() > deadline:
                return ranked[0] if ranked else None
            time.sleep(0.05)

    def run(self, duration: float, during: Callable[[Load, float], None] | None = None) -> list[Result]:
        """Send for ``duration`` seconds (``during(load, t0)`` runs beside, e.g. the fault), then wait for every
        request to end."""
        tenants = tuple(self.keys)
        count = int(duration * self.rate)
        t0 = time.monotonic()
        side = threading.Thread(target=during, args=(self, t0), daemon=True) if during else None
        with ThreadPoolExecutor(max_workers=96) as pool:
            self._pool = pool
            if side:
                side.start()
            futures = []
            for i in range(count):
                delay = t0 + i / self.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                spec = Spec.of(i, tenants)
                futures.append(pool.submit(run_one, spec, self.gateways[i % len(self.gateways)],
                                           self.keys[spec.tenant], self._on_replica,
                                           preamble(i % (len(KINDS) * len(QUESTIONS))) if self.long_prompts else "",
                                           f"{self.long_prompts}-{i}" if self.long_prompts else ""))
            if side:
                side.join()  # a burst is submitted before the pool closes
            results = [f.result() for f in futures] + [f.result() for f in self._extra]
        self._pool = None
        self.results = results
        return results


def preamble(i: int) -> str:
    """A system message of ~200 tokens, one per (kind, prompt) of the load (``i``: request index modulo their
    number), so that a request's text can be compared with the baseline's."""
    text = words()
    start = (i * 37) % (len(text) - 160)
    return "Background reading: " + " ".join(text[start:start + 150])


def probe_until_served(gateway_urls: list[str], key: str, since: float, timeout: float = 90.0) -> float | None:
    """Seconds from ``since`` until a new one-token request is served (tried every 0.25 s on every gateway)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for url in gateway_urls:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)
            with contextlib.suppress(openai.APIError):
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
                return time.monotonic() - since
        time.sleep(0.25)
    return None



@functools.cache
def words() -> tuple[str, ...]:
    """The committed text's words (read once)."""
    return tuple(TEXT.read_text().split())
