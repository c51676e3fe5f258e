"""Property-based tests of every compiled kernel against its torch reference (hypothesis).

Paged attention, each build of csrc/paged_attention.c (kernel_builds.py: the AVX-512 branch on real instructions
where the CPU has them, the same branch emulated through SIMDe anywhere, the portable C), over random geometry
(GQA groups 1/3/4/8, head_dim 64/128/256, block sizes 8/16/32, bf16 or FP8 KV, with and without a sliding window)
and random steps: up to four requests, each a decode row, speculative rows, a chunk after cached context or a fresh
prefill, context lengths that are and are not multiples of 16 and of the block size, shuffled block tables whose
requests may share leading blocks (prefix hits). Every example also asserts which code path ran each work item (the
kernel counts them), so a test of the AVX-512 branch cannot quietly run the portable one.
Tolerance (as the load-time check's, models.kernel_check): |kernel - fp32 reference| <= 2^-8 + 2^-7 |reference|,
against the reference computed in fp32 on the same stored (bf16 or FP8) caches.

fp32 (the CPU's default dtype): the same attention steps through the portable code with fp32 queries and caches
(tolerance |kernel - reference| <= 1e-5 + 1e-4 |reference|), the fused layer ops in fp32, and the few-row matmul
(csrc/skinny_linear.c, each build) against F.linear in float64 over random shapes and row counts.

Also: the fused layer ops (csrc/fused_ops.c: bitwise equal to the torch ops, which they mirror), the temperature
sampler (csrc/sampling.c: the torch inverse-CDF draw's token), and the Triton attention kernel in Triton's
interpreter (or on a GPU).

Profiles (tests/conftest.py): the default suite runs ``kernels`` (fixed seed, a few dozen examples per test);
``TOKENFLEET_KERNEL_PROFILE=kernels-long`` runs a thousand random ones per test.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.models.kernel_builds import BUILDS, PACK_MIN_VECTORS, attention_build, expected_paths
from tokenfleet.models import kv_fp8
from tokenfleet.models.attention import PagedQueries, TorchPagedAttention
from tokenfleet.models.kernel_check import TOLERANCES

PROFILE = settings.get_profile(os.environ.get("TOKENFLEET_KERNEL_PROFILE", "kernels"))  # tests/conftest.py


def lengths() -> st.SearchStrategy[int]:
    edges = st.sampled_from([1, 15, 16, 17, 31, 32, 33, 37, 47, 48, 63, 64, 65, 96, 97])
    return st.one_of(edges, st.integers(1, 160))


@st.composite
def steps(draw: st.DrawFn) -> dict:
    requests = []
    for _ in range(draw(st.integers(1, 4))):
        context = draw(lengths())
        kind = draw(st.sampled_from(["decode", "spec", "chunk", "fresh"]))
        rows = {"decode": 1, "spec": min(context, draw(st.integers(2, 8))), "fresh": context,
                "chunk": draw(st.integers(1, context))}[kind]
        requests.append((context, rows))
    return {
        "group": draw(st.sampled_from([1, 3, 4, 8])),
        "num_kv_heads": draw(st.sampled_from([1, 2, 3])),
        "head_dim": draw(st.sampled_from([64, 64, 128, 256])),
        "block_size": draw(st.sampled_from([16, 16, 32, 8])),
        "window": draw(st.sampled_from([0, 0, 0, 5, 37, 64])),
        "fp8": draw(st.booleans()),
        "requests": requests,
        "shared_blocks": draw(st.integers(0, 3)),  # leading blocks request 0 shares with the others (prefix hits)
        "q_scale": draw(st.sampled_from([0.3, 1.0, 4.0])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def make_step(s: dict, dtype: torch.dtype = torch.bfloat16
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PagedQueries]:
    """(q, k_cache, v_cache, its copies with the null block poisoned, meta). Block 0 is the null block: with a
    window, table entries for blocks no row of a request sees any more point there (as sliding-window tables do),
    and the poisoned copies hold NaN in it, so a kernel that read it would return NaN."""
    g = torch.Generator().manual_seed(s["seed"])
    bs, window = s["block_size"], s["window"]
    contexts = [c for c, _ in s["requests"]]
    rows = [n for _, n in s["requests"]]
    per_request = [-(-c // bs) for c in contexts]
    num_blocks = sum(per_request) + 1
    heads, kvh, hd = s["group"] * s["num_kv_heads"], s["num_kv_heads"], s["head_dim"]
    k = torch.randn(kvh, num_blocks, bs, hd, generator=g)
    v = torch.randn(kvh, num_blocks, bs, hd, generator=g)
    k[:, 0] = v[:, 0] = 0
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(contexts), max(per_request), dtype=torch.long)
    for r, n in enumerate(per_request):
        table[r, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    full0 = contexts[0] // bs
    for r in range(1, len(contexts)):
        shared = min(s["shared_blocks"], full0, contexts[r] // bs)
        table[r, :shared] = table[0, :shared]
    if window:
        for r, (c, n) in enumerate(s["requests"]):
            table[r, : max(0, c - n + 1 - window) // bs] = 0
    q = (torch.randn(sum(rows), heads, hd, generator=g) * s["q_scale"]).to(dtype)
    if s["fp8"]:
        k_cache, v_cache = kv_fp8.quantize(k), kv_fp8.quantize(v)
        nan_row = kv_fp8.quantize(torch.full((hd,), float("nan")))
    else:
        k_cache, v_cache = k.to(dtype), v.to(dtype)
        nan_row = torch.full((hd,), float("nan")).to(dtype)
    k_bad, v_bad = k_cache.clone(), v_cache.clone()
    k_bad[:, 0], v_bad[:, 0] = nan_row, nan_row
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    meta = PagedQueries(table, torch.tensor(contexts), starts, int(starts[-1]), max(rows), window)
    return q, k_cache, v_cache, k_bad, v_bad, meta


def assert_within_tolerance(got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype = torch.bfloat16
                            ) -> None:
    rtol, atol = TOLERANCES[dtype]
    excess = (got.float() - want).abs() - (atol + rtol * want.abs())
    worst = int(torch.nan_to_num(excess, nan=float("inf")).flatten().argmax())
    row, rest = divmod(worst, got[0].numel())
    assert float(torch.nan_to_num(excess, nan=float("inf")).max()) <= 0, (
        f"{what}: query row {row}, element {rest}: kernel {got.flatten()[worst].item():.6g}, "
        f"reference {want.flatten()[worst].item():.6g}")


@pytest.mark.parametrize("build", BUILDS)
@PROFILE
@given(step=steps())
def test_paged_attention_matches_the_torch_reference(build, step):
    kernel = attention_build(build, fp8=step["fp8"])
    q, k_cache, v_cache, k_bad, v_bad, meta = make_step(step)
    want = TorchPagedAttention()(q.float(), k_cache, v_cache, meta)
    before = kernel.path_counts()
    got = kernel(q, k_bad, v_bad, meta)
    ran = {path: n - before[path] for path, n in kernel.path_counts().items()}
    heads = step["group"] * step["num_kv_heads"]
    assert ran == expected_paths(kernel, [n for _, n in step["requests"]], heads, step["num_kv_heads"],
                                 step["head_dim"], step["block_size"], step["window"]), f"{build} build ran {ran}"
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert_within_tolerance(got, want, f"{build} build, {step}")


@pytest.mark.parametrize("build", ["native", "portable"])
@PROFILE
@given(step=steps())
def test_fp32_paged_attention_matches_the_torch_reference(build, step):
    """fp32 queries, caches and output (the CPU default): the portable code on every build, within fp32's tolerance."""
    kernel = attention_build(build, dtype=torch.float32)
    step = {**step, "fp8": False}
    q, k_cache, v_cache, k_bad, v_bad, meta = make_step(step, torch.float32)
    want = TorchPagedAttention()(q.double(), k_cache.double(), v_cache.double(), meta)
    before = kernel.path_counts()
    got = kernel(q, k_bad, v_bad, meta)
    ran = {path: n - before[path] for path, n in kernel.path_counts().items()}
    items = expected_paths(kernel, [n for _, n in step["requests"]], step["group"] * step["num_kv_heads"],
                           step["num_kv_heads"], step["head_dim"], step["block_size"], step["window"])
    assert ran == {**items, "portable": sum(items.values())}, f"{build} build ran {ran}"
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert_within_tolerance(got, want.float(), f"{build} build, fp32, {step}", torch.float32)


