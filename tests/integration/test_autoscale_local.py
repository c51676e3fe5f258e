"""`tokenfleet up --autoscale` on real processes: load makes it start a second worker; when the load is gone it
drains and stops that worker. No request fails or comes back short, across both changes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from tests.integration.conftest import UpCluster, start_up, wait_for

AUTOSCALED = ("--workers", "1", "--threads", "1", "--model-name", "smol", "--autoscale", "--max-workers", "2",
              "--autoscale-metrics-port", "0")
ANNOUNCED = ("gateway:", "autoscaler metrics:")


def gauge(metrics: str, name: str) -> float:
    for line in urllib.request.urlopen(metrics, timeout=10).read().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    return -1.0


def serving(metrics: str) -> float:
    return max(gauge(metrics, "tokenfleet_autoscaler_serving_replicas"), 0.0)


@contextlib.contextmanager
def busy(client: openai.OpenAI, users: int = 6) -> Iterator[list[tuple[int, str]]]:
    """``users`` clients sending 24-token completions back to back while the block runs; yields their outcomes
    ((completion tokens, error) per request), complete once the block has left."""
    stop = threading.Event()
    outcomes: list[tuple[int, str]] = []

    def user(i: int) -> None:
        while not stop.is_set():
            try:
                out = client.completions.create(model="smol", prompt=f"Story {i}:", max_tokens=24,
                                                extra_body={"ignore_eos": True})
                outcomes.append((out.usage.completion_tokens, ""))
            except openai.APIError as e:
                outcomes.append((0, str(e)))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    try:
        yield outcomes
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)


def client_of(up: UpCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.announced["gateway:"], api_key="unused", max_retries=0, timeout=300)


@pytest.mark.nightly  # the warm-pool test keeps a scale-up in the suite
def test_up_autoscale_adds_a_worker_under_load_and_drains_it_after(default_model_dir, tmp_path):
    """With a shorter stabilization window and cooldown than the defaults (20 and 30 s): the same path, sooner."""
    up = start_up(tmp_path, *AUTOSCALED, "--model", str(default_model_dir), "--target-concurrency", "2",
                  "--scale-down-after", "5", "--scale-down-cooldown", "8", wait=ANNOUNCED)
    metrics = up.announced["autoscaler metrics:"]
    try:
        client = client_of(up)
        with busy(client) as outcomes:
            wait_for(lambda: serving(metrics) >= 2, "a second worker under load", 180)
        wait_for(lambda: serving(metrics) == 1, "back to one worker once idle", 240)
        assert outcomes and all(o == (24, "") for o in outcomes), [o for o in outcomes if o != (24, "")][:3]
        changes = {line.split("{")[1].split("}")[0]: float(line.split()[-1])
                   for line in urllib.request.urlopen(metrics, timeout=10).read().decode().splitlines()
                   if line.startswith("tokenfleet_autoscaler_changes_total{")}
        assert changes['direction="up",pool="smol/both"'] >= 1 and changes['direction="down",pool="smol/both"'] >= 1
        assert "[supervisor] worker-1" not in up.log.read_text()  # a drained worker is retired, not restarted
        reply = client.completions.create(model="smol", prompt="Hi", max_tokens=3)
        assert reply.usage.completion_tokens == 3
    finally:
        up.stop()


def test_up_autoscale_with_a_warm_pool_activates_the_standby_worker(default_model_dir, tmp_path):
    """--warm-pool 1: a second worker is loaded and warmed up but out of the fleet until a scale-up activates it."""
    up = start_up(tmp_path, *AUTOSCALED, "--model", str(default_model_dir), "--target-concurrency", "2",
                  "--warm-pool", "1", wait=ANNOUNCED)
    metrics = up.announced["autoscaler metrics:"]
    try:
        wait_for(lambda: gauge(metrics, "tokenfleet_autoscaler_standby_replicas") == 1, "a standby worker", 180)
        assert serving(metrics) == 1  # loaded, but the fleet does not see it
        with busy(client_of(up)) as outcomes:
            wait_for(lambda: serving(metrics) >= 2, "the standby worker serving under load", 180)
        assert outcomes and all(o == (24, "") for o in outcomes), [o for o in outcomes if o != (24, "")][:3]
        assert gauge(metrics, "tokenfleet_autoscaler_standby_replicas") == 0  # no room left at --max-workers 2
    finally:
        up.stop()
    said = "".join(up.said) + up.log.read_text()  # the launcher's own log lines
    assert "autoscale activated a standby worker" in said and "autoscale started a worker" not in said


@pytest.mark.nightly  # a long scenario; the warm-pool test stays in the suite
def test_a_scale_down_under_load_finishes_every_stream_of_the_removed_worker_unchanged(default_model_dir, tmp_path):
    """fp32, greedy: streams open on the worker an operator's override removes finish there (drain), each with the
    same text as the same request undisturbed on the remaining worker afterwards."""
    up = start_up(tmp_path, *AUTOSCALED, "--model", str(default_model_dir), "--dtype", "float32", wait=ANNOUNCED)
    metrics = up.announced["autoscaler metrics:"]
    pool = "smol/both"

    def autoscale(*words: str) -> None:
        subprocess.run([sys.executable, "-m", "tokenfleet.cli", "autoscale", *words], env=up.env, check=True,
                       capture_output=True, timeout=60)

    try:
        autoscale("--set", pool, "2")  # the operator holds two workers...
        wait_for(lambda: serving(metrics) == 2, "two workers", 180)
        client = client_of(up)
        prompts = [f"Write a long story about lighthouse keeper number {i}." for i in range(6)]
        results: dict[int, tuple[str, str, int]] = {}

        def stream(i: int) -> None:
            raw = client.completions.with_raw_response.create(model="smol", prompt=prompts[i], max_tokens=80,
                                                              temperature=0, stream=True,
                                                              extra_body={"ignore_eos": True},
                                                              stream_options={"include_usage": True})
            text, tokens = "", 0
            for chunk in raw.parse():
                text += "".join(c.text for c in chunk.choices)
                tokens = chunk.usage.completion_tokens if chunk.usage else tokens
            results[i] = (raw.headers.get("x-tokenfleet-replica", ""), text, tokens)

        users = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for u in users:
            u.start()
        time.sleep(1.0)  # every stream placed and generating
        autoscale("--set", pool, "1")  # ...then takes one away while the streams run
        wait_for(lambda: serving(metrics) == 1, "the scale-down", 180)
        for u in users:
            u.join(timeout=300)
        removed = [i for i, (replica, _, _) in results.items() if replica == "worker-1"]
        assert len(results) == len(prompts) and removed, results  # some streams were on the removed worker
        assert all(tokens == 80 for _, _, tokens in results.values()), results
        def undisturbed(i: int) -> str:  # now on the one worker left; batched together, as the streams were
            return client.completions.create(model="smol", prompt=prompts[i], max_tokens=80, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as executor:
            for i, text in enumerate(executor.map(undisturbed, range(len(prompts)))):
                assert text == results[i][1], (i, results[i][0])
        autoscale("--clear", pool)
    finally:
        up.stop()
