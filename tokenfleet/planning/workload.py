"""Traffic for the fleet simulator: who sends what, when.

``ChatTraffic`` is the headline workload: conversations start at the cell's share of the fleet's
peak rate (``peak_rate``: daily users x turns per day / 86,400 x a peak factor) as a Poisson,
bursty (gamma gaps with a coefficient of variation above 1) or diurnal (a compressed day between
a trough and the peak) process. Each conversation belongs to a tenant, whose system prompt opens
every prompt; each turn resends the whole transcript (system prompt, earlier user messages and
replies) plus a new user message, so consecutive turns share a growing prefix. The next turn is
sent a think time after the reply ends; conversations have a geometric number of turns. At start
the steady-state population of conversations already under way is seeded, their transcripts
cached where the router would have placed them (``Simulation.preload``), so a short warm-up reaches
the steady state's prefix reuse.

``ClosedLoop`` is ``benchmarks/serve.py``'s load: C clients, each sending a fresh random prompt of
fixed length as soon as its previous request ended, until N requests were sent.

Token ids are synthetic but real for hashing: a segment (a system prompt, a user message, a
reply) is a unique id followed by shared filler, so the chained block hashes of the real
scheduler and router match exactly where the text would (the same transcript) and nowhere else.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

FILLER = list(range(1, 65_537))  # shared int objects: a prompt costs 8 bytes per token, not 36
SECONDS_PER_DAY = 86_400.0


def peak_rate(daily_users: float, turns_per_day: float, peak_factor: float) -> float:
    """Requests/s at peak: the day's turns spread evenly, times how much busier the peak is."""
    return daily_users * turns_per_day / SECONDS_PER_DAY * peak_factor


@dataclass(eq=False)
class Arrival:
    """One request as the gateway receives it."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    tenant: str
    reply_id: int  # the reply's first token (then filler): the next turn resends exactly these tokens
    conversation: Any = None

    def token(self, index: int) -> int:
        return self.reply_id if index == 0 else FILLER[index % len(FILLER)]


class Simulation(Protocol):
    now: float

    def at(self, time: float, action: Callable[[Any], None], arg: Any = None) -> None: ...

    def submit(self, arrival: Arrival) -> None: ...

    def preload(self, tokens: list[int], tenant: str = "") -> None: ...


class Source(Protocol):
    def start(self, sim: Simulation) -> None: ...

    def finished(self, sim: Simulation, arrival: Arrival, num_output_tokens: int) -> None: ...


def segment(uid: int, length: int) -> list[int]:
    return [uid] + FILLER[: max(0, length - 1)]


@dataclass(frozen=True)
class Arrivals:
    pattern: str = "poisson"  # poisson | bursty | diurnal
    rate: float = 100.0  # requests/s (the peak for diurnal)
    burst_cv: float = 3.0  # bursty: coefficient of variation of the gaps (1 = Poisson)
    day_seconds: float = 600.0  # diurnal: one simulated day (compressed)
    trough_ratio: float = 0.35  # diurnal: the quietest hour's rate / the peak's

    def __post_init__(self) -> None:
        if self.pattern not in ("poisson", "bursty", "diurnal"):
            raise ValueError(f"arrival pattern must be poisson, bursty or diurnal, got {self.pattern!r}")
        if self.rate <= 0 or self.burst_cv <= 0 or self.day_seconds <= 0 or not 0 < self.trough_ratio <= 1:
            raise ValueError(f"invalid arrival settings: {self}")

    def rate_at(self, t: float) -> float:
        if self.pattern != "diurnal":
            return self.rate
        swing = 0.5 * (1 - math.cos(2 * math.pi * t / self.day_seconds))  # trough at 0, peak at half a day
        return self.rate * (self.trough_ratio + (1 - self.trough_ratio) * swing)

    def next_after(self, t: float, rng: random.Random, scale: float = 1.0) -> float:
        """The next arrival after ``t`` of this process with its rate multiplied by ``scale``."""
        rate = self.rate * scale
        if self.pattern == "poisson":
            return t + rng.expovariate(rate)
        if self.pattern == "bursty":
            shape = 1 / self.burst_cv ** 2
            return t + rng.gammavariate(shape, 1 / (rate * shape))
        while True:  # diurnal: thinning of a Poisson process at the peak rate
            t += rng.expovariate(rate)
            if rng.random() * self.rate <= self.rate_at(t):
                return t


@dataclass(frozen=True)
class Conversations:
    tenants: int = 32
    system_tokens: int = 1000  # per tenant, opening every prompt
    user_tokens: int = 120  # mean of a new user message
    output_tokens: int = 400  # mean reply
    length_sigma: float = 0.5  # lognormal spread of message and reply lengths (0: fixed)
    turns: float = 4.6  # mean turns per conversation (geometric)
    think_seconds: float = 30.0  # mean (exponential) between a reply's end and the next message
    max_context: int = 16_384  # a conversation ends before its prompt + reply would exceed this

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.turns < 1 or self.output_tokens < 1 or self.user_tokens < 1:
            raise ValueError(f"invalid conversation settings: {self}")

    def mean_prompt_tokens(self) -> float:
        """Expected prompt length over all turns: a request's turn index k has P(k) ~ q**(k-1)."""
        q = 1 - 1 / self.turns
        earlier = q / (1 - q) if q < 1 else 0.0
        return self.system_tokens + self.user_tokens + earlier * (self.user_tokens + self.output_tokens)


