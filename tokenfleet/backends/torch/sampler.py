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

import ctypes
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenfleet.backends.torch.grammar_masks import apply_masks, fill_masks, mask_width
from tokenfleet.engine.output import TokenLogprobs
from tokenfleet.engine.request import Request
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models import native


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own streams (CPU)
        self._shared_generator = torch.Generator().manual_seed(secrets.randbits(63))
        self._native = NativeTemperatureSampler.load() if device.type == "cpu" else None

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
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if not random_rows:
            token_ids = logits.argmax(dim=-1)
        elif len(random_rows) == len(requests):
            token_ids = self._draw(logits, requests)
        else:
            token_ids = logits.argmax(dim=-1)
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._draw(logits.index_select(0, rows), [requests[i] for i in random_rows])
        token_ids_list: list[int] = token_ids.tolist()
        for i in guided:
            requests[i].guide.consume_token(token_ids_list[i])  # an error state ends the request (scheduler)
        logprobs = [
            token_logprobs(raw_logprobs[i], token_ids_list[i], r.sampling_params.logprobs)
            if raw_logprobs is not None and r.sampling_params.logprobs is not None
            else None
            for i, r in enumerate(requests)
        ]
        return SamplerOutput(token_ids=token_ids_list, logprobs=logprobs)

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
        return inverse_cdf(probs, uniforms.to(device=probs.device, dtype=probs.dtype))

    def _generator(self, request: Request, seed: int) -> torch.Generator:
        """A seeded request's own stream (created on its first draw)."""
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = self._generators[request.request_id] = torch.Generator().manual_seed(seed)
        return gen


class NativeTemperatureSampler:
    """csrc/sampling.c: inverse-CDF draws of temperature-only rows from fp32 CPU logits."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.tf_sample_temperature
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int]
        self._fn.restype = None

    @classmethod
    def load(cls) -> NativeTemperatureSampler | None:
        lib = native.load("sampling")
        return cls(lib) if lib is not None else None

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor:
        """[rows] token ids; -1 where a row cannot be drawn (every token masked, non-finite logits)."""
        logits = logits.contiguous()
        rows, vocab = logits.shape
        inv_temps = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32)
        uniforms = uniforms.contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        self._fn(logits.data_ptr(), rows, vocab, inv_temps.data_ptr(), uniforms.data_ptr(), out.data_ptr(),
                 torch.get_num_threads())
        return out


CDF_CHUNK = 256


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative mass exceeds uniform * total (never a zero-probability
    token). Two levels, so no cumulative sum runs over the whole vocabulary (a [32, 49k] cumsum is
    one slow serial pass, ~4 ms here): sums of 256-token chunks, the chunk, then the token in it.
    probs: [rows, vocab] >= 0; uniforms: [rows] in [0, 1)."""
    rows, vocab = probs.shape
    pad = -vocab % CDF_CHUNK
    chunks = F.pad(probs, (0, pad)).view(rows, -1, CDF_CHUNK)  # [rows, num_chunks, CHUNK]
    chunk_cdf = chunks.sum(dim=-1).cumsum(dim=-1)  # [rows, num_chunks]
    target = uniforms[:, None] * chunk_cdf[:, -1:]
    chunk = torch.searchsorted(chunk_cdf, target, right=True).clamp_(max=chunk_cdf.shape[-1] - 1)  # [rows, 1]
    # Mass before the chosen chunk, then the token inside it.
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), torch.zeros_like(target))
    inner = chunks.gather(1, chunk[:, :, None].expand(-1, -1, CDF_CHUNK)).squeeze(1).cumsum(dim=-1)  # [rows, CHUNK]
    offset = torch.searchsorted(inner, target - before, right=True).clamp_(max=CDF_CHUNK - 1)
    # A rounding shortfall can point past the chunk's last non-zero token: step back to it.
    token = (chunk * CDF_CHUNK + offset).squeeze(1)
    nonzero = probs.gather(1, token.clamp(max=vocab - 1)[:, None]).squeeze(1) > 0
    if not bool(nonzero.all()):
        fallback = torch.searchsorted(probs.cumsum(dim=-1), (uniforms[:, None] * probs.sum(-1, keepdim=True)), right=True)
        token = torch.where(nonzero, token, fallback.squeeze(1))
    return token.clamp_(max=vocab - 1)


def filtered_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Probabilities after temperature, top_k, top_p and min_p. row: [vocab] float32."""
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return filtered_probs_batch(row[None, :], [params])[0]


def filtered_probs_batch(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] probabilities after each row's temperature, top_k, top_p and min_p (float32 in)."""
    rows, vocab = logits.shape
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k_max = max(top_k)
        top_values = torch.topk(logits, k_max, dim=-1).values  # [rows, k_max], descending
        kth_index = torch.tensor([max(k, 1) - 1 for k in top_k], device=device)
        kth = top_values.gather(1, kth_index[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in top_k], device=device)[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        index = torch.tensor(nucleus, device=device)
        top_p = torch.tensor([params[i].top_p for i in nucleus], dtype=logits.dtype, device=device)
        sorted_logits, order = torch.sort(logits.index_select(0, index), dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits[index] = logits.index_select(0, index).masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        threshold = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
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
