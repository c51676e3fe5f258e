"""The CUDA-graph decode path's bookkeeping: static buffers, buckets, padding rows, the scratch block.

Without CUDA, ``DecodeGraphs.run`` fills the same buffers and runs the captured forward eagerly, so the
inputs a graph would replay are checked here against the regular step path (same engine, same tokens,
fp32); tests/gpu/test_graphs_device.py checks real captures and replays on a GPU."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.backends.torch.cuda_graphs import DecodeGraphs, buckets
from tokenfleet.backends.torch.runner import TorchModelRunner
from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.core import CoreParts, EngineCore
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.runner import ModelInfo
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
from tokenfleet.models import triton_attention
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.llama import KVCache
from tokenfleet.models.loader import random_model

pytestmark = [pytest.mark.skipif(not triton_attention.available(), reason="graphs need the Triton attention kernel"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="CPU bookkeeping check; tests/gpu replays real graphs")]

CONFIG = ModelConfig.from_dict(dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def test_buckets_cover_every_batch_size():
    sizes = buckets(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6]
    for n in range(1, 257):
        assert any(b >= n for b in sizes)


def test_graphs_are_supported_for_a_llama_with_triton_attention_on_cuda(monkeypatch):
    """The gate itself (the device is only an attribute here: nothing runs)."""
    from tokenfleet.backends.torch.cuda_graphs import graphs_supported
    from tokenfleet.models.attention import TorchPagedAttention

    monkeypatch.setenv("TOKENFLEET_KERNELS", "triton")
    model = random_model(CONFIG, torch.float32, torch.device("cpu"))
    assert not graphs_supported(model)  # CPU
    model.device = torch.device("cuda")
    assert graphs_supported(model)
    monkeypatch.setenv("TOKENFLEET_CUDA_GRAPHS", "0")
    assert not graphs_supported(model)
    monkeypatch.setenv("TOKENFLEET_CUDA_GRAPHS", "1")
    model.attention = TorchPagedAttention()  # loop bounds from Python: no graphs
    assert not graphs_supported(model)


def engine(graphs: bool, dtype: torch.dtype, monkeypatch, overlap: bool = False) -> tuple[EngineCore, TorchModelRunner]:
    monkeypatch.setenv("TOKENFLEET_KERNELS", "triton")
    model = random_model(CONFIG, dtype, torch.device("cpu"), seed=3)
    num_blocks = 48
    runner = TorchModelRunner(model, num_blocks, 4)
    if graphs:
        runner.kv = KVCache(CONFIG, num_blocks + 1, 4, dtype, model.device)  # the scratch block, as on CUDA
        runner.graphs = DecodeGraphs(model, runner.kv, 4, num_blocks, max_batch=8, max_model_len=128)
        runner.graphs.captured = True
    core = EngineCore(Scheduler(SchedulerConfig(max_model_len=128, max_num_batched_tokens=64), BlockManager(num_blocks, 4),
                                hash_salt="g"), runner, None, ModelInfo(vocab_size=CONFIG.vocab_size, max_model_len=128,
                                                                        eos_token_ids=()),
                      CoreParts(overlap=runner if overlap else None, adapters=runner))
    return core, runner


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(RequestSpec(prompt, p, request_id=f"r{i}"))
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


# 5 requests (bucket 8: three padding rows), then fewer as they finish (buckets 4, 2, 1); prompts cross block
# boundaries; one sampled request with a seed, one reporting logprobs
PROMPTS = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([3, 9, 17, 4, 30])]
PARAMS = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (6, 10, 14, 18, 22)]
PARAMS[1] = SamplingParams(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True)
PARAMS[3] = SamplingParams(max_tokens=18, temperature=0.0, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def graphed() -> tuple[dict[str, list[int]], int]:
    """The graph path's tokens for PROMPTS / PARAMS (fp32), and how many steps replayed."""
    with pytest.MonkeyPatch.context() as mp:
        core, runner = engine(True, torch.float32, mp)
        out = run(core, PROMPTS, PARAMS)
        core.scheduler.block_manager.check_invariants()
        assert runner.graphs is not None
        return out, runner.graphs.replays


def test_static_buffer_steps_equal_the_regular_path(monkeypatch, graphed):
    """fp32 (bf16: tests/gpu; Triton's interpreter computes bf16 dots in fp32 anyway)."""
    plain = run(engine(False, torch.float32, monkeypatch)[0], PROMPTS, PARAMS)
    tokens, replays = graphed
    assert tokens == plain
    assert [len(tokens[f"r{i}"]) for i in range(5)] == [6, 10, 14, 18, 22]
    assert replays >= 18  # every decode-only step took the graph path


