"""Known-answer checks of compiled kernels where they are built, before the engine uses them.

A native CPU kernel is compiled for the machine it runs on (``-march=native``) and a Triton kernel is JIT-compiled
for the GPU it runs on: neither is the code any test ran. So when a model is loaded, every kernel that is not the
torch reference is run on a fixed set of cases in the model's own geometry (its heads, KV heads, head_dim, the
engine's block size, the KV cache's kind, each of its attention windows) and compared with the torch reference on
the same inputs. A kernel that disagrees beyond the stated tolerance is not used: the engine serves from the torch
reference instead, logs an error naming the kernel, the case and the error, and reports the failure
(``KernelCheck``: the worker's load report, ``tokenfleet_worker_kernel_check`` in /metrics, ``tokenfleet doctor``).

Tolerances (elementwise ``|kernel - reference| <= atol + rtol * |reference|``), against a reference computed in
fp32 on the same stored inputs:
  - attention, bf16 output: rtol 2^-7, atol 2^-8 (one bf16 rounding of the output is 2^-8 relative; the rest is
    room for fp32 sums in another order). fp16 output: rtol 2^-9, atol 2^-10. fp32: rtol 1e-4, atol 1e-5.
  - linear layers (fp32 few-row matmul): rtol 1e-4, atol 1e-5, against F.linear in float64 on inputs scaled so
    outputs are O(1).
  - quantized linear layers (GGML block types): the same, the reference the weights dequantized exactly
    (ggml_quant.dequantize) and multiplied in float64; bf16 activations: bf16's tolerance (one output rounding).
  - layer ops: within one rounding step of the output dtype (they repeat the reference's rounding points, so
    they are usually bitwise equal).
A wrong kernel is off by far more: a score moved by 1 shifts a short context's output by ~0.1-0.5.

The cases cover what serving produces: decode rows on both sides of 16-key tiles and blocks, a 37-token prompt
prefilled in one call (two work items of the native kernel: 32 rows and 5), a chunk after cached context,
speculative rows, and decode and prefill rows of several requests in one call over shuffled block tables that share
a prefix block.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
import torch

from tokenfleet.engine.runner import KernelCheck
from tokenfleet.models import kv_fp8
from tokenfleet.models.attention import ForwardBatch, PagedAttention, PagedQueries, TorchPagedAttention
from tokenfleet.models.config import ModelConfig

log = structlog.get_logger(__name__)

ATTENTION_CASES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (  # (context lengths, query rows) per request
    ((1, 15, 16, 17, 38, 100), (1, 1, 1, 1, 1, 1)),  # decode rows around tile and block edges
    ((37,), (37,)),  # a fresh 37-token prefill: 32 rows and 5 in two work items
    ((5,), (5,)),
    ((100, 33), (37, 33)),  # a chunk after 63 cached tokens; a fresh 33-token prefill
    ((40, 33, 7), (3, 5, 1)),  # speculative verification rows
    ((77, 1, 70, 35), (1, 1, 64, 3)),  # decode and prefill rows of several requests in one call
)
Q_SCALES = (1.0, 4.0)  # spread and peaked softmaxes

TOLERANCES = {torch.bfloat16: (2**-7, 2**-8), torch.float16: (2**-9, 2**-10), torch.float32: (1e-4, 1e-5)}


def tolerance(kernel: Any, dtype: torch.dtype, kv_cache_dtype: str = "") -> tuple[float, float]:
    """(rtol, atol) for ``kernel``'s outputs: the dtype's, or the kernel's own where it declares a looser one
    (``check_tolerance(dtype, kv_cache_dtype)``: a kernel that rounds more on purpose, e.g. the Triton attention
    taking P.V in bf16)."""
    own = getattr(kernel, "check_tolerance", None)
    return (own(dtype, kv_cache_dtype) if own is not None else None) or TOLERANCES[dtype]


def tolerance_text(tol: tuple[float, float]) -> str:
    rtol, atol = tol
    return f"|kernel - fp32 reference| <= {atol:g} + {rtol:g} * |reference|"


def _excess(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> tuple[float, float]:
    """(max |got - want|, max of |got - want| / (atol + rtol |want|)): the second above 1 fails."""
    rtol, atol = tol
    diff = (got.float() - want.float()).abs()
    ratio = diff / (atol + rtol * want.float().abs())
    return float(diff.max()), float(torch.nan_to_num(ratio, nan=float("inf")).max())


def _run(kernel: str, implementation: str, tol: tuple[float, float], cases: Callable[[], Any]) -> KernelCheck:
    """Run ``cases`` (an iterator of (label, got, want)) and summarize; the first case over tolerance fails."""
    start = time.perf_counter()
    worst = 0.0
    detail = ""
    try:
        for label, got, want in cases():
            error, ratio = _excess(got, want, tol)
            worst = max(worst, error) if error == error else float("nan")
            if not ratio <= 1.0:
                detail = f"{label}: max |error| {error:.4g} ({ratio:.3g}x the tolerance)"
                break
    except Exception as e:  # noqa: BLE001 - a kernel that fails to run here is a failed check, not a crash
        detail = f"raised {e!r}"
    return KernelCheck(kernel=kernel, implementation=implementation, passed=not detail, max_error=worst,
                       tolerance=tolerance_text(tol), seconds=time.perf_counter() - start, detail=detail,
                       serving=implementation if not detail else "")


def implementation_name(obj: object) -> str:
    return getattr(obj, "name", None) or type(obj).__name__


def checked_attention(candidates: Iterable[PagedAttention], config: ModelConfig, dtype: torch.dtype,
                      device: torch.device, kv_cache_dtype: str = "", block_size: int = 16
                      ) -> tuple[PagedAttention, tuple[KernelCheck, ...]]:
    """The first of ``candidates`` that agrees with the torch reference on the cases (else the reference), and the
    checks that decided it. ``candidates`` is iterated lazily: a fallback is only built when it is needed."""
    windows = sorted({0, *config.layer_windows})
    return _first_passing(
        "paged_attention", candidates, TorchPagedAttention(), lambda attend: tolerance(attend, dtype, kv_cache_dtype),
        lambda attend: _attention_cases(attend, config, dtype, device, kv_cache_dtype, block_size, windows))


def _attention_cases(attend: PagedAttention, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                     kv_cache_dtype: str, block_size: int, windows: list[int]):
    reference = TorchPagedAttention()
    g = torch.Generator().manual_seed(1234)
    for lens, rows in ATTENTION_CASES:
        q_raw = torch.randn(sum(rows), config.num_heads, config.head_dim, generator=g)
        k_cache, v_cache, meta = _paged_inputs(list(lens), list(rows), config, dtype, kv_cache_dtype, block_size, g)
        k_cache, v_cache = k_cache.to(device), v_cache.to(device)
        for window in windows:
            m = PagedQueries(meta.block_table.to(device), meta.context_lens.to(device), meta.query_start.to(device),
                             meta.num_tokens, meta.max_query_len, window)
            for scale in Q_SCALES:
                q = (q_raw * scale).to(device, dtype)
                want = reference(q.float(), k_cache, v_cache, m)
                got = attend(q, k_cache, v_cache, m)
                label = (f"context {list(lens)}, query rows {list(rows)}, heads {config.num_heads}/{config.num_kv_heads}"
                         f", head_dim {config.head_dim}, block {block_size}, window {window}, q scale {scale:g}")
                yield label, got, want


def _paged_inputs(lens: list[int], rows: list[int], config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str,
                  block_size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, PagedQueries]:
    """Caches of shuffled blocks (request 1 shares request 0's first block when both have one full), the last
    block left for padding, and the queries' metadata."""
    per_request = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_request) + 2
    shape = (config.num_kv_heads, num_blocks, block_size, config.head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    if kv_cache_dtype == "fp8":
        k_cache, v_cache = kv_fp8.quantize(k), kv_fp8.quantize(v)
    else:
        k_cache, v_cache = k.to(dtype), v.to(dtype)
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(lens), max(per_request), dtype=torch.long)
    used = 0
    for r, n in enumerate(per_request):
        table[r, :n] = order[used: used + n]
        used += n
    if len(lens) > 1 and lens[0] > block_size and lens[1] > block_size:
        table[1, 0] = table[0, 0]  # a shared prefix block
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    return k_cache, v_cache, PagedQueries(table, torch.tensor(lens), starts, int(starts[-1]), max(rows))


