"""Keeping streams smooth beside a long prompt. A step runs every running request's next token and the chunks of
prompts being prefilled; a chunk of 2,048 tokens deep into a long context can make that step many times longer than
a decode-only one, and every stream in the batch stalls for it. With the guard, a step that has streams decoding
gives long prompts' chunks only the time ``factor`` allows: at most ``factor`` x a decode-only step in all, measured
on this replica. Short prompts (``SHORT_PROMPT`` tokens left or fewer) are computed whole, and a step with one (running
or next in line) holds long prompts back the same way: a question behind a long document starts at once. The first long
prompt in line always advances (at least one token a step); the others advance only within what is left, so that
several long prompts at deep positions (each token of theirs an attention over the whole context) never add up beside
the streams. Long prompts take full chunks whenever nothing decodes and no short prompt waits.

With objectives (``Objectives``: the TTFT a prompt is promised, a base plus a share per prompt token, and the TPOT
the streams are promised), the streams' slack goes to prefill. A stream's TPOT is its mean inter-token time over its
whole output, so one running under the objective banks time (``banked_slack``: the longest next step after which it
still meets ``TPOT_HEADROOM`` of the objective, were it to produce as many tokens as recent requests did, at the
decode pace); a step beside decoding streams may take the least of their banked slack for long prompts' chunks, and
the factor's pace is only its floor, for streams with nothing banked. A long prompt whose chunks at the factor's
pace would finish after its TTFT deadline may also grow its step to ``TPOT_HEADROOM`` of the TPOT objective. Without
a TPOT objective the factor alone sizes the steps, for smooth streams.

Work is counted in token-equivalents: one token through the matmuls, and ``pair_cost`` for each attention (query,
key) pair (attention FLOPs per pair over matmul FLOPs per token), so a chunk deep into a long context costs more than
one at its start. Pure arithmetic over plain numbers; the core feeds it each step's shape and time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

PROBE_WORK = 64.0  # token-equivalents a step may add before this replica's prefill speed is known
SHORT_PROMPT = 512  # a prompt with at most this many tokens left to compute is short: computed whole, never held
EMA = 0.2  # weight of the newest step in the running estimates
# Decode-only steps are what the allowance is a multiple of, and there are none while a long prompt advances beside
# the streams: every this many steps one is made (long prompts wait a step), so that a stale figure (a neighbour's
# long-context decodes that have since finished, streams that came or went) is not what the next minutes are held to.
REFRESH_STEPS = 25
TPOT_HEADROOM = 0.8  # share of the TPOT objective one step beside decoding streams may take


class Entry(Protocol):
    """What the guard reads of a scheduled entry (scheduler.ScheduledRequest)."""

    @property
    def start(self) -> int: ...
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def draft(self) -> tuple[int, ...]: ...
    @property
    def samples(self) -> bool: ...


class Pending(Protocol):
    """What the guard reads of a running or waiting request (request.Request)."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...


