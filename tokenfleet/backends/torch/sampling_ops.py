"""The sampler's row operations on logits: the native temperature-sampling kernel (csrc/sampling.c), greedy picks,
the inverse-CDF draw and the temperature/top_k/top_p/min_p filter. The sampler (``sampler.py``) runs them; the
native kernel's known-answer check (``sampler_check.py``) compares the kernel with them."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tokenfleet.backends.torch.device import to_device
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models import native, triton_logits


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


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: ``logits.argmax(dim=-1)``, on CUDA in two Triton kernels (models.triton_logits: one
    128k-vocabulary row took torch's reduction 27 us on an H100)."""
    return triton_logits.argmax_rows(logits) if triton_logits.serves(logits) else logits.argmax(dim=-1)


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
    """[rows, vocab] probabilities after each row's temperature, top_k, top_p and min_p (float32 in). Parameters go
    to the device without waiting for its queue (``device.to_device``)."""
    rows, vocab = logits.shape
    device = logits.device
    temperature = to_device(torch.tensor([p.temperature for p in params], dtype=logits.dtype), device)
    logits = logits / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k_max = max(top_k)
        top_values = torch.topk(logits, k_max, dim=-1).values  # [rows, k_max], descending
        kth_index = to_device(torch.tensor([max(k, 1) - 1 for k in top_k]), device)
        kth = top_values.gather(1, kth_index[:, None])
        kth = kth.masked_fill(to_device(torch.tensor([k == 0 for k in top_k]), device)[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        index = to_device(torch.tensor(nucleus), device)
        top_p = to_device(torch.tensor([params[i].top_p for i in nucleus], dtype=logits.dtype), device)
        sorted_logits, order = torch.sort(logits.index_select(0, index), dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits[index] = logits.index_select(0, index).masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        threshold = to_device(torch.tensor(min_p, dtype=probs.dtype), device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