@dataclass(eq=False)
class _Conversation:
    tenant: int
    transcript: list[int] = field(default_factory=list)
    turn: int = 0


class ChatTraffic:
    def __init__(self, arrivals: Arrivals, conversations: Conversations, seed: int = 0, seed_population: bool = True,
                 expected_turn_seconds: float | None = None):
        self.arrivals, self.conv = arrivals, conversations
        self.rng = random.Random(seed)
        self.seed_population = seed_population
        # for seeding: a reply's expected duration (default: at 30 ms per token)
        self.expected_turn_seconds = expected_turn_seconds or 0.03 * conversations.output_tokens
        self._uids = itertools.count(1 << 20)
        self._ids = itertools.count()
        self._systems = [segment(next(self._uids), conversations.system_tokens) for _ in range(conversations.tenants)]

    # ---- lengths ----------------------------------------------------------------------------
    def _length(self, mean: int) -> int:
        sigma = self.conv.length_sigma
        if sigma <= 0:
            return mean
        return max(1, round(self.rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))

    def _more_turns(self) -> bool:
        return self.rng.random() < 1 - 1 / self.conv.turns

    # ---- the process ---------------------------------------------------------------------------
    def start(self, sim: Simulation) -> None:
        self.sim = sim
        if self.seed_population:
            self._seed(sim)
        sim.at(self.arrivals.next_after(0.0, self.rng, 1 / self.conv.turns), self._open)

    def _seed(self, sim: Simulation) -> None:
        """Conversations already under way: follow-up turns arrive at rate x (1 - 1/turns); each waits
        a turn's duration plus a think time, so that many are in flight (Little's law)."""
        follow_rate = self.arrivals.rate_at(0.0) * (1 - 1 / self.conv.turns)
        cycle = self.conv.think_seconds + self.expected_turn_seconds
        q = 1 - 1 / self.conv.turns
        for _ in range(round(follow_rate * cycle)):
            conv = _Conversation(self.rng.randrange(self.conv.tenants))
            conv.transcript = list(self._systems[conv.tenant])
            earlier = 1
            while self.rng.random() < q:
                earlier += 1
            for _ in range(earlier):  # history sent before the simulation started (its KV: preloaded)
                conv.transcript += segment(next(self._uids), self._length(self.conv.user_tokens))
                conv.transcript += segment(next(self._uids), self._length(self.conv.output_tokens))
                conv.turn += 1
            if len(conv.transcript) < self.conv.max_context // 2:
                sim.preload(conv.transcript, f"tenant-{conv.tenant}")
                sim.at(self._residual(cycle), self._send, conv)

    def _residual(self, cycle: float) -> float:
        """When a conversation caught mid-cycle sends next: thinking (memoryless: a fresh exponential),
        or still receiving its reply (the rest of the reply, then a think time)."""
        wait = self.rng.expovariate(1 / self.conv.think_seconds)
        if self.rng.random() < self.expected_turn_seconds / cycle:
            wait += self.rng.uniform(0, self.expected_turn_seconds)
        return wait

    def _open(self, _: Any = None) -> None:
        conv = _Conversation(self.rng.randrange(self.conv.tenants))
        conv.transcript = list(self._systems[conv.tenant])
        self._send(conv)
        self.sim.at(self.arrivals.next_after(self.sim.now, self.rng, 1 / self.conv.turns), self._open)

    def _send(self, conv: _Conversation) -> None:
        sim = self.sim
        prompt = conv.transcript + segment(next(self._uids), self._length(self.conv.user_tokens))
        max_tokens = min(self._length(self.conv.output_tokens), self.conv.max_context - len(prompt))
        if max_tokens < 1:
            return
        conv.turn += 1
        sim.submit(Arrival(f"c{next(self._ids)}", prompt, max_tokens, f"tenant-{conv.tenant}", next(self._uids), conv))

    def finished(self, sim: Simulation, arrival: Arrival, num_output_tokens: int) -> None:
        conv: _Conversation = arrival.conversation
        if conv is None or not self._more_turns():
            return
        conv.transcript = arrival.prompt + [arrival.token(i) for i in range(num_output_tokens)]
        if len(conv.transcript) + self.conv.user_tokens + self.conv.output_tokens > self.conv.max_context:
            return
        sim.at(sim.now + self.rng.expovariate(1 / self.conv.think_seconds), self._send, conv)


class ClosedLoop:
    """C clients, each with one request in flight, until ``num_requests`` were sent."""

    def __init__(self, concurrency: int, num_requests: int, input_tokens: int, output_tokens: int):
        if concurrency < 1 or num_requests < 1:
            raise ValueError("concurrency and num_requests must be >= 1")
        self.concurrency, self.num_requests = concurrency, num_requests
        self.input_tokens, self.output_tokens = input_tokens, output_tokens
        self._uids = itertools.count(1 << 20)
        self.sent = 0

    def start(self, sim: Simulation) -> None:
        for _ in range(min(self.concurrency, self.num_requests)):
            self._send(sim)

    def _send(self, sim: Simulation) -> None:
        self.sent += 1
        sim.submit(Arrival(f"r{self.sent}", segment(next(self._uids), self.input_tokens), self.output_tokens, "",
                           next(self._uids)))

    def finished(self, sim: Simulation, arrival: Arrival, num_output_tokens: int) -> None:
        if self.sent < self.num_requests:
            self._send(sim)
