"""CPU thread counts per step (backends.torch.device.small_step_threads): a step of a few tokens leaves a core to
the service path when a quantized record's worker's threads take every core; dense weights' and longer steps take
them all."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.backends.torch import device


@pytest.mark.parametrize(("threads", "cores", "want"), [(2, 2, 1), (16, 16, 15), (1, 1, 1), (1, 2, 1), (4, 8, 4)])
def test_small_steps_leave_a_core_only_when_the_worker_takes_every_core(monkeypatch, threads, cores, want):
    monkeypatch.setattr(device, "usable_cores", lambda: cores)
    assert device.small_step_threads(threads) == want
    assert device.small_step_threads(threads, quantized=False) == threads  # dense weights keep every thread


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
