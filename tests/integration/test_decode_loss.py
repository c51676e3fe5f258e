"""kill -9 of the decode worker mid-stream: the gateway continues the request on another
replica (prompt + tokens already streamed re-prefilled there) and the client sees one
uninterrupted stream, identical to an undisturbed greedy run; with no resumes left it gets a
clear error event instead of a cut connection (or a hang)."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

from tests.integration.conftest import start_service, wait_for
from tests.integration.test_fleet import MODEL, REPLICA_HEADER
from tests.integration.test_fleet import fleet as fleet  # noqa: F401 - the fixture
from tests.integration.test_membership import replicas

MAX_TOKENS = 60
MESSAGES = [{"role": "user", "content": "Count slowly from one to one hundred, one number per line."}]


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, kill=None) -> tuple[str, list, str]:  # type: ignore[no-untyped-def]
    """(text, chunks, replica) of one streamed greedy chat completion (ignore_eos, usage at the end);
    ``kill(replica)`` is called once five content chunks have arrived."""
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) as response:
        replica = response.headers[REPLICA_HEADER]
        chunks, content = [], 0
        for chunk in response.parse():
            chunks.append(chunk)
            content += bool(chunk.choices and chunk.choices[0].delta.content)
            if kill is not None and content == 5:
                kill(replica)
                kill = None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks, replica


def usage_and_finish(chunks: list) -> tuple[int, list[str]]:  # type: ignore[type-arg]
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1
    return usage[0].completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices and
                                        c.choices[0].finish_reason]


def metric(gateway, name: str) -> float:  # type: ignore[no-untyped-def]
    """A sample from the gateway's metrics port."""
    with urllib.request.urlopen(f"http://{gateway.announced('METRICS')}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_kill_9_of_the_decode_worker_mid_stream_continues_elsewhere_with_identical_text(fleet):  # noqa: F811
    client = client_of(fleet.url)
    undisturbed, chunks, _ = chat(client)
    assert usage_and_finish(chunks) == (MAX_TOKENS, ["length"])
    assert len(undisturbed) > 20

    killed: list[str] = []

    def kill(replica: str) -> None:
        fleet.workers[replica].proc.kill()  # kill -9: no drain, no deregistration
        killed.append(replica)

    text, chunks, _ = chat(client, kill)
    assert killed
    # One uninterrupted stream: same text (nothing duplicated or missing), usage counts every token, one finish.
    assert text == undisturbed
    assert usage_and_finish(chunks) == (MAX_TOKENS, ["length"])
    assert metric(fleet.gateway, 'tokenfleet_gateway_resumes_total{result="ok"}') == 1
    assert metric(fleet.gateway, 'tokenfleet_gateway_resumes_total{result="exhausted"}') == 0
    wait_for(lambda: any("replica lost mid-stream" in line and killed[0] in line for line in fleet.gateway.stderr_lines),
             "the gateway's warning naming the lost replica", 30)


def test_a_stopped_worker_mid_stream_is_given_up_on_and_the_stream_completes_elsewhere_while_it_is_stopped(
        fleet):  # noqa: F811
    """SIGSTOP: no reset, no FIN, and HTTP/2 keepalive does not fail the call. The worker's heartbeats stop, the
    gateway gives up on it after --stall-timeout and resumes the stream on the other worker: the client's stream
    completes, identical, while the stopped worker is still stopped."""
    gateway = start_service("tokenfleet.services.gateway", "--router", fleet.router.address, "--registry",
                            fleet.others[0].address, "--stall-timeout", "3", "--metrics-port", "0")
    stopped: list[str] = []
    try:
        url = f"http://{gateway.address}"
        wait_for(lambda: healthy(url), "gateway with --stall-timeout 3 ready", 120)
        client = client_of(url)
        undisturbed, _, _ = chat(client)

        def stop(replica: str) -> None:
            fleet.workers[replica].proc.send_signal(signal.SIGSTOP)
            stopped.append(replica)

        text, chunks, replica = chat(client, stop)
        assert stopped == [replica]
        assert fleet.workers[replica].proc.poll() is None  # still there, still stopped: the stream did not wait
        assert text == undisturbed
        assert usage_and_finish(chunks) == (MAX_TOKENS, ["length"])
        assert metric(gateway, "tokenfleet_gateway_stalls_total") == 1
        assert metric(gateway, 'tokenfleet_gateway_resumes_total{result="ok"}') == 1
    finally:
        for replica in stopped:
            fleet.workers[replica].proc.send_signal(signal.SIGCONT)
        gateway.stop()


def test_with_no_resumes_left_the_stream_ends_with_an_error_event(fleet):  # noqa: F811
    gateway = start_service("tokenfleet.services.gateway", "--router", fleet.router.address, "--registry",
                            fleet.others[0].address, "--max-resumes", "0", "--metrics-port", "0")
    try:
        url = f"http://{gateway.address}"
        wait_for(lambda: healthy(url), "gateway with --max-resumes 0 ready", 120)
        with pytest.raises(openai.APIError) as raised:  # the client raises the stream's error event
            chat(client_of(url), lambda replica: fleet.workers[replica].proc.kill())
        error = raised.value.body
        assert isinstance(error, dict) and error["code"] == "replica_lost", error
        assert "mid-stream" in error["message"] and error["type"] == "server_error"
        assert metric(gateway, 'tokenfleet_gateway_resumes_total{result="exhausted"}') == 1
        assert metric(gateway, 'tokenfleet_gateway_resumes_total{result="ok"}') == 0
    finally:
        gateway.stop()


CITY = {"type": "object", "properties": {"city": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "country": {"enum": ["FR", "IT", "DE"]}},
    "required": ["name", "country"], "additionalProperties": False}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CONSTRAINED = {
    "json_schema": dict(messages=[{"role": "user", "content": "Describe the weather in a European city as JSON."}],
                        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                                                "strict": True}}),
    "tool_call": dict(messages=[{"role": "user", "content": "What's the weather in Paris?"}], tools=[WEATHER],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False),
    "json_schema_n2": dict(messages=[{"role": "user", "content": "Describe the weather in a European city as JSON."}],
                           response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                                                   "strict": True}}, n=2),
}