class Stream(Protocol):
    """What the guard reads of a running request to judge its stream's slack (request.Request)."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def first_token_time(self) -> float | None: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def max_tokens(self) -> int: ...


def for_step(allowance: PrefillAllowance | None, running: Iterable[Pending], waiting: Iterable[Pending],
             decoding: bool, room: bool) -> PrefillAllowance | None:
    """The allowance a step applies: None when nothing waits on the step (no stream decoding, no short prompt running
    or waiting), and long prompts take full chunks. A short prompt waiting to start (``room``: the batch can take it)
    is computed whole, already a long step for the streams: long prompts then take only what it leaves, even the
    first in line (it advances again next step)."""
    if allowance is None:
        return None
    if room and any(not allowance.is_long(r.num_tokens - r.num_computed_tokens) for r in waiting):
        allowance.advanced = True
        return allowance
    if decoding or any(not allowance.is_long(r.num_tokens - r.num_computed_tokens) for r in running):
        return allowance
    return None


@dataclass(frozen=True)
class Objectives:
    """What the replica's requests are promised: TTFT <= ``ttft_base_s`` + ``ttft_per_token_s`` x prompt tokens, and
    TPOT <= ``tpot_s`` (0: no TPOT objective, so no slack to spend)."""

    ttft_base_s: float = 0.5
    ttft_per_token_s: float = 0.001
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("ttft_base_s", "ttft_per_token_s", "tpot_s"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"the objective {name} must be >= 0, got {getattr(self, name)}")

    def ttft_deadline(self, arrival: float, num_prompt_tokens: int) -> float:
        return arrival + self.ttft_base_s + self.ttft_per_token_s * num_prompt_tokens


def banked_slack(streams: Iterable[tuple[float, int, int]], now: float, tpot_s: float, decode_s: float) -> float | None:
    """The longest next step (seconds from ``now``) after which every decoding stream still meets ``TPOT_HEADROOM`` x
    ``tpot_s`` over the tokens it is expected to produce: the least over ``streams`` of (first token's time, output
    tokens so far, more tokens expected) of headroom x tpot x (n + more) - (now - first) - more x ``decode_s`` (its
    later tokens at the decode pace). None without streams or a TPOT objective; negative when a stream cannot meet
    it any more."""
    if tpot_s <= 0:
        return None
    slack = [TPOT_HEADROOM * tpot_s * (n + more) - (now - first) - more * decode_s for first, n, more in streams
             if n > 0]
    return min(slack) if slack else None


def is_prefill(entry: Entry) -> bool:
    """A prompt chunk (a single token of a prompt too), not a decode or a verification."""
    return not entry.draft and (entry.num_new_tokens > 1 or not entry.samples)


def chunk_work(start: int, n: int, pair_cost: float) -> float:
    """Token-equivalents of computing ``n`` tokens from position ``start`` (causal attention over the context)."""
    return n + pair_cost * (n * start + n * (n + 1) / 2)


@dataclass
class PrefillAllowance:
    """Prefill work one step may still take (set on the scheduler for that step)."""

    left: float  # token-equivalents
    pair_cost: float
    advanced: bool = False  # a long prompt has taken a chunk this step (the others then wait for what is left)
    boost: float = 0.0  # more token-equivalents this step, for a long prompt whose TTFT deadline is at risk
    step_s: float = 0.0  # a step's seconds at the factor's pace (the deadline check's clock)
    per_step: float = 0.0  # the factor's allowance of one step (the deadline check's pace); 0: ``left``
    objectives: Objectives | None = None  # the TTFT deadlines the boost is judged by (None: no deadline)

    @staticmethod
    def is_long(remaining: int) -> bool:
        """A prompt with this many tokens left is held to the allowance (a short one is computed whole)."""
        return remaining > SHORT_PROMPT

    def seconds_left(self, arrival: float, num_prompt_tokens: int, now: float) -> float:
        """Seconds from ``now`` to a prompt's TTFT deadline (infinite without objectives)."""
        if self.objectives is None:
            return float("inf")
        return self.objectives.ttft_deadline(arrival, num_prompt_tokens) - now

    def at_risk(self, start: int, remaining: int, seconds_left: float) -> bool:
        """Whether a long prompt at ``start`` with ``remaining`` tokens to compute would finish after its TTFT
        deadline (``seconds_left`` from now) at the factor's pace."""
        pace = self.per_step or self.left
        if self.step_s <= 0 or pace <= 0:
            return False
        return chunk_work(start, remaining, self.pair_cost) / pace * self.step_s > seconds_left

    def tokens(self, start: int, limit: int, remaining: int = 0, seconds_left: float = float("inf")) -> int:
        """The most tokens (0..``limit``) of a long prompt's chunk from ``start`` whose work fits what is left; at
        least 1 for the step's first long prompt. A prompt whose TTFT deadline (``seconds_left``, ``remaining``
        tokens to go) is at risk takes the step's boost too."""
        if self.boost > 0 and self.at_risk(start, max(remaining, limit), seconds_left):
            self.left, self.boost = self.left + self.boost, 0.0
        if chunk_work(start, 1, self.pair_cost) > self.left:
            return 0 if self.advanced else 1
        if chunk_work(start, limit, self.pair_cost) <= self.left:
            return limit
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chunk_work(start, mid, self.pair_cost) <= self.left:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def spend(self, start: int, n: int, long: bool) -> None:
        """A prompt's chunk was scheduled (``long``: a long prompt's)."""
        self.left -= chunk_work(start, n, self.pair_cost)
        self.advanced = self.advanced or (long and n > 0)


