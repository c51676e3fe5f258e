"""The goodput benchmark's workload, fixed so that it cannot be tuned.

Open-loop Poisson arrivals at an offered rate; each request is one of three classes:

- chat (70 %): a fresh prompt of 64-512 tokens (uniform);
- shared prefix (20 %): one of 8 fixed 1,500-token system prefixes, then 64-256 fresh tokens;
- long (10 %): a fresh prompt of 2,000-3,000 tokens.

Every request asks for 32-256 output tokens (uniform; ``ignore_eos``, so it gets exactly that many),
streamed. Token ids are random in [200, vocab): no special tokens, no text the tokenizer must
round-trip, the same ids to every server.

The objectives for the 2-core CPU: TTFT <= 0.5 s + 1 ms per prompt token (a 3,000-token prompt cannot
be prefilled here in a flat second), TPOT <= 100 ms. ``SEED`` was committed before any tuning: the
prefixes derive from it alone, each (round, rate step) from it plus its indices, so every server sees
exactly the same requests at the same offsets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenfleet.planning.metrics import Objectives

SEED = 20261128
OBJECTIVES = Objectives(ttft_s=0.5, tpot_s=0.1, ttft_per_prompt_token_s=0.001)
CLASSES = (("chat", 0.70), ("shared_prefix", 0.20), ("long", 0.10))
NUM_PREFIXES = 8
PREFIX_TOKENS = 1500
OUTPUT_TOKENS = (32, 256)
LOW_ID = 200


@dataclass(frozen=True)
class Request:
    offset_s: float  # when to send it, after the run's start
    kind: str
    prompt: list[int]
    max_tokens: int
    prefix: int = -1  # which shared prefix (shared_prefix requests)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(LOW_ID, vocab) for _ in range(n)]


def prefixes(vocab: int) -> list[list[int]]:
    """The 8 shared system prefixes: from ``SEED`` alone, the same in every round and at every rate."""
    rng = random.Random(f"{SEED}-prefixes")
    return [_tokens(rng, PREFIX_TOKENS, vocab) for _ in range(NUM_PREFIXES)]


def requests(rate: float, count: int, vocab: int, round_index: int, step: int) -> list[Request]:
    """``count`` requests arriving as a Poisson process of ``rate`` per second (the first at its own gap)."""
    if rate <= 0 or count <= 0:
        raise ValueError("rate and count must be positive")
    rng = random.Random(f"{SEED}-{round_index}-{step}")
    shared = prefixes(vocab)
    kinds, weights = zip(*CLASSES)
    out, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        kind = rng.choices(kinds, weights)[0]
        prefix = -1
        if kind == "chat":
            prompt = _tokens(rng, rng.randint(64, 512), vocab)
        elif kind == "shared_prefix":
            prefix = rng.randrange(NUM_PREFIXES)
            prompt = shared[prefix] + _tokens(rng, rng.randint(64, 256), vocab)
        else:
            prompt = _tokens(rng, rng.randint(2000, 3000), vocab)
        out.append(Request(t, kind, prompt, rng.randint(*OUTPUT_TOKENS), prefix))
    return out


def warmup(vocab: int) -> list[Request]:
    """Untimed requests of every class (their prefix is none of the 8: nothing they cache is measured)."""
    rng = random.Random(f"{SEED}-warmup")
    return [Request(0.0, "chat", _tokens(rng, 300, vocab), 16),
            Request(0.0, "shared_prefix", _tokens(rng, PREFIX_TOKENS + 100, vocab), 16),
            Request(0.0, "long", _tokens(rng, 2500, vocab), 16),
            Request(0.0, "chat", _tokens(rng, 100, vocab), 64)]


def ladder(start: float, factor: float, steps: int) -> list[float]:
    """Offered rates, each ``factor`` times the one before (rounded to 3 decimals: they name the runs)."""
    return [round(start * factor**i, 3) for i in range(steps)]