@pytest.mark.nightly  # test_static_buffer_steps_equal_the_regular_path keeps a replay in the suite
def test_overlapped_steps_carry_tokens_through_the_static_buffers(monkeypatch, graphed):
    """Overlapped scheduling on the graph path: a queued step's input tokens are gathered from the running step's
    samples on the device (the sixth buffer column); the tokens equal the synchronous graph path's."""
    prompts, params = PROMPTS, list(PARAMS)
    probe = graphed[0]
    # request 3 stops on a token found late (the queued step already holds its next row)
    stop = next(t for i, t in enumerate(probe["r3"]) if i >= 4 and t not in probe["r3"][:i])
    params[3] = SamplingParams(max_tokens=18, temperature=0.0, stop_token_ids=[stop])
    plain = run(engine(True, torch.float32, monkeypatch)[0], prompts, params)
    core, runner = engine(True, torch.float32, monkeypatch, overlap=True)
    assert run(core, prompts, params) == plain
    assert plain["r3"][-1] == stop and len(plain["r3"]) < 18
    assert runner.graphs is not None and runner.graphs.replays >= 15
    assert core.stats.num_overlapped_steps >= 12 and core.stats.num_overlap_discarded_rows >= 1
    core.scheduler.block_manager.check_invariants()


def test_graph_path_declines_what_it_cannot_replay(monkeypatch):
    core, runner = engine(True, torch.float32, monkeypatch)
    assert runner.graphs is not None
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    out = run(core, [[5, 6, 7, 8, 9]], [p])
    assert len(out["r0"]) == 3 and runner.graphs.replays == 0  # prompt logprobs: eager steps
    big = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)] * 9  # over max_batch=8
    out = run(core, [[i + 1, i + 2] for i in range(9)], big)
    assert all(len(t) == 2 for t in out.values()) and runner.graphs.replays == 0


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from tests.unit.models.test_gemma3_window import save_tiny_gemma3

    path = tmp_path_factory.mktemp("gemma3-graphs")
    save_tiny_gemma3(path)
    return path


def gemma3_engine(model_dir, graphs: bool, monkeypatch) -> tuple[EngineCore, TorchModelRunner]:
    from tests.unit.models.test_gemma3_window import BLOCK
    from tokenfleet.models.loader import load_model

    monkeypatch.setenv("TOKENFLEET_KERNELS", "triton")
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    windows = tuple(g.window for g in model.config.kv_groups)
    num_blocks = 96
    runner = TorchModelRunner(model, num_blocks, BLOCK)
    if graphs:
        runner.kv = KVCache(model.config, num_blocks + 1, BLOCK, torch.float32, model.device)
        runner.graphs = DecodeGraphs(model, runner.kv, BLOCK, num_blocks, max_batch=4, max_model_len=128)
        runner.graphs.captured = True
    scheduler = Scheduler(SchedulerConfig(max_model_len=128, max_num_batched_tokens=64),
                          BlockManager(num_blocks, BLOCK, windows), hash_salt="g3")
    return EngineCore(scheduler, runner, None, ModelInfo(vocab_size=model.config.vocab_size, max_model_len=128,
                                                         eos_token_ids=())), runner