@pytest.mark.parametrize("build", ["avx512", "emulated-avx512"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-kv", "fp8-kv"])
def test_both_score_strategies_on_either_side_of_the_packing_threshold(build, group, fp8):
    """An item of fewer than 12 query vectors takes the lane-sum scores, one of 12 or more the packed tile: the
    largest row count below the threshold and the smallest at it, for each GQA group, in one call."""
    kernel = attention_build(build, fp8=fp8)
    below = (PACK_MIN_VECTORS - 1) // group
    at = -(-PACK_MIN_VECTORS // group)
    requests = [(c, n) for n in (below, at) if n > 0 for c in (n, 40 + n, 97)]
    step = {"group": group, "num_kv_heads": 2, "head_dim": 64, "block_size": 16, "window": 0, "fp8": fp8,
            "requests": requests, "shared_blocks": 1, "q_scale": 2.0, "seed": group}
    q, k_cache, v_cache, _, _, meta = make_step(step)
    want = TorchPagedAttention()(q.float(), k_cache, v_cache, meta)
    before = kernel.path_counts()
    got = kernel(q, k_cache, v_cache, meta)
    ran = {path: n - before[path] for path, n in kernel.path_counts().items()}
    assert ran["portable"] == 0 and ran["avx512-packed"] == 6
    assert ran["avx512-reduce"] == (6 if below else 0)
    assert_within_tolerance(got, want, f"{build}, group {group}")


@st.composite
def layer_geometries(draw: st.DrawFn) -> dict:
    head_dim = draw(st.sampled_from([64, 128, 256, 32]))
    kvh = draw(st.sampled_from([1, 2, 3]))
    return {"heads": kvh * draw(st.sampled_from([1, 3, 4])), "kv_heads": kvh, "head_dim": head_dim,
            "hidden": draw(st.sampled_from([576, 640, 2048, 8 * draw(st.integers(1, 128))])),
            "inter": 8 * draw(st.integers(1, 256)), "tokens": draw(st.integers(1, 70)),
            "fp8": draw(st.booleans()), "seed": draw(st.integers(0, 2**31 - 1))}


def layer_case(geo: dict, dtype: torch.dtype) -> dict:
    """The native and torch layer ops for ``geo`` in ``dtype``, and one step's inputs (drawn in the same order for
    every dtype): residual, delta, norm weight, gate_up, RoPE tables, qkv, the batch and four empty caches."""
    from tokenfleet.models import native
    from tokenfleet.models.attention import ForwardBatch
    from tokenfleet.models.config import ModelConfig
    from tokenfleet.models.layer_ops import NativeLayerOps, TorchLayerOps
    from tokenfleet.models.llama import rope_inv_freq

    lib = native.load("fused_ops")
    if lib is None:
        pytest.skip("no C compiler: the torch ops are what runs")
    config = ModelConfig.from_dict(dict(
        vocab_size=100, hidden_size=geo["hidden"], intermediate_size=geo["inter"], num_hidden_layers=1,
        num_attention_heads=geo["heads"], num_key_value_heads=geo["kv_heads"], head_dim=geo["head_dim"],
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=100000.0))
    g = torch.Generator().manual_seed(geo["seed"])
    n, hidden = geo["tokens"], geo["hidden"]
    case = {"ops": NativeLayerOps(config, lib, dtype), "ref": TorchLayerOps(config),
            "residual": (torch.randn(n, hidden, generator=g) * 3).to(dtype),
            "delta": torch.randn(n, hidden, generator=g).to(dtype),
            "weight": (torch.rand(hidden, generator=g) + 0.5).to(dtype),
            "gate_up": (torch.randn(n, 2 * geo["inter"], generator=g) * 4).to(dtype)}
    angles = torch.arange(4096).float()[:, None] * rope_inv_freq(config)[None, :]
    case["cos"], case["sin"] = (f(torch.cat((angles, angles), dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    case["qkv"] = torch.randn(n, (geo["heads"] + 2 * geo["kv_heads"]) * geo["head_dim"], generator=g).to(dtype)
    positions = torch.randint(0, 4096, (n,), generator=g)
    slots = torch.randperm(8 * 16, generator=g)[:n] if n <= 128 else torch.arange(n)
    case["batch"] = ForwardBatch(positions, slots, positions[:1])
    width = kv_fp8.row_width(geo["head_dim"]) if geo["fp8"] else geo["head_dim"]
    cache_dtype = torch.uint8 if geo["fp8"] else dtype
    case["caches"] = [torch.zeros(geo["kv_heads"], 8, 16, width, dtype=cache_dtype) for _ in range(4)]
    return case


def run_layer_ops(c: dict) -> dict:
    """Each op of the case, native and torch: {name: (native outputs, torch outputs)}; the caches are written."""
    out = {}
    for i, d in enumerate((c["delta"], None)):
        out[f"add_rms_norm {i}"] = (c["ops"].add_rms_norm(c["residual"].clone(), d, c["weight"], 1e-5),
                                    c["ref"].add_rms_norm(c["residual"].clone(), d, c["weight"], 1e-5))
    out["silu_mul"] = ((c["ops"].silu_mul(c["gate_up"]),), (c["ref"].silu_mul(c["gate_up"]),))
    caches = c["caches"]
    out["rope_store_kv"] = (c["ops"].rope_store_kv(c["qkv"], c["batch"], c["cos"], c["sin"], caches[0], caches[1]),
                            c["ref"].rope_store_kv(c["qkv"], c["batch"], c["cos"], c["sin"], caches[2], caches[3]))
    return out


@PROFILE
@given(geo=layer_geometries())
def test_fused_layer_ops_equal_the_torch_ops_bit_for_bit(geo):
    """csrc/fused_ops.c repeats the torch ops' rounding points (and torch's order for the RMS sums): every output
    and every cache row it writes equals theirs exactly."""
    c = layer_case(geo, torch.bfloat16)
    out = run_layer_ops(c)
    for name in ("add_rms_norm 0", "add_rms_norm 1"):
        got, want = out[name]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "add_rms_norm"
    assert torch.equal(*(x[0] for x in out["silu_mul"])), "silu_mul"
    got, want = out["rope_store_kv"]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "rope_store_kv outputs"
    caches = c["caches"]
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), "rope_store_kv cache rows"


@PROFILE
@given(geo=layer_geometries())
def test_fused_layer_ops_in_fp32_match_the_torch_ops(geo):
    """The *_f32 functions: the torch ops' steps with no rounding between them; within fp32's tolerance (the RMS
    statistics and RoPE repeat torch's operations; SiLU's exp is a vectorized polynomial of ~1 ulp)."""
    rtol, atol = TOLERANCES[torch.float32]

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(((a - b).abs() <= atol + rtol * b.abs()).all())

    c = layer_case(geo, torch.float32)
    out = run_layer_ops(c)
    for name in ("add_rms_norm 0", "add_rms_norm 1"):
        got, want = out[name]
        assert torch.equal(got[0], want[0]) and close(got[1], want[1]), "add_rms_norm"
    assert close(*(x[0] for x in out["silu_mul"])), "silu_mul"
    got, want = out["rope_store_kv"]
    assert all(close(a, b) for a, b in zip(got, want)), "rope_store_kv outputs"
    caches = c["caches"]
    if geo["fp8"]:
        caches = [kv_fp8.dequantize(x, torch.float32) for x in caches]
    assert close(caches[0], caches[2]) and close(caches[1], caches[3]), "rope_store_kv cache rows"


@pytest.mark.parametrize("build", ["native", "portable"])
@PROFILE
@given(rows=st.one_of(st.sampled_from([1, 2, 7, 8, 9, 16, 31, 32, 33]), st.integers(1, 40)),
       k=st.one_of(st.sampled_from([576, 1536, 64, 8, 3]), st.integers(1, 700)),
       n=st.one_of(st.sampled_from([1, 15, 16, 17, 960, 3072]), st.integers(1, 1100)), seed=st.integers(0, 2**31 - 1))
def test_few_row_matmul_matches_float64(build, rows, k, n, seed):
    """csrc/skinny_linear.c through the linear layer that serves fp32 on CPU: rows past its limit go to F.linear; k
    not a multiple of 8 exercises the scalar tail."""
    from tokenfleet.models import native
    from tokenfleet.models.linear import DenseLinear, NativeFewRows

    lib = native.load("skinny_linear", ("TF_PORTABLE_ONLY",) if build == "portable" else ())
    if lib is None:
        pytest.skip("no C compiler: F.linear is what runs")
    few = NativeFewRows(lib)
    assert few.build == ("portable C" if build == "portable" else few.build)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g, dtype=torch.float64) * k**-0.5
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    got = DenseLinear(few)(x.float(), weight.float().contiguous())
    rtol, atol = TOLERANCES[torch.float32]
    want = torch.nn.functional.linear(x, weight)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert float(((got.double() - want).abs() - (atol + rtol * want.abs())).max()) <= 0
    assert few.takes(x.float()) == (rows <= few.rows)


@PROFILE
@given(vocab=st.one_of(st.sampled_from([256, 257, 49152]), st.integers(2, 3000)), rows=st.integers(1, 9),
       scale=st.sampled_from([0.5, 3.0, 20.0]), masked=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_temperature_sampler_draws_the_torch_inverse_cdf_token(vocab, rows, scale, masked, seed):
    """Uniforms at the middle of a token's mass: the kernel must draw exactly that token."""
    from tokenfleet.backends.torch.sampler import NativeTemperatureSampler, filtered_probs_batch
    from tokenfleet.engine.sampling_params import SamplingParams

    draw = NativeTemperatureSampler.load()
    if draw is None:
        pytest.skip("no C compiler: the torch sampler is what runs")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    if masked:
        logits[:, 1::2] = float("-inf")
    params = [SamplingParams(max_tokens=1, temperature=(0.2, 0.7, 1.0, 1.9)[i % 4]) for i in range(rows)]
    probs = filtered_probs_batch(logits.clone(), params).double()
    cdf = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
    picks = torch.multinomial((probs >= probs.amax(-1, keepdim=True) / 2).float(), 1, generator=g).squeeze(1)
    below = torch.where(picks > 0, cdf.gather(1, (picks - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    uniforms = ((below + cdf.gather(1, picks[:, None]).squeeze(1)) / 2).float()
    assert draw(logits, params, uniforms).tolist() == picks.tolist()


TRITON_PROFILE = settings(PROFILE, max_examples=min(PROFILE.max_examples, 8))  # the interpreter is slow


@pytest.mark.skipif(not __import__("tokenfleet.models.triton_attention", fromlist=["available"]).available(),
                    reason="triton is not installed")
@TRITON_PROFILE
@given(step=steps())
def test_triton_paged_attention_matches_the_torch_reference(step):
    """In Triton's interpreter without a GPU (tests/conftest.py), on the GPU where there is one; bf16 caches (the
    interpreter has no e4m3 conversions)."""
    from tokenfleet.models import triton_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    step = {**step, "fp8": False, "requests": step["requests"][:2]}
    q, k_cache, v_cache, _, _, meta = make_step(step)
    meta = PagedQueries(*(t.to(device) for t in (meta.block_table, meta.context_lens, meta.query_start)),
                        meta.num_tokens, meta.max_query_len, meta.window)
    q, k_cache, v_cache = q.to(device), k_cache.to(device), v_cache.to(device)
    want = TorchPagedAttention()(q.float(), k_cache, v_cache, meta)
    got = triton_attention.TritonPagedAttention()(q, k_cache, v_cache, meta)
    assert_within_tolerance(got.cpu(), want.cpu(), f"triton, {step}")