LINEAR_ROWS = (1, 2, 5, 8, 9, 16, 31, 32, 33)  # rows per step: each register-tile width, the limit and one past it


def checked_linear(linear: Any, config: ModelConfig, dtype: torch.dtype, device: torch.device
                   ) -> tuple[Any, tuple[KernelCheck, ...]]:
    """``linear`` (models.linear.DenseLinear) if its few-rows kernel (compiled here: the native fp32 one on CPU, the
    Triton one on CUDA) agrees with ``F.linear`` on every layer shape of the model, else ``F.linear`` alone. Matmuls
    that are torch's own (``F.linear``, oneDNN, FP8's ``_scaled_mm``) have nothing to check."""
    from tokenfleet.models.linear import DenseLinear

    if not (isinstance(linear, DenseLinear) and linear.few_rows is not None):
        return linear, ()
    return _first_passing("linear", [linear], DenseLinear(), lambda kernel: TOLERANCES[dtype],
                          lambda kernel: _linear_cases(kernel, config, dtype, device))


def _linear_cases(linear: Any, config: ModelConfig, dtype: torch.dtype, device: torch.device):
    """Inputs rounded to ``dtype``, the reference in float64 on those rounded values."""
    g = torch.Generator().manual_seed(7)
    c = config
    shapes = {("qkv", (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
              ("o_proj", c.hidden_size, c.num_heads * c.head_dim), ("gate_up", 2 * c.intermediate_size, c.hidden_size),
              ("down", c.hidden_size, c.intermediate_size), ("lm_head (first rows)", min(c.vocab_size, 1031), c.hidden_size)}
    for name, n, k in sorted(shapes):
        weight = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
        for rows in LINEAR_ROWS:
            x = torch.randn(rows, k, generator=g).to(dtype)
            want = torch.nn.functional.linear(x.double(), weight.double())
            got = linear(x.to(device), weight.to(device).contiguous())
            yield f"{name} [{n}, {k}] with {rows} rows", got.cpu(), want


def checked_quant_linear(linear: Any, shapes: Iterable[tuple[str, int, int]], dtype: torch.dtype
                         ) -> tuple[Any, tuple[KernelCheck, ...]]:
    """``linear`` (models.quant_linear.QuantLinear) if its native kernel agrees with the torch reference (dequantize,
    then matmul in float64) on every (ggml type, out features, in features) of ``shapes`` (the model's quantized
    layers), else the reference alone. Weights are random blocks of each type (ggml_quant.random_quant: outputs of
    unit-normal x are O(1)), at most 1031 rows of each; x is rounded to ``dtype``; tolerances as the fp32 few-row
    matmul's (the kernel's weights are the reference's exactly, its sums fp32 in another order), or bf16's, or the
    kernel's own (int8 activations: QuantLinear.check_tolerance)."""
    from tokenfleet.models.quant_linear import QuantLinear

    if not (isinstance(linear, QuantLinear) and linear.native is not None):
        return linear, ()
    return _first_passing("quant_linear", [linear], QuantLinear(), lambda kernel: tolerance(kernel, dtype),
                          lambda kernel: _quant_linear_cases(kernel, sorted(set(shapes)), dtype))


def checked_gpu_quant_linear(linear: Any, shapes: Iterable[tuple[str, int, int]], dtype: torch.dtype,
                             device: torch.device) -> tuple[Any, tuple[KernelCheck, ...]]:
    """``linear`` (models.triton_quant.GpuQuantLinear) if its Triton matmul agrees with dequantize-then-matmul in
    float64 on the model's Q8_0 / Q4_1 shapes (random blocks, at most 1031 rows each; rows of x: 1, the kernel's
    most, and one more, which dequantizes for cuBLAS), within the layer's tolerance (its weights are rounded to x's
    dtype, as a dequantized checkpoint's would be: GpuQuantLinear.check_tolerance); else the same layer without it."""
    from tokenfleet.models.triton_quant import KINDS, GpuQuantLinear

    if linear.matmul is None:
        return linear, ()
    kept = sorted({s for s in shapes if s[0] in KINDS})

    def cases(kernel: Any):  # type: ignore[no-untyped-def]
        from tokenfleet.models.ggml_quant import dequantize, random_quant

        g = torch.Generator().manual_seed(13)
        for kind, n, k in kept:
            weight = random_quant(kind, min(n, 1031), k, g)
            values = dequantize(weight, torch.float64)
            prepared = kernel.prepare(weight)
            for rows in sorted({1, kernel.matmul.rows, kernel.matmul.rows + 1}):
                x = torch.randn(rows, k, generator=g).to(dtype)
                got = kernel(x.to(device), prepared).cpu()
                want = torch.nn.functional.linear(x.double(), values)
                yield f"{kind} [{weight.rows}, {k}] with {rows} rows", got, want

    return _first_passing("quant_linear", [linear], GpuQuantLinear(device, dtype),
                          lambda kernel: tolerance(kernel, dtype), cases)


def _quant_linear_cases(linear: Any, shapes: list[tuple[str, int, int]], dtype: torch.dtype):
    from tokenfleet.models.ggml_quant import dequantize, random_quant

    g = torch.Generator().manual_seed(11)
    most = linear.rows_native(dtype)
    # the native kernel's rows, and one more: the prefill path, which dequantizes with the native code
    rows_cases = sorted({r for r in LINEAR_ROWS if 0 < r <= most} | {most, most + 1} - {0})
    for kind, n, k in shapes:
        weight = random_quant(kind, min(n, 1031), k, g)
        values = dequantize(weight, torch.float64)
        prepared = linear.prepare(weight)
        for rows in rows_cases:
            x = torch.randn(rows, k, generator=g).to(dtype)
            want = torch.nn.functional.linear(x.double(), values)
            yield f"{kind} [{weight.rows}, {k}] with {rows} rows", linear(x, prepared), want


def checked_layer_ops(ops: Any, reference: Any, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                      kv_cache_dtype: str = "") -> tuple[Any, tuple[KernelCheck, ...]]:
    """``ops`` (models.layer_ops.LayerOps) if each op agrees with ``reference`` (the torch ops), else the reference."""
    candidates = [] if type(ops) is type(reference) else [ops]
    return _first_passing("layer_ops", candidates, reference, lambda kernel: tolerance(kernel, dtype, kv_cache_dtype),
                          lambda kernel: _layer_cases(kernel, reference, config, dtype, device, kv_cache_dtype))


def _layer_cases(ops: Any, reference: Any, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 kv_cache_dtype: str):
    from tokenfleet.models.llama import rope_inv_freq

    g = torch.Generator().manual_seed(99)
    tokens, hidden = 37, config.hidden_size

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    residual, delta, weight = rand(tokens, hidden, scale=3.0), rand(tokens, hidden), rand(hidden).abs() + 0.5
    for d in (delta, None):
        got, want = ops.add_rms_norm(residual.clone(), d, weight, 1e-5), reference.add_rms_norm(residual.clone(), d,
                                                                                                  weight, 1e-5)
        yield f"add_rms_norm over [{tokens}, {hidden}]", torch.cat(got), torch.cat(want)
    gate_up = rand(tokens, 2 * config.intermediate_size, scale=4.0)
    yield f"silu_mul over [{tokens}, {2 * config.intermediate_size}]", ops.silu_mul(gate_up), reference.silu_mul(gate_up)
    angles = torch.arange(config.max_position_embeddings).float()[:, None] * rope_inv_freq(config)[None, :]
    cos, sin = (f(torch.cat((angles, angles), dim=-1)).to(device, dtype) for f in (torch.cos, torch.sin))
    width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    qkv = rand(tokens, width)
    block_size, num_blocks = 16, -(-tokens // 16) + 1
    positions = torch.randint(0, config.max_position_embeddings, (tokens,), generator=g).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(device)
    batch = ForwardBatch(positions, slots, positions[:1])
    row = kv_fp8.row_width(config.head_dim) if kv_cache_dtype == "fp8" else config.head_dim
    cache_dtype = torch.uint8 if kv_cache_dtype == "fp8" else dtype
    caches = [torch.zeros(config.num_kv_heads, num_blocks, block_size, row, dtype=cache_dtype, device=device)
              for _ in range(4)]
    got = ops.rope_store_kv(qkv, batch, cos, sin, caches[0], caches[1])
    want = reference.rope_store_kv(qkv, batch, cos, sin, caches[2], caches[3])
    label = f"rope_store_kv of {tokens} tokens, heads {config.num_heads}/{config.num_kv_heads}"
    yield label, torch.cat([x.reshape(tokens, -1) for x in got], 1), torch.cat([x.reshape(tokens, -1) for x in want], 1)
    for mine, theirs in ((caches[0], caches[2]), (caches[1], caches[3])):
        if kv_cache_dtype == "fp8":
            mine, theirs = kv_fp8.dequantize(mine), kv_fp8.dequantize(theirs)
        yield label + " (the cache it wrote)", mine, theirs


def _first_passing(role: str, candidates: Iterable[Any], reference: Any, tol: Callable[[Any], tuple[float, float]],
                   cases: Callable[[Any], Any]) -> tuple[Any, tuple[KernelCheck, ...]]:
    """Check ``candidates`` in order until one passes; the reference serves if none does. Every check made is
    returned, each saying what serves in the end."""
    checks: list[KernelCheck] = []
    chosen, serving = reference, "torch reference"
    for kernel in candidates:
        check = _run(role, implementation_name(kernel), tol(kernel), functools.partial(cases, kernel))
        checks.append(check)
        if check.passed:
            chosen, serving = kernel, check.implementation
            break
    if not checks:  # the reference itself: nothing to check
        return reference, (KernelCheck(role, "torch reference", True, 0.0, "the reference", 0.0, "",
                                       "torch reference"),)
    checks = [dataclasses.replace(c, serving=serving) for c in checks]
    for c in checks:
        if c.passed:
            log.info("kernel_check", kernel=role, implementation=c.implementation, result="passed",
                     max_error=round(c.max_error, 6), seconds=round(c.seconds, 3))
        else:
            log.error("kernel_check_failed", kernel=role, implementation=c.implementation, case=c.detail,
                      tolerance=c.tolerance, serving=serving,
                      note="this kernel computes wrong results on this machine: never used here")
    return chosen, tuple(checks)
