"""Sampler: turns one step's logits into tokens, per-request parameters, batch-independent.

Order per row: logprobs of the raw logits (reported values) -> repetition/frequency/presence
penalties -> logit_bias -> grammar mask (guided requests; their matcher then consumes the
sampled token) or min_tokens mask (EOS and stop ids) -> greedy argmax, or temperature ->
top_k -> top_p -> min_p -> an inverse-CDF draw with one uniform number per row.

Vectorized over the batch: the random rows are filtered and drawn together (one softmax,
one cumsum, one searchsorted), whatever mix of parameters they carry; sorting for top_p happens
only for the rows that ask for it. Uniforms: a seeded request has its own ``torch.Generator``
advanced by exactly one draw per sampled token, so it produces the same tokens whatever else
shares its batch; unseeded rows take theirs from the sampler's generator in one call.
(Drawing per row with an exponential race over the whole vocabulary cost 28-41 % of a
32-request CPU decode step.)

On CPU, rows with a temperature and no top_k / top_p / min_p (what a client that sends only
a temperature, or nothing, gets) are drawn by csrc/sampling.c: the same inverse-CDF draw from the
same uniforms without materializing probabilities (the torch path: 8 ms of a 60 ms 32-request
decode step here; the kernel: under 1 ms). Without a compiler every row takes the torch path.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenfleet.backends.torch.device import to_device
from tokenfleet.backends.torch.grammar_masks import apply_masks, fill_masks, mask_width
from tokenfleet.backends.torch.sampler_check import checked_native_sampler
from tokenfleet.backends.torch.sampling_ops import (  # noqa: F401 - sampler's names for its callers
    CDF_CHUNK,
    NativeTemperatureSampler,
    argmax,
    filtered_probs,
    filtered_probs_batch,
    inverse_cdf,
)
from tokenfleet.engine.output import TokenLogprobs
from tokenfleet.engine.request import Request
from tokenfleet.engine.runner import KernelCheck


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class PendingSample:
    """Tokens sampled on the device, not yet read by the host (overlapped scheduling): ``token_ids`` feeds the next
    step's inputs on the device; ``result()`` waits for the copies to the host and builds the outputs.

    Requested logprobs are computed with the tokens, for every row that wants them at once (the chosen token's
    logprob and rank, the top ones), and cross to the host with them: one wait per step, not a few per row (a
    read of a device value waits for everything queued, the next step too)."""

    def __init__(self, token_ids: torch.Tensor, requests: Sequence[Request], raw_logprobs: torch.Tensor | None):
        self.token_ids = token_ids
        self._requests = requests
        self._rows = [i for i, r in enumerate(requests) if raw_logprobs is not None and r.sampling_params.logprobs is not None]
        values: list[torch.Tensor] = [token_ids]
        if self._rows and raw_logprobs is not None:
            at = to_device(torch.tensor(self._rows), raw_logprobs.device)
            rows = raw_logprobs.index_select(0, at)
            chosen = rows.gather(1, token_ids.index_select(0, at)[:, None])  # [n, 1]
            ranks = (rows > chosen).sum(dim=1) + 1
            k = max(requests[i].sampling_params.logprobs or 0 for i in self._rows)
            top_values, top_ids = torch.topk(rows, k, dim=1) if k else (rows[:, :0], ranks[:, None][:, :0])
            values += [chosen[:, 0], ranks, top_values, top_ids]
        self._event: torch.cuda.Event | None = None
        if token_ids.is_cuda:  # to pinned memory, ordered after the sampling kernels; nothing waits for it here
            self._host = []
            for value in values:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                host.copy_(value, non_blocking=True)
                self._host.append(host)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        ids: list[int] = self._host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(ids)
        if self._rows:
            chosen, ranks, top_values, top_ids = (t.tolist() for t in self._host[1:])
            for j, i in enumerate(self._rows):
                n = self._requests[i].sampling_params.logprobs or 0
                logprobs[i] = TokenLogprobs(token_id=ids[i], logprob=chosen[j], rank=ranks[j],
                                            top=tuple(zip(top_ids[j][:n], top_values[j][:n])))
        return SamplerOutput(token_ids=ids, logprobs=logprobs)


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own streams (CPU)
        self._shared_generator = torch.Generator().manual_seed(secrets.randbits(63))
        # the native kernel, checked where it was built (never drawn from after a failed check), and the check
        self._native: NativeTemperatureSampler | None = None
        self.kernel_checks: tuple[KernelCheck, ...] = ()
        if device.type == "cpu":
            self._native, self.kernel_checks = checked_native_sampler()

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: float32 [num_rows, vocab], row i belongs to requests[i]. May modify ``logits``."""
        out = self.sample_async(logits, requests, guided_ok=True).result()
        for i, r in enumerate(requests):
            if r.guide is not None:
                r.guide.consume_token(out.token_ids[i])  # an error state ends the request (scheduler)
        return out

    def sample_async(self, logits: torch.Tensor, requests: Sequence[Request], guided_ok: bool = False) -> PendingSample:
        """``sample`` without waiting for the tokens: the kernels are queued and the tokens stay on the device
        (``PendingSample.token_ids``) until ``result()``. Guided rows need their tokens on the host at once (their
        matcher consumes each): only ``sample`` takes them."""
        if not guided_ok and any(r.guide is not None for r in requests):
            raise ValueError("guided rows are sampled synchronously")
        raw_logprobs = self._adjust(logits, requests)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if not random_rows:
            token_ids = argmax(logits)
        elif len(random_rows) == len(requests):
            token_ids = self._draw(logits, requests)
        else:
            token_ids = argmax(logits)
            rows = to_device(torch.tensor(random_rows), logits.device)
            token_ids[rows] = self._draw(logits.index_select(0, rows), [requests[i] for i in random_rows])
        return PendingSample(token_ids, requests, raw_logprobs)

    def _adjust(self, logits: torch.Tensor, rows: Sequence[Request | _Row], masks: torch.Tensor | None = None
                ) -> torch.Tensor | None:
        """In place: penalties, logit bias, grammar masks (``masks``: precomputed bitmask rows of the guided rows,
        in order; else from each row's matcher), min_tokens bans. Returns the raw logprobs when a row wants them."""
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        penalized = [i for i, r in enumerate(rows) if r.sampling_params.has_penalties]
        if penalized:
            apply_penalties(logits, [rows[i] for i in penalized], penalized)
        for i, r in enumerate(rows):
            if r.sampling_params.logit_bias:
                ids, values = zip(*r.sampling_params.logit_bias)
                logits[i, list(ids)] += to_device(torch.tensor(values, dtype=logits.dtype), logits.device)
        guided = [i for i, r in enumerate(rows) if r.guide is not None]
        if guided:
            if masks is None:
                masks = torch.empty(len(guided), mask_width(logits.shape[-1]), dtype=torch.int32)
                fill_masks([rows[i].guide for i in guided], masks)
            apply_masks(logits, guided, masks)
        for i, r in enumerate(rows):
            if r.guide is None and len(r.output_token_ids) < r.sampling_params.min_tokens:
                banned = list(r.sampling_params.stop_token_ids)
                if not r.sampling_params.ignore_eos:
                    banned += list(r.eos_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")
        return raw_logprobs

    def verify(self, logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[Sequence[int]],
               draft_probs: Sequence[torch.Tensor | None] | None = None) -> list[SamplerOutput]:
        """Speculative verification. Request r owns 1 + len(drafts[r]) consecutive rows of ``logits``: row j is
        the target's logits for the token after its tokens and drafts[r][:j]. Each row is adjusted as a plain
        decode step at that point would be (penalties count the drafts before it, the grammar has consumed
        them, min_tokens counts them). Returns per request the accepted run of drafts and one token of the
        target's own: greedy requests accept while the draft equals the argmax; sampled ones by rejection
        sampling against the drafter's point mass (accept d with probability p(d); on a rejection draw from p
        without d, renormalized; after a full run draw from the last row), which leaves the output distributed
        exactly as the target's. ``draft_probs[r]`` ([len(drafts[r]), vocab]): the distribution a draft model drew
        request r's proposals from (sampled requests): accept d with probability min(1, p(d) / q(d)), on a rejection
        draw from max(0, p - q) renormalized. Guided requests' matchers consume the returned tokens.

        Seeded sampled requests are not verified here (their streams would depend on acceptance); the caller
        does not propose for them."""
        rows: list[_Row] = []
        starts: list[int] = []
        mask_rows: list[torch.Tensor] = []
        for r, draft in zip(requests, drafts):
            starts.append(len(rows))
            for j in range(len(draft) + 1):
                rows.append(_Row(r, draft[:j]))
            if r.guide is not None:
                mask_rows.append(_draft_masks(r.guide, draft, logits.shape[-1]))
        starts.append(len(rows))
        masks = torch.cat(mask_rows) if mask_rows else None
        raw_logprobs = self._adjust(logits, rows, masks)
        argmax = logits.argmax(dim=-1).tolist()
        random = [k for k, r in enumerate(requests) if not r.sampling_params.is_greedy]
        chosen: dict[int, list[int]] = {}
        if random:
            qs = draft_probs or [None] * len(requests)
            chosen = self._verify_random(logits, rows, starts, [(k, requests[k], drafts[k]) for k in random],
                                         [qs[k] for k in random])
        outputs = []
        for k, (r, draft) in enumerate(zip(requests, drafts)):
            start = starts[k]
            if k in chosen:
                tokens = chosen[k]
            else:
                m = 0
                while m < len(draft) and argmax[start + m] == draft[m]:
                    m += 1
                tokens = [*draft[:m], argmax[start + m]]
            if r.guide is not None:  # as plain decoding would, end where the grammar completes (no EOS after it)
                for i, token in enumerate(tokens):
                    r.guide.consume_token(token)
                    if r.guide.is_stopped():
                        tokens = tokens[: i + 1]
                        break
            num_top = r.sampling_params.logprobs
            lps = [token_logprobs(raw_logprobs[start + j], t, num_top)
                   if raw_logprobs is not None and num_top is not None else None for j, t in enumerate(tokens)]
            outputs.append(SamplerOutput(tokens, lps))
        return outputs

    def _verify_random(self, logits: torch.Tensor, rows: Sequence[_Row], starts: Sequence[int],
                       entries: Sequence[tuple[int, Request, Sequence[int]]], qs: Sequence[torch.Tensor | None]
                       ) -> dict[int, list[int]]:
        """Rejection sampling for the sampled requests of ``verify`` (index k -> tokens); ``qs``: each one's draft
        distribution, or None for a point mass on its proposals (a proposer that does not sample)."""
        index = [i for k, _, _ in entries for i in range(starts[k], starts[k + 1])]
        probs = filtered_probs_batch(logits[index], [rows[i].sampling_params for i in index])  # [n, vocab]
        local = {k: sum(starts[kk + 1] - starts[kk] for kk, _, _ in entries[:pos]) for pos, (k, _, _) in enumerate(entries)}
        draft_rows = [(local[k] + j, d) for k, _, draft in entries for j, d in enumerate(draft)]
        p_draft: list[float] = []
        if draft_rows:
            at = torch.tensor([row for row, _ in draft_rows], device=probs.device)
            tok = torch.tensor([d for _, d in draft_rows], device=probs.device)
            p_draft = probs[at, tok].tolist()
            q_draft = [q[j, d].item() if q is not None else 1.0 for q, (_, _, draft) in zip(qs, entries)
                       for j, d in enumerate(draft)]
            p_draft = [p / q if q > 0 else 1.0 for p, q in zip(p_draft, q_draft)]  # acceptance probability
        uniforms = torch.rand(len(draft_rows) + len(entries), generator=self._shared_generator).tolist()
        final_rows: list[int] = []
        final_ban: list[int] = []
        residual_q: list[tuple[int, torch.Tensor]] = []  # (final row, the draft distribution to subtract)
        out: dict[int, list[int]] = {}
        u = iter(uniforms)
        p = iter(p_draft)
        for (k, _, draft), q in zip(entries, qs):
            accepted, rejected = 0, -1
            for j in range(len(draft)):
                if next(u) < next(p):
                    accepted += 1
                else:
                    rejected = draft[j]
                    break
            for _ in range(len(draft) - accepted - (1 if rejected >= 0 else 0)):  # keep the streams aligned
                next(p)
            out[k] = list(draft[:accepted])
            final_rows.append(local[k] + accepted)
            if q is not None and rejected >= 0:
                residual_q.append((len(final_rows) - 1, q[accepted]))
                rejected = -1
            final_ban.append(rejected)
        residual = probs[torch.tensor(final_rows, device=probs.device)]
        for i, q_row in residual_q:  # max(0, p - q): the mass the draft under-proposed
            residual[i] = (residual[i] - q_row.to(residual.dtype)).clamp_(min=0.0)
        ban = [(i, t) for i, t in enumerate(final_ban) if t >= 0]
        if ban:  # the drafter's point mass on the rejected token: p - q clipped at 0 zeroes exactly that token
            residual[[i for i, _ in ban], [t for _, t in ban]] = 0.0
        draws = inverse_cdf(residual, torch.tensor(uniforms[len(draft_rows):], dtype=residual.dtype,
                                                   device=residual.device)).tolist()
        for (k, _, _), token in zip(entries, draws):
            out[k].append(token)
        return out

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """One token per row of ``logits`` [rows, vocab] under each request's filters: inverse CDF."""
        params = [r.sampling_params for r in requests]
        uniforms = torch.empty(len(requests), dtype=torch.float32)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), generator=self._shared_generator, dtype=torch.float32)
        for i, r in enumerate(requests):
            seed = params[i].seed
            if seed is not None:
                uniforms[i] = torch.rand(1, generator=self._generator(r, seed), dtype=torch.float32)
        if self._native is not None and logits.dtype == torch.float32 and all(p.temperature_only for p in params):
            tokens = self._native(logits, params, uniforms)
            if bool((tokens >= 0).all()):
                return tokens
        probs = filtered_probs_batch(logits, params)
        return inverse_cdf(probs, to_device(uniforms, probs.device).to(probs.dtype))

    def _generator(self, request: Request, seed: int) -> torch.Generator:
        """A seeded request's own stream (created on its first draw)."""
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = self._generators[request.request_id] = torch.Generator().manual_seed(seed)
        return gen


