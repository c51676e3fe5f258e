"""Sampler: turns one step's logits into tokens, per-request parameters, batch-independent.

Order per row: logprobs of the raw logits (reported values) -> repetition/frequency/presence
penalties -> logit_bias -> grammar mask (guided requests; their matcher then consumes the
sampled token) or min_tokens mask (EOS and stop ids) -> greedy argmax, or temperature ->
top_k -> top_p -> min_p -> a draw from the request's own generator. Each request has its own
``torch.Generator`` advanced by exactly one draw per sampled token, so a seeded request
produces the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenfleet.engine.guided import apply_masks, fill_masks, mask_width
from tokenfleet.engine.output import TokenLogprobs
from tokenfleet.engine.request import Request


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: float32 [num_rows, vocab], row i belongs to requests[i]. May modify ``logits``."""
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        penalized = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        if penalized:
            apply_penalties(logits, [requests[i] for i in penalized], penalized)
        for i, r in enumerate(requests):
            if r.sampling_params.logit_bias:
                ids, values = zip(*r.sampling_params.logit_bias)
                logits[i, list(ids)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
        guided = [i for i, r in enumerate(requests) if r.guide is not None]
        if guided:
            bitmask = torch.empty(len(guided), mask_width(logits.shape[-1]), dtype=torch.int32)
            fill_masks([requests[i].guide for i in guided], bitmask)
            apply_masks(logits, guided, bitmask)
        for i, r in enumerate(requests):
            if r.guide is None and len(r.output_token_ids) < r.sampling_params.min_tokens:
                banned = list(r.sampling_params.stop_token_ids)
                if not r.sampling_params.ignore_eos:
                    banned += list(r.eos_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")
        token_ids = logits.argmax(dim=-1).tolist()
        for i, r in enumerate(requests):
            if not r.sampling_params.is_greedy:
                token_ids[i] = self._sample_row(logits[i], r)
        for i in guided:
            requests[i].guide.consume_token(token_ids[i])  # an error state ends the request (scheduler)
        logprobs = [
            token_logprobs(raw_logprobs[i], token_ids[i], r.sampling_params.logprobs)
            if raw_logprobs is not None and r.sampling_params.logprobs is not None
            else None
            for i, r in enumerate(requests)
        ]
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _sample_row(self, row: torch.Tensor, request: Request) -> int:
        probs = filtered_probs(row, request.sampling_params.temperature, request.sampling_params.top_k,
                               request.sampling_params.top_p, request.sampling_params.min_p)
        noise = torch.empty_like(probs).exponential_(generator=self._generator(request))
        # argmax(p / E) with E ~ Exp(1) is an exact draw from p (the exponential race).
        return int((probs / noise).argmax())

    def _generator(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            seed = request.sampling_params.seed
            gen.manual_seed(seed if seed is not None else secrets.randbits(63))
            self._generators[request.request_id] = gen
        return gen


def filtered_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Probabilities after temperature, top_k, top_p and min_p. row: [vocab] float32."""
    logits = row / temperature
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[int]) -> None:
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
