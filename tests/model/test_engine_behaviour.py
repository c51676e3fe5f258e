"""Engine-level guarantees on the real default model (fp32, greedy)."""

from __future__ import annotations

import pytest

from tests.model.helpers import assert_no_leak, greedy, make_core, run_to_completion
from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.request import FinishReason
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams

TOPICS = ["the moon", "bread", "rivers", "chess", "winter", "bees", "trains", "music"]


def prompts(core, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = f"Tell me something about {TOPICS[i % len(TOPICS)]}." + " Please be detailed." * (i % 4)
        out.append(core.tokenizer.encode(render_chat(core.tokenizer, [{"role": "user", "content": text}])))
    return out


@pytest.fixture(scope="module")
def alone(fp32_core):
    """Reference: each prompt run alone (16 greedy tokens, EOS ignored so lengths are equal)."""
    ps = prompts(fp32_core, 6)
    ref = {}
    for i, p in enumerate(ps):
        ref[f"p{i}"] = run_to_completion(fp32_core, {0: [(f"p{i}", p, greedy(16, ignore_eos=True))]})[f"p{i}"]
    return ps, ref


def test_batch_invariance_with_staggered_arrivals(fp32_core, alone):
    ps, ref = alone
    arrivals: dict[int, list] = {}
    for i, p in enumerate(ps):
        arrivals.setdefault(i * 2, []).append((f"p{i}", p, greedy(16, ignore_eos=True)))
    fp32_core.scheduler.block_manager.reset_prefix_cache()
    together = run_to_completion(fp32_core, arrivals)
    assert together == ref
    assert_no_leak(fp32_core.scheduler.block_manager)


def test_chunked_prefill_equals_unchunked(default_model_dir, alone):
    ps, ref = alone
    core = make_core(default_model_dir, max_prefill_chunk=7, max_num_batched_tokens=24, enable_prefix_caching=False)
    arrivals = {0: [(f"p{i}", p, greedy(16, ignore_eos=True)) for i, p in enumerate(ps)]}
    assert run_to_completion(core, arrivals) == ref
    assert core.snapshot().num_steps > 16  # prompts really were split into chunks
    assert_no_leak(core.scheduler.block_manager)


def test_forced_preemption_gives_identical_outputs_and_leaks_nothing(default_model_dir, alone):
    ps, ref = alone
    # 14 blocks of 16 tokens cannot hold six ~50-token prompts plus 16 outputs each.
    core = make_core(default_model_dir, num_blocks=14, block_size=16)
    arrivals = {0: [(f"p{i}", p, greedy(16, ignore_eos=True)) for i, p in enumerate(ps)]}
    assert run_to_completion(core, arrivals) == ref
    assert core.snapshot().num_preemptions > 0
    assert_no_leak(core.scheduler.block_manager)


def test_prefix_cache_hit_reports_tokens_and_keeps_output(default_model_dir):
    core = make_core(default_model_dir)
    system = "You are a meticulous assistant. " * 12
    messages = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    first = core.tokenizer.encode(render_chat(core.tokenizer, messages("What is rain?")))
    second = core.tokenizer.encode(render_chat(core.tokenizer, messages("What is snow?")))
    cold = make_core(default_model_dir, enable_prefix_caching=False)
    expected = run_to_completion(cold, {0: [("b", second, greedy(12))]})["b"]

    run_to_completion(core, {0: [("a", first, greedy(4))]})
    cached = []
    rid = core.add_request(RequestSpec(second, greedy(12), request_id="b"))
    tokens = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
            cached.append(out.num_cached_tokens)
    assert rid == "b"
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert cached[-1] == (shared // 16) * 16 and cached[-1] >= 64
    assert tokens == expected
    assert core.snapshot().num_prefix_hit_tokens == cached[-1]
    assert_no_leak(core.scheduler.block_manager)


def test_stop_string_is_not_emitted(fp32_core):
    prompt = fp32_core.tokenizer.encode(
        render_chat(fp32_core.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    )
    free = run_to_completion(fp32_core, {0: [("free", prompt, greedy(20))]})["free"]
    full_text = fp32_core.tokenizer.decode(free)
    assert "Paris" in full_text  # the reference continuation, so the stop below is meaningful
    fp32_core.add_request(RequestSpec(prompt, greedy(20, stop=("Paris",)), request_id="stopped"))
    text, reason, stop_reason = "", None, None
    while fp32_core.has_unfinished():
        for out in fp32_core.step():
            text += out.text
            if out.finished:
                reason, stop_reason = out.finish_reason, out.stop_reason
    assert text == full_text[: full_text.index("Paris")]
    assert reason is FinishReason.STOP and stop_reason == "Paris"
    assert_no_leak(fp32_core.scheduler.block_manager)


def test_abort_frees_blocks_mid_generation(fp32_core):
    prompt = prompts(fp32_core, 1)[0]
    fp32_core.add_request(RequestSpec(prompt, greedy(50, ignore_eos=True), request_id="to-abort"))
    for _ in range(3):
        fp32_core.step()
    assert fp32_core.scheduler.block_manager.num_used_blocks > 0
    final = fp32_core.abort("to-abort")
    assert final is not None and final.finished and final.finish_reason is FinishReason.ABORT
    assert fp32_core.abort("to-abort") is None
    assert not fp32_core.has_unfinished()
    assert_no_leak(fp32_core.scheduler.block_manager)


def test_seeded_sampling_is_reproducible_across_batches(fp32_core):
    ps = prompts(fp32_core, 3)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = run_to_completion(fp32_core, {0: [("s", ps[0], params)]})["s"]
    other = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    mixed = run_to_completion(fp32_core, {0: [("o1", ps[1], other)], 1: [("s", ps[0], params), ("o2", ps[2], other)]})
    assert mixed["s"] == alone


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "empty"), ([1] * 8192, "context"), ([49152], "out of range"), ([-1], "out of range")],
)
def test_bad_prompts_rejected_before_scheduling(fp32_core, prompt, message):
    with pytest.raises(ValueError, match=message):
        fp32_core.add_request(RequestSpec(prompt, greedy(4)))
    assert not fp32_core.has_unfinished()


def test_max_tokens_none_is_capped_by_context(default_model_dir):
    core = make_core(default_model_dir, max_model_len=40)
    core.add_request(RequestSpec(list(range(100, 130)), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)))
    tokens, reason = [], None
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
    assert len(tokens) == 10 and reason is FinishReason.LENGTH
