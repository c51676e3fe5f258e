"""Overlapped scheduling (``CoreParts.overlap``, ``engine.lookahead``, ``TorchModelRunner.launch``) on the
default model's real weights in fp32: the next decode step is queued before the host reads the running step's
tokens (on CPU the "device" is the CPU itself, so this checks the bookkeeping, not the speed: the GPU figures
come from benchmarks/gpu_step.py). Every output must equal the plain engine's, token for token, text, logprobs
and finish reasons included, through stop strings and stop tokens found one step late, aborts while a step is
queued, arrivals, prefix-cache hits and a pool too small to look ahead; no block may leak."""

from __future__ import annotations

import pytest

from tests.model.helpers import make_core
from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.lookahead import lookahead
from tokenfleet.engine.request import FinishReason, Request
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
from tokenfleet.models.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "Write a haiku about rain:", "1, 2, 3, 4,", "Once upon a time",
           "List three colours:"]


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tokenizer = Tokenizer(default_model_dir)
    return [tokenizer.encode(p) for p in PROMPTS]


def drive(core, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
          aborts: dict[int, list[str]] | None = None) -> dict[str, dict]:
    """Run to completion; arrivals and aborts before the given step. Per request: tokens, text, logprobs, finish."""
    aborts = aborts or {}
    got: dict[str, dict] = {}
    step = 0
    while step <= max([*arrivals, *aborts], default=0) or core.has_unfinished():
        for request_id, prompt, params in arrivals.get(step, []):
            core.add_request(RequestSpec(prompt, params, request_id=request_id))
            got[request_id] = {"tokens": [], "text": "", "logprobs": [], "finish": None}
        for request_id in aborts.get(step, []):
            out = core.abort(request_id)
            if out is not None:
                got[request_id]["finish"] = out.finish_reason
        for out in core.step():
            g = got[out.request_id]
            g["tokens"] += out.new_token_ids
            g["text"] += out.text
            g["logprobs"] += [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
            if out.finish_reason is not None:
                g["finish"] = out.finish_reason
        step += 1
    return got


def same(a: dict[str, dict], b: dict[str, dict]) -> bool:
    """Tokens, text and finish reasons equal; logprobs equal up to fp32 noise (a queued step may carry a row more
    than the plain engine's step, and fp32 GEMMs round differently for another row count)."""
    if a.keys() != b.keys():
        return False
    for rid in a:
        x, y = a[rid], b[rid]
        if (x["tokens"], x["text"], x["finish"]) != (y["tokens"], y["text"], y["finish"]):
            return False
        if len(x["logprobs"]) != len(y["logprobs"]):
            return False
        for (t1, v1, top1), (t2, v2, top2) in zip(x["logprobs"], y["logprobs"]):
            if t1 != t2 or abs(v1 - v2) > 1e-4 or [i for i, _ in top1] != [i for i, _ in top2]:
                return False
            if any(abs(p - q) > 1e-4 for (_, p), (_, q) in zip(top1, top2)):
                return False
    return True


def both(default_model_dir, arrivals, aborts=None, **options):
    plain = make_core(default_model_dir, num_threads=2, **options)
    overlapped = make_core(default_model_dir, num_threads=2, async_scheduling=True, **options)
    assert overlapped.overlap and not plain.overlap
    a, b = drive(plain, arrivals, aborts), drive(overlapped, arrivals, aborts)
    for core in (plain, overlapped):
        core.scheduler.block_manager.check_invariants()
        assert not core.has_unfinished() and core.scheduler.block_manager.num_used_blocks == 0
    return a, b, overlapped.snapshot()


def test_outputs_equal_the_plain_engine_s_through_stops_found_a_step_late(default_model_dir, prompts):
    greedy = dict(temperature=0.0)
    plain_run = drive(make_core(default_model_dir, num_threads=2), {0: [("probe", prompts[0], SamplingParams(
        max_tokens=12, **greedy))]})
    stop_token = plain_run["probe"]["tokens"][5]  # a token greedy decoding emits mid-way: a stop id found late
    arrivals = {
        0: [("greedy", prompts[0], SamplingParams(max_tokens=20, **greedy)),
            ("stop-id", prompts[0], SamplingParams(max_tokens=20, stop_token_ids=[stop_token], **greedy)),
            ("logprobs", prompts[1], SamplingParams(max_tokens=14, logprobs=3, **greedy))],
        2: [("seeded", prompts[2], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11)),
            ("top-k", prompts[3], SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=3))],
        6: [("stop-string", prompts[4], SamplingParams(max_tokens=30, stop=[","], **greedy))],
    }
    plain, overlapped, stats = both(default_model_dir, arrivals)
    assert same(overlapped, plain)
    assert plain["stop-id"]["finish"] is FinishReason.STOP and plain["stop-id"]["tokens"][-1] == stop_token
    assert plain["greedy"]["finish"] is FinishReason.LENGTH and len(plain["greedy"]["tokens"]) == 20
    assert len(plain["logprobs"]["logprobs"]) == 14 and len(plain["logprobs"]["logprobs"][0][2]) == 3
    assert stats.num_overlapped_steps > 10  # decode steps really were queued ahead
    assert stats.num_overlap_discarded_rows >= 1  # the stop id's row of the step queued behind it


