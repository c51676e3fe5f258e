"""Tier priority and token-weighted fair queuing between tenants (VTC) in the scheduler, with
time passed in (arrival times are plain numbers; no clock)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_request, make_scheduler
from tokenfleet.engine.fair_queue import FairQueue
from tokenfleet.engine.request import FinishReason, Priority, RequestStatus


def tenant_request(tenant: str, t: float, prompt: int = 8, max_tokens: int = 4, priority: int = Priority.INTERACTIVE):
    r = make_request(num_prompt_tokens=prompt, max_tokens=max_tokens, arrival_time=t, priority=priority)
    r.tenant = tenant
    return r


def expected_admissions(k: int, counters: dict[str, float], heads: dict[tuple[int, str], list]) -> list[str]:
    """The next ``k`` admissions by the rule, computed here from the counters: the best priority
    class first; in it, the tenant with the smallest counter (ties: the older request), FCFS within
    a tenant; each admission charges its tenant for the prompt tokens it computes."""
    counters, heads = dict(counters), {q: list(rs) for q, rs in heads.items() if rs}
    order = []
    for _ in range(k):
        (priority, tenant), queue = min(
            heads.items(), key=lambda item: (item[0][0], counters.get(item[0][1], 0.0), item[1][0].arrival_time)
        )
        request = queue.pop(0)
        if not queue:
            del heads[(priority, tenant)]
        order.append(request.request_id)
        counters[tenant] = counters.get(tenant, 0.0) + request.num_prompt_tokens  # prompt weight 1, no cache hits
    return order


def step(sched, admitted: list[str]) -> None:
    """One schedule/update. Records, in order, the requests admitted from the waiting queue, and
    checks them against ``expected_admissions`` (no preemptions or partial prefills here)."""
    waiting = [r for _, r in sched.waiting]
    heads: dict[tuple[int, str], list] = {}
    for r in waiting:
        heads.setdefault((r.priority, r.tenant), []).append(r)
    counters = dict(sched.waiting.counters)
    out = sched.schedule(0.0)
    assert not out.preempted_ids
    ids = {r.request_id for r in waiting}
    now = [entry.request_id for entry in out.scheduled if entry.request_id in ids]
    assert now == expected_admissions(len(now), counters, heads), counters
    admitted += now
    sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
    sched.block_manager.check_invariants()


def test_a_late_tenant_is_admitted_ahead_of_a_flooding_tenants_backlog_and_both_keep_being_served():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_running=2)
    flood = [tenant_request("A", 0.0) for _ in range(12)]
    for r in flood:
        sched.add_request(r)
    admitted: list[str] = []
    for _ in range(6):  # A alone for a while: its counter grows with every token it is served
        step(sched, admitted)
    late = [tenant_request("B", 5.0) for _ in range(3)]
    for r in late:
        sched.add_request(r)
    counters = sched.waiting.counters
    assert counters["A"] == 4 * 8 + 2 * 4 * 2 + 2 * 2 * 2  # 4 prompts; 2 done x 4 tokens x weight 2; 2 running x 2
    assert counters["B"] == counters["A"]  # lifted to the active minimum: B starts level with A, not at 0
    b_ids = {r.request_id for r in late}
    first_after = len(admitted)
    while sched.has_unfinished():
        step(sched, admitted)  # each admission checked against the counters (expected_admissions)
    after = ["B" if rid in b_ids else "A" for rid in admitted[first_after:]]
    # Both slots free together every 4 steps. A's two running requests meanwhile decode two more
    # tokens each, 2 x 2 x 2 = 8 more than B, so B (smaller counter) goes first; its prompt (8) brings it level with A, and on the
    # tie the older request (A's) takes the second slot. So B's three requests are interleaved with
    # A's backlog, one each per round, and A keeps being served; then A's remaining five.
    assert after == ["B", "A"] * 3 + ["A"] * 5
    assert sorted(admitted) == sorted(r.request_id for r in flood + late)  # everyone finished


def test_an_idle_tenant_earns_no_credit_it_is_lifted_to_the_active_minimum():
    queue = FairQueue()
    queue.charge("A", prompt_tokens=1000)
    queue.charge("B", prompt_tokens=600)
    queue.activate("C", {"A", "B"})
    assert queue.counters["C"] == 600  # not 0: it cannot jump ahead of everyone for the time it was away
    queue.charge("C", output_tokens=10)
    assert queue.counters["C"] == 620
    queue.activate("C", {"A", "B"})  # a lift never lowers a counter
    assert queue.counters["C"] == 620
    queue.activate("D", set())  # nobody active: nothing to lift to
    assert queue.counters.get("D", 0.0) == 0.0


def test_counters_charge_computed_prompt_tokens_when_scheduled_and_output_tokens_when_sampled():
    sched = make_scheduler(num_blocks=64, block_size=4, fair_output_weight=3.0)
    prompt = list(range(200, 216))
    first = tenant_request("A", 0.0, prompt=0, max_tokens=2)
    first.prompt_token_ids = list(prompt)
    sched.add_request(first)
    out = sched.schedule(0.0)
    assert sched.waiting.counters["A"] == 16  # charged at scheduling, before the forward
    sched.update(out, {first.request_id: 7})
    assert sched.waiting.counters["A"] == 16 + 3
    out = sched.schedule(0.0)
    sched.update(out, {first.request_id: 7})
    assert first.is_finished and sched.waiting.counters["A"] == 16 + 3 + 3
    again = tenant_request("A", 1.0, prompt=0, max_tokens=1)
    again.prompt_token_ids = list(prompt)
    sched.add_request(again)
    out = sched.schedule(0.0)
    assert out.scheduled[0].start == 12  # three cached blocks: only the last 4 prompt tokens are computed
    assert sched.waiting.counters["A"] == 22 + 4


def test_a_tenant_returning_through_a_failed_remote_prefill_is_lifted_too():
    sched = make_scheduler(num_blocks=64, block_size=4)
    sched.add_request(tenant_request("A", 0.0))
    sched.waiting.charge("A", prompt_tokens=500)
    sched.waiting.charge("B", prompt_tokens=3)  # stale credit from long ago
    remote = tenant_request("B", 1.0)
    assert sched.add_remote(remote) == 0
    sched.fallback_to_local(remote.request_id)
    assert sched.waiting.counters["B"] == 500


def test_interactive_before_batch_whatever_the_counters_and_batch_preempted_first():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_running=1)
    sched.waiting.charge("rich", prompt_tokens=10_000)  # a huge counter does not demote an interactive request
    batch = tenant_request("poor", 0.0, priority=Priority.BATCH)
    interactive = tenant_request("rich", 1.0)
    sched.add_request(batch)
    sched.add_request(interactive)
    admitted: list[str] = []
    step(sched, admitted)
    assert admitted == [interactive.request_id]

    tight = make_scheduler(num_blocks=6, block_size=4, max_num_running=4)
    b = tenant_request("x", 0.0, prompt=8, max_tokens=12, priority=Priority.BATCH)
    i = tenant_request("y", 1.0, prompt=8, max_tokens=12)
    tight.add_request(b)
    tight.add_request(i)
    for _ in range(8):  # both grow until the 6 blocks run out
        out = tight.schedule(0.0)
        tight.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        if out.preempted_ids:
            assert out.preempted_ids == (b.request_id,)
            assert i.status is RequestStatus.RUNNING
            return
    raise AssertionError("expected a preemption")


def test_without_fair_queuing_the_order_is_first_come_first_served():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_running=1, fair_queuing=False)
    sched.waiting.charge("A", prompt_tokens=10_000)
    first, second = tenant_request("A", 0.0), tenant_request("B", 1.0)
    sched.add_request(first)
    sched.add_request(second)
    admitted: list[str] = []
    while sched.has_unfinished():
        out = sched.schedule(0.0)
        admitted += [s.request_id for s in out.scheduled if s.start == 0]
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
    assert admitted == [first.request_id, second.request_id]


def test_random_tenants_and_arrivals_never_starve_and_keep_the_block_pool_consistent():
    rng = random.Random(3)
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_running=3)
    requests = []
    for t in range(60):
        if t < 40:
            for _ in range(rng.choice([0, 1, 1, 3])):
                r = tenant_request(rng.choice("ABCD"), float(t), prompt=rng.randint(2, 14),
                                   max_tokens=rng.randint(1, 6), priority=rng.choice([0, 0, 1]))
                sched.add_request(r)
                requests.append(r)
        out = sched.schedule(0.0)
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        sched.block_manager.check_invariants()
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule(0.0)
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        sched.block_manager.check_invariants()
    assert all(r.is_finished for r in requests)
    assert sched.block_manager.num_used_blocks == 0


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from("ABC"), st.integers(1, 14), st.integers(1, 6), st.sampled_from([0, 0, 1])),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("preempt")),
    ),
    max_size=80,
)


def check_queues(sched) -> None:
    sched.block_manager.check_invariants()
    waiting = [r for _, r in sched.waiting]
    assert len(waiting) == sched.num_waiting == len({r.request_id for r in waiting})
    assert {r.request_id for r in waiting} == {
        rid for rid, r in sched.requests.items() if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    }
    assert {r.request_id for r in sched.running} == {
        rid for rid, r in sched.requests.items() if r.status is RequestStatus.RUNNING
    }


@settings(max_examples=150, deadline=None)
@given(ops=_ops, fair=st.booleans())
def test_random_adds_steps_aborts_and_preemptions_keep_the_queues_consistent_and_everyone_finishes(ops, fair):
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_running=3, max_num_batched_tokens=16,
                           max_prefill_chunk=6, fair_queuing=fair)
    requests = []
    for t, op in enumerate(ops):
        if op[0] == "add":
            _, tenant, prompt, max_tokens, priority = op
            r = tenant_request(tenant, float(t), prompt=prompt, max_tokens=max_tokens, priority=priority)
            sched.add_request(r)
            requests.append(r)
        elif op[0] == "step":
            out = sched.schedule(0.0)
            sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        elif op[0] == "abort" and sched.requests:
            ids = sorted(sched.requests)
            sched.finish_request(ids[op[1] % len(ids)], FinishReason.ABORT)
        elif op[0] == "preempt" and sched.running:
            sched._preempt(sched.running[-1])
        check_queues(sched)
    # Arrivals stop: everything left finishes within a bound (no starvation, no livelock).
    bound = sum(r.num_prompt_tokens + r.max_tokens for r in requests) * 4 + 10
    for _ in range(bound):
        if not sched.has_unfinished():
            break
        out = sched.schedule(0.0)
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        check_queues(sched)
    assert all(r.is_finished for r in requests)
    assert sched.block_manager.num_used_blocks == 0 and not sched.waiting and not sched.requests