def constrained(client: openai.OpenAI, kwargs: dict, kill=None) -> tuple[dict, dict, str]:  # type: ignore[no-untyped-def]
    """({index: text or tool arguments}, {index: finish reason}, replica) of a streamed greedy request;
    ``kill(replica)`` once every choice has passed on 4 chunks of output."""
    out: dict[int, str] = {}
    finish: dict[int, str] = {}
    seen: dict[int, int] = {}
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, max_tokens=100, temperature=0, stream=True, **kwargs) as response:
        replica = response.headers[REPLICA_HEADER]
        for chunk in response.parse():
            for choice in chunk.choices:
                piece = choice.delta.content or "".join(c.function.arguments or "" for c in choice.delta.tool_calls or [])
                out[choice.index] = out.get(choice.index, "") + piece
                seen[choice.index] = seen.get(choice.index, 0) + bool(piece)
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
            if kill is not None and len(seen) == kwargs.get("n", 1) and min(seen.values()) >= 4:
                kill(replica)
                kill = None
    assert kill is None, "the stream ended before the kill"
    return out, finish, replica


def test_a_resumed_constrained_stream_is_valid_and_identical_json_schema_tool_call_and_n2(fleet):  # noqa: F811
    """Resumed on another replica, a stream's grammar state is rebuilt from the tokens already sent: the JSON
    still validates, the forced call still parses, and each of n=2 samples continues as it would have."""
    client = client_of(fleet.url)
    for name, kwargs in CONSTRAINED.items():
        undisturbed, finish, _ = constrained(client, kwargs)
        expected_finish = "tool_calls" if "tools" in kwargs else "stop"
        assert finish == {i: expected_finish for i in range(kwargs.get("n", 1))}, (name, finish)
        killed: list[str] = []

        def kill(replica: str, killed: list[str] = killed) -> None:
            fleet.workers[replica].proc.kill()  # kill -9 mid-stream
            killed.append(replica)

        resumed, finish, _ = constrained(client, {**kwargs, "stream_options": {"include_usage": True}}, kill)
        assert killed, name
        assert resumed == undisturbed, name  # token-identical to the undisturbed run, every sample
        assert finish == {i: expected_finish for i in range(kwargs.get("n", 1))}, (name, finish)
        for text in resumed.values():
            document = json.loads(text)
            jsonschema.validate(document, CITY if "response_format" in kwargs else WEATHER["function"]["parameters"])
        fleet.workers[killed[0]] = fleet.start_worker(killed[0])  # back for the next case
        wait_for(lambda: len(replicas(fleet.etcd.endpoint)) == 2, "both workers registered again", 120)
    assert metric(fleet.gateway, 'tokenfleet_gateway_resumes_total{result="ok"}') == len(CONSTRAINED)