@dataclass
class ItlGuard:
    factor: float  # a step beside decoding streams takes at most this times a decode-only step (> 1)
    pair_cost: float
    objectives: Objectives = Objectives(tpot_s=0.0)  # without a TPOT objective the factor alone bounds a step
    decode_s: float | None = None  # recent decode-only steps' seconds
    output_len: float | None = None  # recent finished requests' output tokens (how long a stream is expected to run)
    work_s: float | None = None  # recent seconds per token-equivalent of prefill work
    since_decode: int = 0  # steps since the last decode-only one

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError(f"the ITL guard's factor must be above 1, got {self.factor}")

    def allowance(self, slack_s: float | None = None) -> PrefillAllowance:
        """The next step's prefill allowance, for the scheduler to apply when the step has streams decoding or a
        short prompt waiting: while a decode-only step has not been timed, nothing beyond one token per prompt
        (that step times it); while prefill speed is unknown, a small probe. ``slack_s``: the decoding streams'
        ``banked_slack`` (with a TPOT objective: the step may take it, less its decodes, where that is more than the
        factor's)."""
        if self.decode_s is None:
            return PrefillAllowance(0.0, self.pair_cost)
        if self.work_s is None:
            return PrefillAllowance(PROBE_WORK, self.pair_cost)
        if self.since_decode >= REFRESH_STEPS:  # long prompts wait this step: it times the decodes afresh
            return PrefillAllowance(0.0, self.pair_cost, advanced=True)
        paced = (self.factor - 1) * self.decode_s / self.work_s
        left, boost = paced, self.boost_s() / self.work_s
        if slack_s is not None and self.objectives.tpot_s > 0:
            left = max(paced, (slack_s - self.decode_s) / self.work_s)
            boost = max(0.0, paced + boost - left)  # an at-risk prompt gets at least the boosted step
        return PrefillAllowance(left, self.pair_cost, boost=boost, step_s=self.factor * self.decode_s, per_step=paced,
                                objectives=self.objectives)

    def step_allowance(self, running: Iterable[Stream], now: float) -> PrefillAllowance:
        """``allowance`` with the ``banked_slack`` of the decoding streams among ``running``."""
        streams = [(r.first_token_time, len(r.output_token_ids), self.expected_more(len(r.output_token_ids),
                                                                                     r.max_tokens))
                   for r in running if r.first_token_time is not None and r.num_tokens - r.num_computed_tokens == 1]
        return self.allowance(banked_slack(streams, now, self.objectives.tpot_s, self.decode_s or 0.0))

    def expected_more(self, num_output_tokens: int, max_tokens: int) -> int:
        """Tokens a stream with ``num_output_tokens`` so far is expected to produce still: as many as recent requests
        produced in all (at least one more), within its ``max_tokens``."""
        total = max(num_output_tokens + 1, round(self.output_len or 0.0))
        return max(0, min(max_tokens, total) - num_output_tokens)

    def finished(self, num_output_tokens: int) -> None:
        """A request ended with this many output tokens."""
        self.output_len = _ema(self.output_len, float(num_output_tokens))

    def boost_s(self) -> float:
        """Seconds of prefill work beyond the factor's that a step may add for a prompt whose TTFT is at risk: what
        the TPOT objective leaves (its ``TPOT_HEADROOM`` share, less the decodes and the factor's share); 0 without
        one, or where the factor already allows as much."""
        decode_s = self.decode_s or 0.0
        return max(0.0, TPOT_HEADROOM * self.objectives.tpot_s - self.factor * decode_s)

    def observe(self, scheduled: Sequence[Entry], seconds: float) -> None:
        """A step that ran: decode-only steps time decoding, the others prefill work (their decodes' share
        taken out). Steps that verify speculated tokens are neither."""
        if any(e.draft for e in scheduled):
            return
        prefill = sum(chunk_work(e.start, e.num_new_tokens, self.pair_cost) for e in scheduled if is_prefill(e))
        decodes = any(not is_prefill(e) for e in scheduled)
        if not prefill:
            if decodes:
                # a refresh after a long stretch replaces the old figure outright: it may be minutes old
                self.decode_s = seconds if self.since_decode >= REFRESH_STEPS else _ema(self.decode_s, seconds)
                self.since_decode = 0
            return
        self.since_decode += decodes
        if decodes and self.decode_s is None:
            return
        spent = seconds - (self.decode_s if decodes and self.decode_s is not None else 0.0)
        self.work_s = _ema(self.work_s, max(spent, 0.1 * seconds) / prefill)  # timing noise never makes it free


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
