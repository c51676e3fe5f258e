"""CPU thread counts per step (backends.torch.device.small_step_threads: every thread unless asked) and torch work
off the engine thread (backends.torch.device.in_passing_thread)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from tokenfleet.backends.torch import device


@pytest.mark.parametrize(("threads", "cores"), [(2, 2), (16, 16), (1, 1), (1, 2), (4, 8)])
def test_small_steps_take_every_thread_unless_asked(monkeypatch, threads, cores):
    monkeypatch.setattr(device, "usable_cores", lambda: cores)
    assert device.small_step_threads(threads) == threads


def test_an_asked_count_is_kept_and_checked():
    assert device.small_step_threads(2, 2) == 2
    assert device.small_step_threads(2, 8) == 2  # never more than the worker's threads
    with pytest.raises(ValueError, match="small_step_threads"):
        device.small_step_threads(2, 0)


def test_the_runner_sets_each_steps_threads_by_its_tokens(default_model_dir, monkeypatch):
    from tests.model.helpers import greedy, make_core, run_to_completion
    from tokenfleet.models.tokenizer import Tokenizer

    core = make_core(default_model_dir, num_threads=2, small_step_threads=1)
    assert core.runner.step_threads == (1, 2)
    seen: list[int] = []
    real = core.runner.model.forward

    def forward(token_ids, batch, kv):  # type: ignore[no-untyped-def]
        seen.append((len(token_ids), torch.get_num_threads()))
        return real(token_ids, batch, kv)

    monkeypatch.setattr(core.runner.model, "forward", forward)
    prompt = Tokenizer(default_model_dir).encode("The capital of France is a city that")
    assert len(prompt) > device.SMALL_STEP_TOKENS
    try:
        run_to_completion(core, {0: [("a", prompt, greedy(3))]})
    finally:
        torch.set_num_threads(2)
    assert seen[0] == (len(prompt), 2)  # the prompt: every thread
    assert seen[1:] and all(entry == (1, 1) for entry in seen[1:])  # one token a step: the small count


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_torch_work_in_a_passing_thread_leaves_no_thread_behind():
    """A parallel op leaves an OpenMP pool on the thread that ran it; in_passing_thread's thread ends, and with it its
    pool (a pool left on an executor thread slows every engine step: libgomp stops spinning once pools outnumber
    the cores)."""
    torch.set_num_threads(2)
    before = _threads()

    def work() -> float:
        a = torch.randn(512, 512)
        return float((a @ a).sum())  # a matmul large enough to run on every thread

    assert isinstance(asyncio.run(device.in_passing_thread(work)), float)
    deadline = time.monotonic() + 10  # the pool's threads end just after the thread that owned them
    while _threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _threads() - before
    with pytest.raises(ZeroDivisionError):
        asyncio.run(device.in_passing_thread(lambda: 1 / 0))
