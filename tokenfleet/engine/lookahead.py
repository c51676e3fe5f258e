"""Overlapped scheduling's half of the scheduler: the step after one still running on the device.

``EngineCore`` queues that step behind the running one (built with ``CoreParts.overlap``), so the device goes from step to step
without waiting for the host; the runner takes its input tokens from the running step's samples on the device.
"""

from __future__ import annotations

from tokenfleet.engine.request import RequestStatus
from tokenfleet.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput


def queueable(scheduler: Scheduler, output: SchedulerOutput) -> bool:
    """A decode step the runner can queue without waiting for its tokens: one sampled token per entry, none guided
    (a matcher consumes its token on the host), no prompt logprobs."""
    requests = scheduler.requests
    return all(s.plain_decode and requests[s.request_id].guide is None
               and requests[s.request_id].sampling_params.prompt_logprobs is None for s in output.scheduled)


def lookahead(scheduler: Scheduler, output: SchedulerOutput) -> SchedulerOutput | None:
    """The step after ``output`` while ``output`` still runs (its tokens unknown here): each of its decode entries
    once more, one position on, for the requests certain to run on (not at their length limit; a stop token found
    later wastes that request's row, which ``Scheduler.update`` then skips).

    None (schedule normally once ``output``'s tokens are in) when the next step needs those tokens or the full
    scheduler's judgement: anyone waiting or running outside ``output`` (admission, fairness), prefill chunks,
    speculation, forks, guided decoding, penalties or min_tokens (they read the output so far), or too few free
    blocks to add a slot each without preempting."""
    s = scheduler
    if not output.scheduled or s.waiting or s.pending_forks or len(s.running) != len(output.scheduled):
        return None
    bm = s.block_manager
    entries = []
    for entry in output.scheduled:
        request = s.requests.get(entry.request_id)
        if not entry.plain_decode or request is None or request.status is not RequestStatus.RUNNING \
                or request.num_computed_tokens != entry.start:
            return None
        params = request.sampling_params
        # min_tokens: the sampler bans stops by the output the host has; in the step after ``output`` that is one
        # token short, so run ahead only once the ban is over either way
        if request.guide is not None or params.has_penalties or len(request.output_token_ids) < params.min_tokens:
            return None
        if len(request.output_token_ids) + 1 >= request.max_tokens or request.num_tokens + 1 >= s.config.max_model_len:
            continue  # ends by length with output's token
        entries.append((request, entry))
    if not entries or sum(bm.blocks_needed(r.request_id, e.start + 2, start=e.start + 1) for r, e in entries) \
            > bm.num_free_blocks:
        return None
    scheduled, copies = [], []
    for request, entry in entries:
        allocation = bm.allocate_slots(request.request_id, entry.start + 2, start=entry.start + 1)
        if allocation is None:  # cannot happen after the count above
            raise RuntimeError(f"lookahead: no slot for {request.request_id} after counting free blocks")
        copies.extend(allocation.copies)
        tables = bm.block_tables(request.request_id)
        scheduled.append(ScheduledRequest(request.request_id, entry.start + 1, 1, tuple(tables[0]), True,
                                          other_block_ids=tuple(tuple(t) for t in tables[1:])))
    s.num_block_copies += len(copies)
    return SchedulerOutput(tuple(scheduled), tuple(copies), ())