def test_aborts_while_a_step_is_queued_and_prefix_hits_change_nothing(default_model_dir, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, params) for i, p in enumerate(prompts[:4])],
                4: [("again", prompts[0], params)],  # the first prompt's blocks are cached by now
                9: [("late", prompts[1] + prompts[2], params)]}
    plain, overlapped, stats = both(default_model_dir, arrivals, aborts={5: ["r1"], 7: ["again", "nobody"]})
    aborted = ("r1", "again")
    assert same({k: v for k, v in overlapped.items() if k not in aborted},
                {k: v for k, v in plain.items() if k not in aborted})
    for rid in aborted:  # an arrival joins one step later when a step is already queued: aborts cut a step apart
        a, b = plain[rid]["tokens"], overlapped[rid]["tokens"]
        assert plain[rid]["finish"] is overlapped[rid]["finish"] is FinishReason.ABORT
        assert 0 < len(a) < 16 and 0 < len(b) < 16 and abs(len(a) - len(b)) <= 1
        assert a[: len(b)] == b[: len(a)]
    assert plain["r0"]["tokens"][: len(plain["again"]["tokens"])] == plain["again"]["tokens"]
    assert stats.num_overlapped_steps > 5


def test_a_pool_too_small_to_look_ahead_falls_back_and_preempts_as_before(default_model_dir, prompts):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"p{i}", prompts[i % 2] * 3, params) for i in range(3)]}
    plain, overlapped, stats = both(default_model_dir, arrivals, num_blocks=7, enable_prefix_caching=False)
    assert same(overlapped, plain)
    assert all(len(g["tokens"]) == 24 for g in plain.values())
    assert stats.num_preemptions > 0 and stats.num_overlapped_steps > 0  # both kinds of step happened


def test_requests_that_read_their_output_so_far_are_not_run_ahead(default_model_dir, prompts):
    """Penalties and min_tokens read the output the host has not seen yet in a queued step: their steps stay
    synchronous (and give the plain engine's tokens)."""
    arrivals = {0: [("penalized", prompts[0], SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3)),
                    ("min-tokens", prompts[1], SamplingParams(max_tokens=10, temperature=0.0, min_tokens=8))]}
    plain, overlapped, stats = both(default_model_dir, arrivals)
    assert same(overlapped, plain)
    # min_tokens stops holding back after 7 outputs: the last steps may run ahead, the penalized request's never
    assert stats.num_overlapped_steps <= 2


def test_min_tokens_ends_its_ban_on_the_same_token(default_model_dir, prompts):
    """The sampler bans stop ids while the output is shorter than min_tokens; a queued step sees one token less on
    the host, so the first step after the ban must not be run ahead (found in review: it banned one token too many)."""
    probe = drive(make_core(default_model_dir, num_threads=2),
                  {0: [("probe", prompts[3], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]})
    tokens = probe["probe"]["tokens"]
    m = next(i for i in range(3, 16) if tokens[i] not in tokens[:i])  # its first occurrence: a stop allowed there
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[tokens[m]], min_tokens=m)
    plain, overlapped, stats = both(default_model_dir, {0: [("min", prompts[3], params)]})
    assert same(overlapped, plain)
    assert plain["min"]["tokens"] == tokens[: m + 1] and plain["min"]["finish"] is FinishReason.STOP


