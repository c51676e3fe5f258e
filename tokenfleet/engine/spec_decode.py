"""Speculative decoding, the engine's pure part: a proposer that guesses a request's next tokens from
text it has already seen, and the policy that decides each step how many guesses are worth verifying.

The target model verifies a request's k proposed tokens in one forward over k + 1 positions (its last
sampled token, then the proposals: several paged queries of one request); the sampler accepts the longest
run it agrees with (greedy: equal to its own pick; sampled: exact rejection sampling, so outputs keep the
target's distribution) and adds one token of its own, so a verification yields 1 .. k + 1 tokens. Rejected
positions' KV is simply overwritten later; the blocks allocated for them are trimmed (``BlockManager.trim``).

Proposers (``SpecConfig.method``):
- ``ngram`` (prompt lookup): the longest suffix of the request's tokens (``max_ngram`` down to ``min_ngram``
  tokens) that occurred earlier in its prompt or output; propose what followed its latest occurrence. Agent
  loops, code edits and quoted answers repeat long spans of their context, so these guesses often hold.
- the same over the tenant's recent requests (``tenant_history``, suffix-decoding style): finished requests'
  tokens, kept per tenant (never shared across tenants), searched when the request's own tokens have no match.

The policy (``SpecPolicy``): verification costs ``per_token`` seconds per extra token in the step and yields
an extra token at depth i with probability alpha^i (alpha: that request's measured acceptance). A step's rate
is expected tokens / (fixed + per_token x tokens); a draft token is verified only if it raises that rate, so
at small batches (a step costs mostly its fixed weight reads) requests speculate deeply, and once the batch is
large enough that tokens cost their compute, speculation turns itself off. ``StepCostModel`` fits fixed and
per-token cost from the engine's own decode steps.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet.engine.request import Request

# speculative_config keys (TensorRT-LLM's names, shared with its adapter) this engine reads
_NGRAM_KEYS = {"decoding_type", "max_draft_len", "max_matching_ngram_size", "is_public_pool", "max_concurrency"}
_DRAFT_KEYS = {"decoding_type", "max_draft_len", "speculative_model", "speculative_model_dir", "max_concurrency"}
# keys only this engine reads; the TensorRT-LLM adapter drops them (its config classes reject unknown keys)
TORCH_ONLY_KEYS = frozenset({"min_matching_ngram_size", "adaptive", "tenant_history_tokens", "draft_layers"})
DRAFT_TYPES = ("drafttarget", "draft_target")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) or "draft" (a draft model in the worker)
    num_speculative_tokens: int = 5  # most tokens proposed per request per step
    max_ngram: int = 4  # longest suffix matched
    min_ngram: int = 2  # shortest suffix matched (1 proposes after any repeated token: many wrong guesses)
    tenant_history: bool = False  # also match the tenant's recent requests (TRT-LLM: is_public_pool)
    tenant_history_tokens: int = 32768  # per tenant
    adaptive: bool = True  # SpecPolicy decides per step; False: verify every proposal
    max_concurrency: int = 0  # no speculation when more requests run (0: the policy alone decides)
    draft_model: str = ""  # "draft": an HF folder with the target's tokenizer, or "self" (the target's own weights)
    draft_layers: int = 0  # "draft": keep only the draft model's first layers (0: all)

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method {self.method!r} is not supported here (ngram, draft)")
        if (self.method == "draft") != bool(self.draft_model):
            raise ValueError("a draft model (speculative_model) goes with decoding_type DraftTarget, and only there")
        if self.draft_layers < 0:
            raise ValueError(f"draft_layers must be >= 0, got {self.draft_layers}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"max_draft_len must be in [1, 32], got {self.num_speculative_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram <= 16:
            raise ValueError(f"need 1 <= min_matching_ngram_size <= max_matching_ngram_size <= 16, "
                             f"got {self.min_ngram}, {self.max_ngram}")
        if self.max_concurrency < 0 or self.tenant_history_tokens < 0:
            raise ValueError("max_concurrency and tenant_history_tokens must be >= 0")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> SpecConfig | None:
        """From a registry record's ``speculative_config`` (JSON, TensorRT-LLM's schema: ``decoding_type``
        ``NGram`` with ``max_draft_len``, ``max_matching_ngram_size``, ``is_public_pool``, ``max_concurrency``;
        plus ``min_matching_ngram_size`` and ``adaptive`` read only here). None/"" -> None (off)."""
        if not value:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError("speculative_config must be a JSON object")
        kind = str(value.get("decoding_type", "NGram"))
        draft = kind.lower() in DRAFT_TYPES
        if kind.lower() != "ngram" and not draft:
            raise ValueError(f"the torch engine speculates with decoding_type NGram (prompt lookup) or DraftTarget (a "
                             f"draft model), not {kind!r}; other types are passed to TensorRT-LLM")
        unknown = set(value) - (_DRAFT_KEYS if draft else _NGRAM_KEYS) - TORCH_ONLY_KEYS
        if unknown:
            raise ValueError(f"unknown speculative_config keys for {kind}: {sorted(unknown)}")
        try:
            if draft:
                return cls(method="draft", num_speculative_tokens=int(value.get("max_draft_len", 4)),
                           draft_model=str(value.get("speculative_model") or value.get("speculative_model_dir") or ""),
                           draft_layers=int(value.get("draft_layers", 0)), adaptive=bool(value.get("adaptive", True)),
                           max_concurrency=int(value.get("max_concurrency", 0)))
            return cls(
                num_speculative_tokens=int(value.get("max_draft_len", 5)),
                max_ngram=int(value.get("max_matching_ngram_size", 4)),
                min_ngram=int(value.get("min_matching_ngram_size", 2)),
                tenant_history=bool(value.get("is_public_pool", False)),
                tenant_history_tokens=int(value.get("tenant_history_tokens", 32768)),
                adaptive=bool(value.get("adaptive", True)),
                max_concurrency=int(value.get("max_concurrency", 0)),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad speculative_config: {e}") from None


def trtllm_speculative_config(value: Mapping[str, Any]) -> dict[str, Any]:
    """The record's speculative_config as TensorRT-LLM's LLM takes it (keys only this engine reads dropped)."""
    return {k: v for k, v in value.items() if k not in TORCH_ONLY_KEYS}


class NgramIndex:
    """The n-grams (``min_n`` .. ``max_n`` tokens) of a growing token list -> where their latest occurrence
    ends. Indexed lazily up to the position before the current end, so a lookup of the current suffix finds
    an earlier occurrence, never itself."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions <= this are in _end

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def _index(self, upto: int) -> None:
        tokens, end = self.tokens, self._end
        for e in range(self._indexed + 1, upto + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                end[tuple(tokens[e - n: e])] = e
        self._indexed = max(self._indexed, upto)

    def continuation(self, suffix: Sequence[int], k: int, before: int | None = None) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching tail of
        ``suffix`` (occurrences ending at or before ``before``, default: everything but the current end)."""
        upto = len(self.tokens) - 1 if before is None else before
        if upto > self._indexed:
            self._index(upto)
        tokens = self.tokens
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            e = self._end.get(tuple(suffix[len(suffix) - n:]))
            if e is not None and e <= upto:
                out = tokens[e: e + k]
                if -1 in out:  # a separator (TenantHistory): the occurrence ended a request
                    out = out[: out.index(-1)]
                if out:
                    return out
        return []

    def propose(self, k: int) -> list[int]:
        """Prompt lookup for the list itself: what followed the latest earlier occurrence of its suffix."""
        return self.continuation(self.tokens[-self.max_n:], k)


class TenantHistory:
    """Finished requests' tokens per tenant, searched by suffix (never across tenants), bounded per tenant
    (the oldest requests are dropped) and in the number of tenants (least recently used)."""

    def __init__(self, min_n: int, max_n: int, tokens_per_tenant: int, max_tenants: int = 64):
        self.min_n, self.max_n = min_n, max_n
        self.limit = tokens_per_tenant
        self.max_tenants = max_tenants
        self._by_tenant: OrderedDict[str, tuple[list[list[int]], NgramIndex]] = OrderedDict()

    def add(self, tenant: str, tokens: Sequence[int]) -> None:
        if not self.limit or len(tokens) <= self.min_n:
            return
        entry = self._by_tenant.pop(tenant, None)
        seqs, index = entry if entry is not None else ([], NgramIndex(self.min_n, self.max_n))
        seqs.append(list(tokens[-(self.limit - 1):]))  # with its separator, one request fits the budget
        if len(index) + len(seqs[-1]) + 1 > self.limit:  # rebuild from the newest requests that fit
            total, keep = 0, []
            for seq in reversed(seqs):
                if total + len(seq) + 1 > self.limit:
                    break
                keep.append(seq)
                total += len(seq) + 1
            seqs = keep[::-1]
            index = NgramIndex(self.min_n, self.max_n)
            for seq in seqs:
                index.extend([*seq, -1])
        else:
            index.extend([*seqs[-1], -1])
        self._by_tenant[tenant] = (seqs, index)
        while len(self._by_tenant) > self.max_tenants:
            self._by_tenant.popitem(last=False)

    def propose(self, tenant: str, suffix: Sequence[int], k: int) -> list[int]:
        entry = self._by_tenant.get(tenant)
        if entry is None:
            return []
        self._by_tenant.move_to_end(tenant)
        index = entry[1]
        return index.continuation(suffix, k, before=len(index))


class StepCostModel:
    """Seconds of a step of T scheduled tokens ~ fixed + per_token x T, fitted by least squares with
    forgetting over decode and verification steps (their T varies with the batch and with speculation).
    Until T has varied, ``per_token`` comes from the engine's prefill rate."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self._s = [0.0] * 5  # weight, sum T, sum T^2, sum t, sum T t
        self.prefill_per_token = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d, s = self.decay, self._s
        for i, value in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            s[i] = d * s[i] + value

    def estimate(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds, or None before any step."""
        w, st, stt, sy, sty = self._s
        if w < 1e-9:
            return None
        mean_t, mean_y = st / w, sy / w
        var = stt / w - mean_t * mean_t
        per_token = (sty / w - mean_t * mean_y) / var if var > 0.25 else self.prefill_per_token
        if per_token <= 0.0:  # T has not varied, or noise: the prefill rate, else a guess that T will correct
            per_token = self.prefill_per_token or 0.05 * max(mean_y - mean_t * 1e-4, 1e-4)
        return max(mean_y - per_token * mean_t, 0.0), per_token


@dataclass
class Candidate:
    key: str
    draft: list[int]  # proposed tokens (the policy verifies a prefix of them)
    alpha: float  # estimated probability that the next proposed token is accepted


class SpecPolicy:
    """How many proposed tokens each request verifies this step: those that raise the step's expected
    tokens per second (module docstring). Pure: the caller supplies estimates and the step's base size."""

    def __init__(self, config: SpecConfig):
        self.config = config

    def plan(self, candidates: Sequence[Candidate], base_tokens: int, base_yield: float,
             cost: tuple[float, float] | None) -> dict[str, int]:
        """``base_tokens``: tokens the step schedules without speculation; ``base_yield``: tokens it yields
        (one per decoding request). Returns key -> tokens to verify (absent: none)."""
        if not self.config.adaptive:
            return {c.key: len(c.draft) for c in candidates if c.draft}
        if cost is None:
            return {}
        fixed, per_token = cost
        if per_token <= 0.0:
            return {c.key: len(c.draft) for c in candidates if c.draft}
        tokens, gain = float(base_tokens), float(base_yield)
        heap = [(-c.alpha, i, c.alpha, 1) for i, c in enumerate(candidates) if c.draft and c.alpha > 0]
        heapq.heapify(heap)
        out: dict[str, int] = {}
        while heap:
            _, i, value, depth = heapq.heappop(heap)
            c = candidates[i]
            # verifying one more token raises the rate iff its expected yield beats the rate's cost share
            if value * (fixed + per_token * tokens) <= per_token * gain:
                break
            tokens += 1
            gain += value
            out[c.key] = depth
            if depth < len(c.draft):
                nxt = value * c.alpha
                heapq.heappush(heap, (-nxt, i, nxt, depth + 1))
        return out


class Acceptance:
    """Acceptance estimate with forgetting: of the proposed tokens a verification reached (every accepted
    one, plus the first rejected), the share accepted. A prior of ``prior_weight`` trials at ``prior``."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9):
        self.accepted = prior * prior_weight
        self.trials = prior_weight
        self.decay = decay

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials if self.trials else 0.0

    def observe(self, proposed: int, accepted: int) -> None:
        reached = accepted + (1 if accepted < proposed else 0)
        d = self.decay ** reached
        self.accepted = d * self.accepted + accepted
        self.trials = d * self.trials + reached


class Speculator:
    """The engine core's speculative decoding: proposes for the running requests before each step (the
    policy picks how many of the proposals the step verifies) and learns from each step's outcome.
    Engine thread only."""

    def __init__(self, config: SpecConfig):
        self.config = config
        self.policy = SpecPolicy(config)
        self.cost = StepCostModel()
        self.acceptance = Acceptance(prior=0.5, prior_weight=4.0, decay=0.995)  # every request's, the prior
        self.history = TenantHistory(config.min_ngram, config.max_ngram, config.tenant_history_tokens) \
            if config.tenant_history else None
        self._index: dict[str, NgramIndex] = {}
        self._accept: dict[str, Acceptance] = {}
        # steps in a row a request had proposals but verified none: after ``explore_after`` its own (low) estimate
        # is forgotten for the fleet-wide one, so text that turned repetitive gets another chance
        self._passed: dict[str, int] = {}
        self.explore_after = 64
        self.grammar_cut = 0  # proposed tokens dropped because the request's grammar forbids them

    def eligible(self, request: Request) -> bool:
        """Whether ``request`` may speculate: not opted out, and not a seeded sampled request (its tokens must
        not depend on what was accepted)."""
        params = request.sampling_params
        return params.speculative and (params.is_greedy or params.seed is None)

    def propose(self, running: Sequence[Request], budget: int) -> int:
        """Set ``draft_token_ids`` of the decoding requests of ``running`` the step should verify. Returns how
        many tokens were proposed in all."""
        for r in running:
            r.draft_token_ids = []
        cfg = self.config
        if cfg.max_concurrency and len(running) > cfg.max_concurrency:
            return 0
        # decoding: its last output token is the only one not in the KV (a prompt's last chunk is not: its first
        # token, and any n > 1 samples forking from it, come from that step's logits alone)
        decoding = [r for r in running if r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1]
        eligible = [r for r in decoding if self.eligible(r) and r.max_tokens - len(r.output_token_ids) > 1]
        if not eligible:
            return 0
        # The value of the step's time is what a decode step of this batch yields per second: prefill chunks in
        # the step are work that must be done anyway, not a reason to spend more of it on guesses.
        base_tokens = min(budget, len(decoding))
        cost = self.cost.estimate()
        if cfg.adaptive:
            if cost is None:
                return 0  # no step measured yet: nothing says what a verified token costs
            best = max(self._alpha(r) for r in eligible)
            if cost[1] > 0 and best * (cost[0] + cost[1] * base_tokens) <= cost[1] * len(decoding):
                for r in eligible:  # not even the likeliest first guess would pay: skip the lookups
                    self._passed_over(r.request_id)
                return 0
        candidates = []
        by_id = {}
        for r in eligible:
            k = min(cfg.num_speculative_tokens, r.max_tokens - len(r.output_token_ids) - 1)
            # a draft model proposes in the runner, once the step's slots are allocated: placeholders here
            draft = [-1] * k if cfg.method == "draft" else self._lookup(r, k)
            if draft and r.guide is not None and cfg.method == "ngram":
                valid = r.guide.validate_tokens(draft)  # a token the grammar forbids is never verified
                self.grammar_cut += len(draft) - valid
                draft = draft[:valid]
            if draft:
                candidates.append(Candidate(r.request_id, draft, self._alpha(r)))
                by_id[r.request_id] = r
        plan = self.policy.plan(candidates, base_tokens, len(decoding), cost)
        total = 0
        for c in candidates:
            k = plan.get(c.key, 0)
            if k:
                by_id[c.key].draft_token_ids = c.draft[:k]
                total += k
                self._passed.pop(c.key, None)
            else:
                self._passed_over(c.key)
        return total

    def _passed_over(self, request_id: str) -> None:
        """A step in which the request could have speculated and did not."""
        passed = self._passed[request_id] = self._passed.get(request_id, 0) + 1
        if passed >= self.explore_after:
            self._accept.pop(request_id, None)
            self._passed.pop(request_id, None)

    def _alpha(self, request: Request) -> float:
        own = self._accept.get(request.request_id)
        return own.alpha if own is not None else self.acceptance.alpha

    def _lookup(self, request: Request, k: int) -> list[int]:
        index = self._index.get(request.request_id)
        if index is None:
            index = self._index[request.request_id] = NgramIndex(self.config.min_ngram, self.config.max_ngram)
        prompt, output = request.prompt_token_ids, request.output_token_ids
        if len(index) < len(prompt):
            index.extend(prompt[len(index):])
        if len(index) < len(prompt) + len(output):
            index.extend(output[len(index) - len(prompt):])
        draft = index.propose(k)
        if not draft and self.history is not None:
            draft = self.history.propose(self._scope(request), index.tokens[-self.config.max_ngram:], k)
        return draft

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        """A verification of ``proposed`` tokens of ``request`` accepted ``accepted`` of them."""
        own = self._accept.get(request.request_id)
        if own is None:
            own = self._accept[request.request_id] = Acceptance(self.acceptance.alpha, 2.0, 0.9)
        own.observe(proposed, accepted)
        self.acceptance.observe(proposed, accepted)

    def finished(self, request: Request) -> None:
        """``request`` is done: its tokens join its tenant's history (when kept); its state goes."""
        self._index.pop(request.request_id, None)
        self._accept.pop(request.request_id, None)
        self._passed.pop(request.request_id, None)
        if self.history is not None and request.output_token_ids:
            self.history.add(self._scope(request), request.all_token_ids)

    @staticmethod
    def _scope(request: Request) -> str:
        """Whose history a request may draw on: its tenant's, within its cache scope (the boundary the prefix
        cache keeps: acceptance speed would otherwise tell one scope's users about another's text)."""
        return f"{request.tenant}\x00{request.cache_scope}"
