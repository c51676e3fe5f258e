"""n > 1: the samples of a request fork from it when its prompt is computed and share its blocks
(copy-on-write of the partially filled last block), in the pure scheduler and in the real engine."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import make_request, make_scheduler
from tokenfleet.engine.request import FinishReason, RequestStatus
from tokenfleet.engine.request_spec import RequestSpec


def _forks(parent, n):
    return [dataclasses.replace(parent, request_id=f"{parent.request_id}#{i}", output_token_ids=[], block_hashes=[],
                                index=i) for i in range(1, n)]


def _run_step(scheduler, tokens):
    out = scheduler.schedule(0.0)
    sampled = {}
    for s in out.scheduled:
        if s.samples:
            for rid in (s.request_id, *s.forks):
                sampled[rid] = tokens.get(rid, 7)
    return out, scheduler.update(out, sampled)


def test_forks_share_prompt_blocks_and_copy_only_the_partial_last_one():
    s = make_scheduler(num_blocks=32, block_size=4)
    parent = make_request(num_prompt_tokens=10, max_tokens=4)  # 3 blocks, the last holds 2 tokens
    s.add_request(parent, _forks(parent, 3))
    out, _ = _run_step(s, {})
    assert out.scheduled[0].forks == (f"{parent.request_id}#1", f"{parent.request_id}#2")
    bm = s.block_manager
    table = bm.block_table(parent.request_id)
    assert [bm.ref_count(b) for b in table] == [3, 3, 3]  # one table's blocks, three owners
    assert bm.num_used_blocks == 3
    assert s.num_forks == 2 and s.num_fork_shared_blocks == 6
    assert all(s.requests[f"{parent.request_id}#{i}"].status is RequestStatus.RUNNING for i in (1, 2))
    out, _ = _run_step(s, {})  # every sample writes its token 11 into the shared partial block
    assert len(out.copies) == 2 and s.num_block_copies == 2  # two copies; the last writer keeps the original
    assert bm.num_used_blocks == 2 + 3  # full blocks shared, three private last blocks
    assert [bm.ref_count(b) for b in table[:2]] == [3, 3]
    bm.check_invariants()


def test_forks_finish_independently_and_free_everything():
    s = make_scheduler(num_blocks=32, block_size=4)
    parent = make_request(num_prompt_tokens=8, max_tokens=3, eos_token_ids=(2,))
    s.add_request(parent, _forks(parent, 3))
    _, finished = _run_step(s, {f"{parent.request_id}#1": 2})  # sample 1 ends on its first token
    assert [r.request_id for r in finished] == [f"{parent.request_id}#1"]
    while s.has_unfinished():
        _run_step(s, {})
    assert s.block_manager.num_used_blocks == 0 and not s.forks and not s.pending_forks
    s.block_manager.check_invariants()


def test_aborting_a_request_drops_its_pending_samples():
    s = make_scheduler(num_blocks=32, block_size=4)
    parent = make_request(num_prompt_tokens=8, max_tokens=3)
    s.add_request(parent, _forks(parent, 2))
    fork = s.pending_forks[f"{parent.request_id}#1"]
    s.finish_request(parent.request_id, FinishReason.ABORT)
    assert fork.status is RequestStatus.FINISHED and not s.pending_forks and not s.has_unfinished()


def test_preempted_before_forking_still_forks_once():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=4)  # chunked: 3 steps for 10 tokens
    parent = make_request(num_prompt_tokens=10, max_tokens=2)
    s.add_request(parent, _forks(parent, 2))
    out, _ = _run_step(s, {})
    assert not out.scheduled[0].forks  # a middle chunk does not sample
    s._preempt(parent)
    while s.has_unfinished():
        _run_step(s, {})
    assert s.num_forks == 1


@pytest.fixture(scope="module")
def core(default_model_dir):
    from tokenfleet.backends.torch.builder import build_engine_core
    from tokenfleet.engine.config import EngineConfig

    return build_engine_core(EngineConfig(model=str(default_model_dir), dtype="float32", num_threads=1,
                                          num_blocks=128))


def test_real_engine_n3_seeded_samples_differ_reproduce_and_sample0_matches_n1(core):
    from tokenfleet.engine.sampling_params import SamplingParams

    prompt = core.tokenizer.encode("Once upon a time, in a quiet village by the sea,")

    def run(params):
        rid = core.add_request(RequestSpec(prompt, params))
        texts: dict[int, list[int]] = {}
        while core.has_unfinished():
            for out in core.step():
                texts.setdefault(out.index, []).extend(out.new_token_ids)
        core.scheduler.block_manager.check_invariants()
        assert core.scheduler.block_manager.num_used_blocks == 0, rid
        return texts

    three = run(SamplingParams(max_tokens=10, temperature=1.0, seed=42, n=3))
    again = run(SamplingParams(max_tokens=10, temperature=1.0, seed=42, n=3))
    one = run(SamplingParams(max_tokens=10, temperature=1.0, seed=42))
    assert sorted(three) == [0, 1, 2] and three == again
    assert len({tuple(v) for v in three.values()}) == 3
    assert three[0] == one[0]  # sample 0 is the request itself, seed unchanged


def test_offline_llm_returns_every_sample(default_model_dir):
    from tokenfleet.engine.sampling_params import SamplingParams
    from tokenfleet.llm import LLM

    llm = LLM(str(default_model_dir), dtype="float32", num_threads=1, num_blocks=64)
    first, second = llm.generate(["Hello, my name is", "The sea is"],
                                 [SamplingParams(max_tokens=5, temperature=1.0, seed=1, n=3, ignore_eos=True),
                                  SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)])
    assert len(first.samples) == 2 and not second.samples
    assert all(len(c.token_ids) == 5 for c in (first, *first.samples)) and len(second.token_ids) == 4
    assert len({tuple(c.token_ids) for c in (first, *first.samples)}) == 3


def test_review_regressions_abort_before_forking_huge_seeds_and_fork_ids(core):
    """Found in review: aborting before the prompt was computed lost the pending samples' finals
    (their streams hung); seed + i overflowed torch's generator inside the step; a caller id equal
    to a sample's id collided with it at fork time."""
    from tokenfleet.engine.sampling_params import SamplingParams

    prompt = core.tokenizer.encode("A long prompt about the sea. " * 8)
    rid = core.add_request(RequestSpec(prompt, SamplingParams(max_tokens=4, temperature=1.0, n=3)))
    finals = core.abort_group(rid)
    assert sorted(o.index for o in finals) == [0, 1, 2] and all(o.finished for o in finals)
    assert not core.scheduler.pending_forks and not core._groups and not core._states

    outs = []
    core.add_request(RequestSpec(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=2**64 - 1, n=2)))
    while core.has_unfinished():
        outs += core.step()
    assert sorted(o.index for o in outs if o.finished) == [0, 1]
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="'#'"):
        core.add_request(RequestSpec(prompt, SamplingParams(max_tokens=2), request_id="x#1"))
    core.scheduler.block_manager.check_invariants()
    assert core.scheduler.block_manager.num_used_blocks == 0


def test_a_request_with_samples_waits_until_they_fit_the_batch():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_running=3)
    first = make_request(num_prompt_tokens=4, max_tokens=5)
    s.add_request(first)
    s.schedule(0.0)
    parent = make_request(num_prompt_tokens=4, max_tokens=2)
    s.add_request(parent, _forks(parent, 3))  # 1 + 2 samples + the running one > 3
    out = s.schedule(0.0)
    assert [e.request_id for e in out.scheduled] == [first.request_id]