class _Row:
    """A request as it would be after ``draft`` more output tokens: what one verification row is sampled as."""

    __slots__ = ("request", "draft", "sampling_params", "eos_token_ids", "guide")

    def __init__(self, request: Request, draft: Sequence[int]):
        self.request, self.draft = request, list(draft)
        self.sampling_params = request.sampling_params
        self.eos_token_ids = request.eos_token_ids
        self.guide = request.guide

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.draft

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.draft


def _draft_masks(matcher, draft: Sequence[int], vocab: int) -> torch.Tensor:
    """The grammar's allowed-token bitmask before each draft token and after the last ([len + 1, width]). The
    matcher consumes the drafts it accepts to compute them and is rolled back; past the first draft it forbids,
    rows repeat the mask that rejects it (verification never reaches them)."""
    out = torch.empty(len(draft) + 1, mask_width(vocab), dtype=torch.int32)
    valid = matcher.validate_tokens(list(draft)) if draft else 0
    fill_masks([matcher], out[0:1])
    for j in range(valid):
        matcher.consume_token(draft[j])
        fill_masks([matcher], out[j + 1: j + 2])
    out[valid + 1:] = out[valid]
    if valid:
        matcher.rollback(valid)
    return out


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request | _Row], rows: Sequence[int]) -> None:
    """In place on ``logits[rows]``: repetition (prompt + output), frequency and presence (output)."""
    vocab = logits.shape[-1]
    for row, r in zip(rows, requests):
        p = r.sampling_params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(r.all_token_ids, dtype=torch.long, device=logits.device).unique()
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids:
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def token_logprobs(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    value = row[token_id]
    rank = int((row > value).sum()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if num_top:
        values, ids = torch.topk(row, num_top)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token_id=token_id, logprob=float(value), rank=rank, top=top)