@pytest.mark.nightly  # test_static_buffer_steps_equal_the_regular_path keeps a replay in the suite
def test_a_model_of_several_kv_groups_replays_with_a_table_per_group(monkeypatch, tiny_gemma3):
    """Gemma 3 (sliding-window layers in their own KV groups, a window of 10 keys over blocks of 4): the static
    buffers hold a slot column and a block table per group, each attended with its group's window; prompts past
    the window (the sliding groups' tables then start with null blocks) decode the regular path's tokens."""
    from tokenfleet.backends.torch.cuda_graphs import graphs_supported
    from tokenfleet.engine.block_manager import NULL_BLOCK

    prompts = [list(range(20, 20 + n)) for n in (23, 5, 14)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 12, 7)]
    params[1] = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    plain = run(gemma3_engine(tiny_gemma3, False, monkeypatch)[0], prompts, params)
    core, runner = gemma3_engine(tiny_gemma3, True, monkeypatch)
    assert runner.graphs is not None and len(runner.graphs.windows) == 3 and any(runner.graphs.windows)
    graphs, nulls = runner.graphs, []
    replay = graphs.run

    def watched(scheduled, requests, source=None):  # each group's table as a replay reads it: the entry's own
        logits = replay(scheduled, requests, source)
        for i, entry in enumerate(scheduled):
            used = -(-(entry.start + 1) // 4)
            for g, blocks in enumerate((entry.block_ids, *entry.other_block_ids)):
                assert graphs.group_tables[g][i, :used].tolist() == list(blocks[:used])
                assert graphs.group_slots[g][i] == blocks[entry.start // 4] * 4 + entry.start % 4
            nulls.append(sum(b == NULL_BLOCK for b in entry.other_block_ids[0][:used]))
        bucket = next(size for size in graphs.buckets if size >= len(scheduled))
        for g in range(3):  # padding rows write every group's K/V to the scratch block, and read only it
            assert (graphs.group_slots[g][len(scheduled):bucket] == graphs.scratch_block * 4).all()
            assert (graphs.group_tables[g][len(scheduled):bucket, 0] == graphs.scratch_block).all()
        return logits

    graphs.run = watched  # type: ignore[method-assign]
    assert run(core, prompts, params) == plain
    assert [len(plain[f"r{i}"]) for i in range(3)] == [9, 12, 7]
    assert graphs.replays >= 8 and max(nulls) > 0  # sliding tables past their window were replayed
    core.scheduler.block_manager.check_invariants()
    model = runner.model
    model.device = torch.device("cuda")  # the gate only (nothing runs): Gemma 3 with Triton attention replays
    assert graphs_supported(model)


def test_a_capture_that_fails_leaves_the_runner_serving_eagerly(monkeypatch):
    from structlog.testing import capture_logs

    core, runner = engine(True, torch.float32, monkeypatch)
    assert runner.graphs is not None

    def broken() -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    runner.graphs.capture = broken  # type: ignore[method-assign]
    with capture_logs() as logs:
        runner.capture_graphs()
    assert runner.graphs is None
    assert [e["event"] for e in logs] == ["cuda_graph_capture_failed"] and "capturing" in logs[0]["error"]
    out = run(core, PROMPTS[:2], PARAMS[:2])
    assert [len(out["r0"]), len(out["r1"])] == [6, 10]


@pytest.mark.nightly  # test_static_buffer_steps_equal_the_regular_path keeps a replay in the suite
def test_tables_past_their_byte_bound_are_narrower_and_longer_contexts_run_eagerly(monkeypatch, graphed):
    from tokenfleet.backends.torch import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "TABLE_BYTES", 8 * 1 * 10 * 8)  # max_batch 8, one group: 10 blocks of 4 keys
    core, runner = engine(True, torch.float32, monkeypatch)
    assert runner.graphs is not None and runner.graphs.max_blocks == 10 and runner.graphs.table.shape == (8, 10)
    assert run(core, PROMPTS, PARAMS) == graphed[0]  # the full tables' tokens, which are the regular path's
    assert 0 < runner.graphs.replays < 18  # from r4's 40th key (30 prompt tokens, 22 new) its steps ran eagerly


def write_adapter(folder, seed: int, rank: int = 4, config: ModelConfig = CONFIG, scale: float = 0.3) -> str:
    """A PEFT LoRA folder for ``config``: every linear layer of every layer adapted, weights large enough to matter
    (tests/gpu uses it too)."""
    import json

    from safetensors.torch import save_file

    from tokenfleet.models.lora import _sizes

    outputs, inputs = _sizes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for sub in outputs:
            key = f"base_model.model.model.layers.{layer}.{sub}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inputs[sub], generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(outputs[sub], rank, generator=g) * scale
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    return str(folder)


def lora_engine(graphs: bool, monkeypatch) -> tuple[EngineCore, TorchModelRunner]:
    from tokenfleet.models.lora import FUSED

    core, runner = engine(graphs, torch.float32, monkeypatch)
    model = runner.model
    model.source_dir = "random"  # LoRA stacks adapters under the checkpoint's weights: here, the model's own
    monkeypatch.setattr("tokenfleet.backends.torch.runner.fused_base_weights", lambda folder, config: [
        {f: getattr(layer, f) for f in FUSED} for layer in model.weights.layers])
    return core, runner


def run_adapters(core: EngineCore, jobs: list[tuple[str, list[int], str, int]]) -> dict[str, list[int]]:
    for rid, prompt, adapter, max_tokens in jobs:
        core.add_request(RequestSpec(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                     request_id=rid, adapter=adapter))
    out: dict[str, list[int]] = {rid: [] for rid, *_ in jobs}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


@pytest.mark.nightly  # test_static_buffer_steps_equal_the_regular_path keeps a replay in the suite
def test_lora_steps_replay_graphs_captured_over_the_loaded_adapters(monkeypatch, tmp_path):
    """Steps with adapter rows (mixed with base rows) replay the LoRA graphs, which build each row's adapter mask on
    the device from its uploaded column ranges; loading another adapter rebuilds the stacked matrices and captures
    again. The tokens equal the regular (eager) LoRA path's, fp32; an adapter set changed behind the graphs' back
    is declined (eager) rather than replayed stale."""
    folders = {name: write_adapter(tmp_path / name, seed) for seed, name in enumerate(("a", "b", "c"))}
    first = [("x0", [3, 4, 5, 6, 7], "a", 9), ("x1", [3, 4, 5, 6, 7], "", 9), ("x2", list(range(30, 47)), "a", 12)]
    second = [("y0", [3, 4, 5, 6, 7], "b", 9), ("y1", list(range(8, 15)), "a", 11), ("y2", [9, 9, 9], "", 16),
              ("y3", list(range(60, 70)), "b", 6)]
    third = [("z0", [3, 4, 5, 6, 7], "c", 6), ("z1", [3, 4, 5, 6, 7], "a", 6)]

    def session(graphs: bool) -> tuple[list[dict[str, list[int]]], TorchModelRunner]:
        core, runner = lora_engine(graphs, monkeypatch)
        runner.load_adapter("a", folders["a"])
        outs = [run_adapters(core, first)]
        runner.load_adapter("b", folders["b"])
        outs.append(run_adapters(core, second))
        if graphs:
            assert runner.graphs is not None and runner.adapters is not None
            assert runner.graphs.lora_version == runner.adapters.version  # captured over a and b
            replays = runner.graphs.lora_replays
        from tokenfleet.models.lora import load_peft_adapter

        assert runner.adapters is not None  # an adapter added without the runner: the graphs are stale
        runner.adapters.add(load_peft_adapter("c", folders["c"], CONFIG, torch.float32, torch.device("cpu")))
        outs.append(run_adapters(core, third))
        if graphs:
            assert runner.graphs is not None and runner.graphs.lora_replays == replays
        core.scheduler.block_manager.check_invariants()
        return outs, runner

    eager, _ = session(False)
    graphed, runner = session(True)
    assert graphed == eager
    assert runner.graphs is not None and runner.graphs.lora_replays >= 15 and runner.graphs.replays > runner.graphs.lora_replays
    assert eager[0]["x0"] != eager[0]["x1"] and eager[1]["y0"] != eager[0]["x0"]  # the adapters change the output


def test_adapters_loaded_before_the_graphs_are_captured_get_lora_graphs_with_them(monkeypatch, tmp_path):
    """A worker's configured adapters load before ``capture_graphs`` (backends.torch.builder): capturing the plain
    graphs then captures the LoRA ones too, and adapter steps replay from the start."""
    core, runner = lora_engine(True, monkeypatch)
    graphs = runner.graphs
    assert graphs is not None
    graphs.captured = False
    runner.load_adapter("a", write_adapter(tmp_path / "a", 0))
    assert graphs.lora is None  # nothing to capture over yet

    def capture() -> None:  # on CPU, what DecodeGraphs.capture() leaves behind (the forward runs eagerly)
        graphs.captured = True

    monkeypatch.setattr(graphs, "capture", capture)
    runner.capture_graphs()
    assert runner.adapters is not None and graphs.lora_version == runner.adapters.version
    out = run_adapters(core, [("x0", [3, 4, 5, 6, 7], "a", 6), ("x1", [3, 4, 5, 6, 7], "", 6)])
    assert graphs.lora_replays >= 5 and out["x0"] != out["x1"]


def test_bf16_steps_with_the_triton_logits_kernels_generate_what_torch_s_top_k_does(monkeypatch):
    """A bf16 model's greedy rows (and the logprobs row) get their top logits refined: through the static buffers'
    flags (graph path) or the runner's row list (eager steps with prefill chunks), by models.triton_logits (CUDA;
    here forced on, in the interpreter), and the greedy picks by its argmax. Same tokens as torch's versions."""
    from tokenfleet.models import triton_logits

    prompts = PROMPTS[2:4]
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)]
    reference = run(engine(True, torch.bfloat16, monkeypatch)[0], prompts, params)
    calls = {"refine_rows": 0, "refine_flags": 0, "argmax": 0}
    refine, argmax = triton_logits.refine_top_logits_, triton_logits.argmax_rows

    def counted_refine(*args, rows=None, flags=None, **kwargs):
        calls["refine_flags" if flags is not None else "refine_rows"] += 1
        return refine(*args, rows=rows, flags=flags, **kwargs)

    def counted_argmax(logits):
        calls["argmax"] += 1
        return argmax(logits)

    monkeypatch.setattr(triton_logits, "serves", lambda *tensors: True)
    monkeypatch.setattr(triton_logits, "refine_top_logits_", counted_refine)
    monkeypatch.setattr(triton_logits, "argmax_rows", counted_argmax)
    assert run(engine(True, torch.bfloat16, monkeypatch)[0], prompts, params) == reference
    assert calls["refine_flags"] >= 4 and calls["refine_rows"] >= 1 and calls["argmax"] >= 6


