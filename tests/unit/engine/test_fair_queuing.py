"""Tier priority and token-weighted fair queuing between tenants (VTC) in the scheduler, with
time passed in (arrival times are plain numbers; no clock)."""

from __future__ import annotations

import random

from tests.conftest import make_request, make_scheduler
from tokenfleet.engine.fair_queue import FairQueue
from tokenfleet.engine.request import Priority, RequestStatus


def tenant_request(tenant: str, t: float, prompt: int = 8, max_tokens: int = 4, priority: int = Priority.INTERACTIVE):
    r = make_request(num_prompt_tokens=prompt, max_tokens=max_tokens, arrival_time=t, priority=priority)
    r.tenant = tenant
    return r


def step(sched, admitted: list[str]) -> None:
    """One schedule/update; records, in order, the requests admitted from the waiting queue, and
    checks the VTC rule at each admission: no other waiting tenant of the class had a smaller counter."""
    waiting_before = {r.request_id: r for _, r in sched.waiting}
    counters = dict(sched.waiting.counters)
    out = sched.schedule()
    for entry in out.scheduled:
        request = waiting_before.get(entry.request_id)
        if request is not None:
            admitted.append(request.request_id)
            others = {r.tenant for r in waiting_before.values() if r.priority == request.priority}
            assert all(counters.get(request.tenant, 0) <= counters.get(t, 0) for t in others), (request.tenant, counters)
            waiting_before.pop(entry.request_id)
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
    b_ids = {r.request_id for r in late}
    first_after = len(admitted)
    while sched.has_unfinished():
        step(sched, admitted)
    after = admitted[first_after:]
    assert after[0] in b_ids  # the first admission after B arrives is B's (A was charged meanwhile)
    positions = [i for i, rid in enumerate(after) if rid in b_ids]
    assert len(positions) == 3 and positions[-1] < len(after) - 3  # all of B's before most of A's backlog
    assert any(rid not in b_ids for rid in after[positions[0]:positions[-1]])  # A is served while B waits
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
        out = tight.schedule()
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
        out = sched.schedule()
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
        out = sched.schedule()
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        sched.block_manager.check_invariants()
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        sched.block_manager.check_invariants()
    assert all(r.is_finished for r in requests)
    assert sched.block_manager.num_used_blocks == 0
