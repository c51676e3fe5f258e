"""csrc/quant_linear.c (each build this machine can run: AVX-512, AVX2+FMA, portable C) against the torch reference
(ggml_quant.dequantize, then a float64 matmul), for every GGML type, random shapes and 1 to 100 rows of x; the
``QuantLinear`` kernel around it; its load-time check.

Tolerance of the kernel's fp32 outputs: its weights are the reference's values bitwise (checked too), so the only
error is the fp32 sum of k products in another order, bounded by k * 2^-24 * sum_i |x_i w_i| (the classical bound
for recursive summation, which holds for any order; the kernel sums in lanes, so it is usually far below).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from tests.unit.models.kernel_builds import cpu_flags
from tokenfleet.models import kernel_check, native, quant_linear
from tokenfleet.models.ggml_quant import TYPES, QuantTensor, dequantize, random_quant
from tokenfleet.models.kernel_check import checked_quant_linear
from tokenfleet.models.quant_linear import INT8_KINDS, NativeQuantMatmul, QuantLinear, native_quant_matmul

BUILDS = {"native": (), "avx2": ("TF_NO_AVX512",), "portable": ("TF_PORTABLE_ONLY",)}
ROWS = (1, 2, 3, 4, 7, 32, 100)  # 1-4: the AVX-512 fused tiles; more: the buffer path


def build(name: str) -> NativeQuantMatmul:
    """The kernel of build ``name``, or a skip saying why this machine cannot run it."""
    if native.compiler() is None:
        pytest.skip("no C compiler: only the torch reference runs here")
    if name == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU lacks AVX2 or FMA")
    kernel = native_quant_matmul(BUILDS[name])
    assert kernel is not None, f"a compiler is present but the {name} build failed (see the log)"
    flags = cpu_flags()
    expected = {"native": "AVX-512" if "avx512f" in flags else "AVX2+FMA" if {"avx2", "fma"} <= flags else "portable C",
                "avx2": "AVX2+FMA", "portable": "portable C"}[name]
    assert kernel.build == expected
    return kernel


def within_bound(got: torch.Tensor, x: torch.Tensor, values: torch.Tensor) -> tuple[bool, float]:
    """Whether fp32 ``got`` is within the fp32 summation bound of x @ values^T (float64), and the worst ratio."""
    x64, w64 = x.double(), values.double()
    want = F.linear(x64, w64)
    bound = x.shape[1] * 2.0**-24 * F.linear(x64.abs(), w64.abs()) + 1e-30
    ratio = float(((got.double() - want).abs() / bound).max())
    return ratio <= 1.0, ratio


@pytest.mark.parametrize("name", sorted(BUILDS))
@pytest.mark.parametrize("kind", sorted(TYPES))
def test_native_matches_the_reference_on_random_shapes(name: str, kind: str) -> None:
    kernel = build(name)
    block = TYPES[kind].block_elems
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {kind}".encode()))
    for rows in ROWS:
        k = block * int(torch.randint(1, 2304 // block + 1, (), generator=g))
        n = int(torch.randint(1, 300, (), generator=g))
        w = random_quant(kind, n, k, g)
        values = dequantize(w)
        x = torch.randn(rows, k, generator=g)
        got = kernel(x, w)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        ok, ratio = within_bound(got, x, values)
        assert ok, f"{name} {kind}: x [{rows}, {k}], w [{n}, {k}]: {ratio:.3g}x the bound"


def int8_bound(x: torch.Tensor, w: QuantTensor, values: torch.Tensor) -> torch.Tensor:
    """How far the int8-activation path's outputs may be from the float64 reference: each x_i moves by up to half
    its block's step (dx = max |x| / 127 over 32 values; a little more for the fp32 rounding of x / dx), times |w_i|;
    plus the fp32 sums' bound over the terms the kernel adds (d q x and Q4_1's m times the block sum of x)."""
    dx = x.abs().reshape(x.shape[0], -1, 32).amax(-1) / 127
    moved = (0.5 * 1.001 * dx).repeat_interleave(32, dim=1) + 2.0**-22 * x.abs()  # [m, k]
    m = torch.zeros_like(values)
    if w.kind == "Q4_1":
        m = dequantize(QuantTensor(w.kind, w.rows, w.cols, w.data.clone().reshape(-1, 20).index_fill_(
            1, torch.arange(4, 20), 0).reshape(w.rows, -1)))  # q = 0: the m of each block
    a, wa = x.double().abs() + moved.double(), values.double().abs() + 2 * m.double().abs()
    return F.linear(moved.double(), values.double().abs()) + x.shape[1] * 2.0**-24 * F.linear(a, wa)


@pytest.mark.parametrize("name", sorted(BUILDS))
@pytest.mark.parametrize("kind", INT8_KINDS)
def test_native_int8_activations_within_the_activation_rounding_bound(name: str, kind: str) -> None:
    kernel = build(name)
    g = torch.Generator().manual_seed(zlib.crc32(f"int8 {name} {kind}".encode()))
    for rows in ROWS:
        k = 32 * int(torch.randint(1, 72, (), generator=g))
        n = int(torch.randint(1, 300, (), generator=g))
        w = random_quant(kind, n, k, g)
        values = dequantize(w)
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
        x[0, :32] = 0  # a block of zeros: scale 0
        got = kernel(x, w, int8=True)
        error = (got.double() - F.linear(x.double(), values.double())).abs()
        ratio = float((error / int8_bound(x, w, values)).max())
        assert ratio <= 1.0, f"{name} {kind}: x [{rows}, {k}], w [{n}, {k}]: {ratio:.3g}x the bound"
        assert ratio > 1e-3  # the activations are rounded: not the fp32 path


def test_int8_path_serves_only_its_types() -> None:
    kernel = build("native")
    with pytest.raises(ValueError, match="failed"):
        kernel(torch.zeros(1, 256), random_quant("Q6_K", 4, 256), int8=True)
    linear = QuantLinear(kernel, int8_activations=True)
    w = random_quant("Q6_K", 8, 256)
    x = torch.randn(3, 256)
    assert torch.equal(linear(x, w), kernel(x, w))  # Q6_K: the fp32 path
    w1 = random_quant("Q4_1", 8, 256)
    assert torch.equal(linear(x[:1], w1), kernel(x[:1], w1, int8=True))
    x5 = torch.randn(quant_linear.INT8_ROWS + 1, 256)
    assert torch.equal(linear(x5, w1), kernel(x5, w1))  # more rows: the fp32 path
    assert "int8" in linear.name and linear.check_tolerance(torch.float32) == quant_linear.INT8_TOLERANCE


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_native_dequantize_is_the_reference_bitwise(name: str) -> None:
    kernel = build(name)
    g = torch.Generator().manual_seed(2)
    for kind, t in sorted(TYPES.items()):
        w = random_quant(kind, 37, t.block_elems * 3, g)
        w.data[:, :] = torch.randint(0, 256, w.data.shape, dtype=torch.uint8, generator=g)  # any fp16: inf, nan, subnormal
        torch.testing.assert_close(kernel.dequantize(w), dequantize(w), rtol=0, atol=0, equal_nan=True, msg=kind)


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_native_bf16_path_matches_the_bf16_weights_reference(kind: str) -> None:
    """The AVX-512 BF16 path: x bf16 times the weight rounded to bf16 (dequantize(w, bf16)), within the fp32 bound."""
    kernel = build("native")
    if not kernel.has_bf16:
        pytest.skip("this build has no AVX-512 BF16 path (the fp32 kernel serves bf16 x)")
    block = TYPES[kind].block_elems
    g = torch.Generator().manual_seed(zlib.crc32(f"bf16 {kind}".encode()))
    for rows in ROWS:
        k = block * int(torch.randint(1, 2304 // block + 1, (), generator=g))
        n = int(torch.randint(1, 300, (), generator=g))
        w = random_quant(kind, n, k, g)
        x = torch.randn(rows, k, generator=g).bfloat16()
        got = kernel.matmul_bf16(x, w)
        ok, ratio = within_bound(got, x, dequantize(w, torch.bfloat16))
        assert ok, f"{kind}: x [{rows}, {k}], w [{n}, {k}]: {ratio:.3g}x the bound"


def test_native_rejects_what_it_cannot_compute() -> None:
    kernel = build("native")
    w = random_quant("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="failed"):
        kernel(torch.zeros(0, 64), w)


def test_quant_linear_keeps_x_dtype_and_shape_on_both_paths(monkeypatch) -> None:
    g = torch.Generator().manual_seed(4)
    w = random_quant("Q4_1", 200, 256, g)
    reference, fast = QuantLinear(), QuantLinear(native_quant_matmul())
    assert reference.name == "dequantize + F.linear"
    monkeypatch.setattr(quant_linear, "CHUNK_VALUES", 256 * 48)  # the prefill path in chunks of 48 rows
    for rows in (1, 5, 33, 70):
        x = torch.randn(rows, 256, generator=g)
        want = F.linear(x.double(), dequantize(w, torch.float64))
        for linear in (reference, fast):
            got = linear(x.reshape(1, rows, 256), linear.prepare(w))
            assert got.shape == (1, rows, 200) and got.dtype == torch.float32
            assert torch.allclose(got[0].double(), want, rtol=1e-4, atol=1e-5), (linear.name, rows)
            got16 = linear(x.bfloat16(), w)
            assert got16.dtype == torch.bfloat16
            assert torch.allclose(got16.double(), F.linear(x.bfloat16().double(), dequantize(w, torch.float64)),
                                  rtol=2**-7, atol=2**-6), (linear.name, rows)


def test_portable_build_leaves_every_step_to_dequantize_and_torch() -> None:
    kernel = build("portable")
    linear = QuantLinear(kernel)
    assert linear.rows_native(torch.float32) == 0 == linear.rows_native(torch.bfloat16)
    w = random_quant("Q4_K", 12, 512)
    x = torch.randn(1, 512)
    assert torch.equal(linear(x, w), F.linear(x, dequantize(w)))  # its dequantize is the reference's, bitwise


def test_torch_kernels_setting_selects_the_reference(monkeypatch) -> None:
    monkeypatch.setenv("TOKENFLEET_KERNELS", "torch")
    assert quant_linear.select_quant_linear().native is None


SHAPES = [("Q4_1", 960, 576), ("Q8_0", 49152, 576), ("Q6_K", 640, 512)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_check_passes_the_native_kernel(dtype: torch.dtype) -> None:
    build("native")
    linear, checks = checked_quant_linear(QuantLinear(native_quant_matmul()), SHAPES, dtype)
    assert [c.passed for c in checks] == [True] and linear.native is not None
    assert checks[0].serving.startswith("native quantized matmul")


def test_load_check_passes_the_int8_path() -> None:
    build("native")
    linear, checks = checked_quant_linear(QuantLinear(native_quant_matmul(), int8_activations=True), SHAPES,
                                          torch.bfloat16)
    assert [c.passed for c in checks] == [True] and linear.int8_activations, checks


class OneRowOff(NativeQuantMatmul):
    def __init__(self, inner: NativeQuantMatmul):
        self.__dict__.update(inner.__dict__)

    def __call__(self, x: torch.Tensor, weight, int8: bool = False):
        out = super().__call__(x, weight, int8)
        out[:, -1] += 0.05
        return out


def test_load_check_replaces_a_wrong_kernel_with_the_reference() -> None:
    linear, checks = checked_quant_linear(QuantLinear(OneRowOff(build("native"))), SHAPES, torch.float32)
    assert linear.native is None and linear.name == "dequantize + F.linear"
    assert len(checks) == 1 and not checks[0].passed and checks[0].serving == "torch reference"
    assert "rows" in checks[0].detail


def test_load_check_has_nothing_to_check_on_the_reference() -> None:
    linear = QuantLinear()
    assert checked_quant_linear(linear, SHAPES, torch.float32) == (linear, ())
    assert kernel_check.TOLERANCES[torch.float32] == (1e-4, 1e-5)