def test_buckets_whose_warm_up_runs_out_of_memory_are_dropped_and_the_smaller_ones_kept():
    """A worker whose weights and cache leave too little memory for its largest bucket keeps graphs for the batch
    sizes that fit (each warmed twice, largest first) instead of losing them all."""
    from tokenfleet.backends.torch.cuda_graphs import warm_up

    ran: list[int] = []

    def forward(size: int) -> None:
        ran.append(size)
        if size > 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert warm_up([1, 2, 4, 8, 16, 24], forward) == [1, 2, 4, 8]
    assert ran == [24, 16, 8, 8, 4, 4, 2, 2, 1, 1]
    with pytest.raises(torch.cuda.OutOfMemoryError, match="no CUDA-graph bucket"):
        warm_up([16, 24], forward)

    def odd(size: int) -> None:  # a small size failing after a larger one fit: not a matter of size
        if size == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        warm_up([1, 2, 4], odd)

    def cublas(size: int) -> None:  # cuBLAS's workspace allocation failing: a RuntimeError
        if size > 2:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    assert warm_up([1, 2, 4], cublas) == [1, 2]

    def broken(size: int) -> None:  # any other error is not about size
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory"):
        warm_up([1, 2, 4], broken)


@pytest.mark.nightly  # test_static_buffer_steps_equal_the_regular_path keeps a replay in the suite
def test_batches_over_the_largest_bucket_kept_run_eagerly(monkeypatch, graphed):
    """After a warm-up kept buckets 1, 2 and 4 of 8: the 5-request steps run eagerly, the rest replay."""
    core, runner = engine(True, torch.float32, monkeypatch)
    assert runner.graphs is not None
    runner.graphs.buckets = [1, 2, 4]
    tokens = run(core, PROMPTS, PARAMS)
    assert tokens == graphed[0]
    assert 0 < runner.graphs.replays < graphed[1]