def test_an_id_reused_after_an_abort_never_gets_the_queued_step_s_rows(default_model_dir, prompts):
    """Every request of a queued step aborted, then a new request under one of their ids: it starts from its own
    prompt (nothing of the queued step lands in it) and generates what it generates alone."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = drive(make_core(default_model_dir, num_threads=2), {0: [("x", prompts[2], params)]})["x"]
    core = make_core(default_model_dir, num_threads=2, async_scheduling=True)
    for rid, prompt in (("x", prompts[0]), ("y", prompts[1])):
        core.add_request(RequestSpec(prompt, params, request_id=rid))
    for _ in range(4):
        core.step()
    assert core._inflight is not None  # a step is queued
    core.abort("x")
    core.abort("y")
    assert core._inflight is None and not core.has_unfinished()
    got = drive(core, {0: [("x", prompts[2], params)]})["x"]
    assert same({"x": got}, {"x": alone})
    core.scheduler.block_manager.check_invariants()


def make_scheduler(num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=256, max_num_batched_tokens=256), BlockManager(num_blocks, 4), "t")


def decode_step(sched: Scheduler, *requests: Request):
    for r in requests:
        sched.add_request(r)
    output = sched.schedule(0.0)  # prefill
    sched.update(output, {s.request_id: 7 for s in output.scheduled if s.samples})
    return sched.schedule(0.0)  # the first decode step


def test_lookahead_is_the_decode_step_one_position_on():
    sched = make_scheduler()
    a = Request("a", list(range(1, 8)), SamplingParams(max_tokens=5), max_tokens=5)
    b = Request("b", list(range(1, 4)), SamplingParams(max_tokens=2), max_tokens=2)
    output = decode_step(sched, a, b)
    following = lookahead(sched, output)
    assert following is not None
    # b ends by length with output's token: not run ahead; a one position on, a slot allocated for it
    assert [(s.request_id, s.start, s.num_new_tokens, s.samples) for s in following.scheduled] == [("a", 8, 1, True)]
    assert len(following.scheduled[0].block_ids) == 3  # 9 tokens in blocks of 4
    sched.update(output, {"a": 9, "b": 9})
    assert sched.requests.get("b") is None  # ended, as the lookahead expected
    sched.update(following, {"a": 10})
    assert a.output_token_ids == [7, 9, 10] and a.num_computed_tokens == 9
    sched.block_manager.check_invariants()


@pytest.mark.parametrize("case", ["waiting", "penalties", "min-tokens", "min-tokens-boundary", "no-blocks", "prefill"])
def test_lookahead_declines_what_needs_the_full_scheduler(case):
    sched = make_scheduler(num_blocks=2 if case == "no-blocks" else 64)
    params = {"penalties": SamplingParams(max_tokens=9, presence_penalty=0.5),
              "min-tokens": SamplingParams(max_tokens=9, min_tokens=5),
              # one output on the host, min_tokens 2: the queued step's sampler would still ban stops
              "min-tokens-boundary": SamplingParams(max_tokens=9, min_tokens=2)}.get(case, SamplingParams(max_tokens=9))
    prompt = list(range(1, 8)) if case == "no-blocks" else list(range(1, 4))
    a = Request("a", prompt, params, max_tokens=9)
    if case == "prefill":
        sched.add_request(a)
        assert lookahead(sched, sched.schedule(0.0)) is None
        return
    output = decode_step(sched, a)
    if case == "waiting":
        sched.add_request(Request("b", [1, 2], SamplingParams(max_tokens=3), max_tokens=3))
    if case == "no-blocks":  # 8 tokens in blocks of 4 fill both blocks; the next position needs a third
        assert sched.block_manager.num_free_blocks == 0 and output.scheduled[0].start == 7
    assert lookahead(sched, output) is None


def test_overlap_on_cpu_is_allowed_with_a_warning(default_model_dir):
    """On CPU the queued forward runs before the running step's outputs go out: allowed (the tests above need it),
    but the operator is told it only adds latency there."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        core = make_core(default_model_dir, num_threads=2, async_scheduling=True, num_blocks=16)
    assert core.overlap
    assert any("async_scheduling on CPU" in entry["event"] and entry["log_level"] == "warning" for entry in logs)
    with capture_logs() as logs:
        make_core(default_model_dir, num_threads=2, num_blocks=16)
    assert not any("async_scheduling" in entry["event"] for entry in logs)