def test_adapter_rows_replay_only_buckets_whose_lora_graphs_exist(monkeypatch):
    """The adapters' graphs are captured later, with less memory free, and may keep fewer buckets than the plain
    ones: a step with adapter rows at a bucket without one runs eagerly; plain rows there still replay."""
    from types import SimpleNamespace

    from tokenfleet.engine.scheduler import ScheduledRequest

    _, runner = engine(True, torch.float32, monkeypatch)
    graphs = runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8]
    graphs.lora, graphs.lora_version = SimpleNamespace(version=3), 3
    graphs._uploaded = object()  # as on CUDA: the adapters' graphs are real ones
    graphs._lora_graphs = {1: None, 2: None}  # buckets 4 and 8 did not fit
    requests = {f"r{i}": SimpleNamespace(adapter="a" if i == 0 else "", sampling_params=SamplingParams(max_tokens=4))
                for i in range(3)}
    entries = [ScheduledRequest(f"r{i}", start=5, num_new_tokens=1, block_ids=(1, 2), samples=True) for i in range(3)]
    assert graphs.supports(entries[:2], requests)  # bucket 2: captured for adapters
    assert not graphs.supports(entries, requests)  # bucket 4 with an adapter row: eager
    assert graphs.supports(entries[1:] + [ScheduledRequest("r3", 5, 1, (1, 2), True)],
                           {**requests, "r3": requests["r1"]})  # bucket 4 without adapter rows: the plain graph
