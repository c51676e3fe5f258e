"""Graphs of steps with prefill chunks (backends.torch.mixed_graphs): their static buffers' bookkeeping.

Without CUDA, ``MixedGraphs.run`` fills the same buffers and runs the graph's forward eagerly, so what a replay
would read is checked here against the regular step path (same engine, same tokens, fp32): every row of a mixed
step through one paged-attention call, padding tokens and requests, the table columns a step uploads."""

from __future__ import annotations

import pytest
import torch

from tests.unit.backends.test_decode_graphs import CONFIG
from tokenfleet.backends.torch.cuda_graphs import DecodeGraphs
from tokenfleet.backends.torch.mixed_graphs import MixedGraphs, token_buckets
from tokenfleet.backends.torch.runner import TorchModelRunner
from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.core import EngineCore
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.runner import ModelInfo
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
from tokenfleet.models import triton_attention
from tokenfleet.models.llama import KVCache
from tokenfleet.models.loader import random_model

pytestmark = [pytest.mark.skipif(not triton_attention.available(), reason="graphs need the Triton attention kernel"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="CPU bookkeeping check; tests/gpu replays real graphs"),
              # padding tokens' rows carry whatever their uninitialized attention output held (no request owns them;
              # every op on them is row-wise, and their logits are never read): numpy warns when that overflows
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

BLOCKS = 64


def engine(graphs: bool, monkeypatch, budget: int = 40) -> tuple[EngineCore, TorchModelRunner]:
    monkeypatch.setenv("TOKENFLEET_KERNELS", "triton")
    model = random_model(CONFIG, torch.float32, torch.device("cpu"), seed=3)
    model.attention.prefill_tokens = 8  # tiles of 16 rows: the chunks here (up to 24 tokens) span two
    runner = TorchModelRunner(model, BLOCKS, 4)
    if graphs:
        runner.kv = KVCache(CONFIG, BLOCKS + 1, 4, torch.float32, model.device)  # the scratch block, as on CUDA
        runner.graphs = DecodeGraphs(model, runner.kv, 4, BLOCKS, max_batch=8, max_model_len=128)
        runner.graphs.captured = True
        runner.mixed = MixedGraphs(model, runner.kv, 4, BLOCKS, 8, budget, runner.graphs.max_blocks,
                                   runner.graphs.logits)
        runner.mixed.captured = True
    config = SchedulerConfig(max_model_len=128, max_num_batched_tokens=budget, max_prefill_chunk=24)
    core = EngineCore(Scheduler(config, BlockManager(BLOCKS, 4), hash_salt="m"), runner, None,
                      ModelInfo(vocab_size=CONFIG.vocab_size, max_model_len=128, eos_token_ids=()))
    return core, runner


def run(core: EngineCore, arrivals: dict[int, list[tuple[list[int], SamplingParams]]]) -> dict[str, list[int]]:
    """Requests arriving at given steps (so prefill chunks land beside decode rows); tokens by request."""
    out: dict[str, list[int]] = {}
    step = 0
    n = 0
    while step <= max(arrivals) or core.has_unfinished():
        for prompt, params in arrivals.get(step, []):
            core.add_request(RequestSpec(prompt, params, request_id=f"r{n}"))
            n += 1
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    return out


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


ARRIVALS = {
    0: [(list(range(5, 40)), greedy(12)), (list(range(50, 57)), greedy(9))],  # 35 tokens: chunked (24 + 11)
    2: [(list(range(60, 90)), SamplingParams(max_tokens=10, temperature=0.8, seed=4, ignore_eos=True))],
    3: [(list(range(7, 13)), greedy(14, logprobs=2))],
    6: [(list(range(100, 133)), greedy(8)), (list(range(5, 21)), greedy(7))],  # a prefix of r0's prompt: cached
    9: [(list(range(140, 143)), greedy(6))],
}


def test_token_buckets_pad_a_step_by_at_most_an_eighth_above_the_ridge():
    buckets = token_buckets(2048)
    assert buckets[:9] == [64, 128, 192, 256, 320, 384, 448, 512, 576] and buckets[-3:] == [1792, 1920, 2048]
    assert len(buckets) == 24  # each one captured at start: a bounded count
    for tokens in range(1, 2049):
        bucket = min(b for b in buckets if b >= tokens)
        assert bucket - tokens < max(64, tokens / 8), tokens  # e.g. 8 decode rows + a 512-token chunk: 576
    assert token_buckets(40) == [40] and token_buckets(100) == [64, 100]


@pytest.mark.nightly  # the decode-graph replay and the mixed-graph decline tests stay in the suite
def test_steps_with_prefill_chunks_replay_what_the_regular_path_computes(monkeypatch):
    """fp32: chunked prompts, a cached prefix, decode rows beside prefill chunks, a sampled request, logprobs;
    buckets of 40 tokens with padding tokens and padding requests in most steps."""
    plain = run(engine(False, monkeypatch)[0], ARRIVALS)
    core, runner = engine(True, monkeypatch)
    mixed, graphs = runner.mixed, runner.graphs
    assert mixed is not None and graphs is not None
    seen: list[tuple[int, int]] = []
    replay = mixed.run

    def watched(scheduled, requests):  # every real request's table and rows as the replay reads them
        logits = replay(scheduled, requests)
        row = 0
        logits_rows, exact = [], []
        for i, entry in enumerate(scheduled):
            end = entry.start + entry.num_new_tokens
            used = -(-end // 4)
            assert mixed.tables[i, :used].tolist() == list(entry.block_ids[:used])
            assert mixed.starts[i] == row and mixed.contexts[i] == end
            assert mixed.positions[row:row + entry.num_new_tokens].tolist() == list(range(entry.start, end))
            row += entry.num_new_tokens
            if entry.samples:  # the eager path's logits rows and refined rows (runner.build_batch)
                params = requests[entry.request_id].sampling_params
                logits_rows.append(row - 1)
                exact.append(int(params.temperature == 0 or params.logprobs is not None))
        tiles = [(i, k) for i, e in enumerate(scheduled) for k in range(-(-e.num_new_tokens // mixed.tile_rows))]
        listed = mixed.work[:, :mixed._work_len(next(b for b in mixed.buckets if b >= row))]
        assert [tuple(p) for p in listed.t().tolist() if p[0] >= 0] == tiles  # the attention's programs, no more
        assert logits.shape[0] == len(logits_rows)
        assert mixed.rows[:len(logits_rows)].tolist() == logits_rows
        assert mixed.exact[:len(exact)].tolist() == exact and 0 in exact + [0]  # the sampled request is not refined
        assert (mixed.starts[len(scheduled):] == row).all()  # padding requests: no rows
        assert (mixed.slots[row:] == mixed.scratch_block * 4).all()  # padding tokens: the scratch block
        seen.append((len(scheduled), row))
        return logits

    mixed.run = watched  # type: ignore[method-assign]
    assert mixed.tile_rows == 16
    got = run(core, ARRIVALS)
    assert got == plain
    assert [len(got[f"r{i}"]) for i in range(7)] == [12, 9, 10, 14, 8, 7, 6]
    assert mixed.replays == len(seen) >= 6 and graphs.replays >= 10  # prefill steps replayed, decode ones too
    assert any(n > 1 and rows > n for n, rows in seen)  # decode rows beside a prefill chunk
    core.scheduler.block_manager.check_invariants()


def test_mixed_graphs_decline_what_they_cannot_replay(monkeypatch):
    core, runner = engine(True, monkeypatch)
    assert runner.mixed is not None
    out = run(core, {0: [(list(range(5, 15)), greedy(3, prompt_logprobs=1))]})
    assert len(out["r0"]) == 3 and runner.mixed.replays == 0  # prompt logprobs: the eager forward
    core, runner = engine(True, monkeypatch, budget=64)  # a step over the graphs' tokens: eager
    runner.mixed = MixedGraphs(runner.model, runner.kv, 4, BLOCKS, 8, 32, runner.graphs.max_blocks,  # type: ignore[union-attr]
                               runner.graphs.logits)  # type: ignore[union-attr]
    runner.mixed.captured = True
    out = run(core, {0: [(list(range(5, 45)), greedy(2))]})  # 40 tokens in one chunk of at most 24: 2 steps
    assert len(out["r0"]) == 2 and runner.mixed.replays == 2  # chunks of 24 and 16 fit 32
    out = run(core, {0: [(list(range(200, 224)), greedy(2)), (list(range(260, 284)), greedy(2))]})  # 48 in a step
    assert all(len(v) == 2 for v in out.values()) and runner.mixed.replays == 2


def test_mixed_graphs_are_opt_in_and_share_the_decode_graphs_buffers(monkeypatch):
    _, runner = engine(True, monkeypatch)
    graphs = runner.graphs
    assert graphs is not None
    monkeypatch.delenv("TOKENFLEET_CUDA_GRAPHS_MIXED", raising=False)
    assert MixedGraphs.beside(graphs, 512) is None  # off by default until a GPU measures it
    monkeypatch.setenv("TOKENFLEET_CUDA_GRAPHS_MIXED", "1")
    mixed = MixedGraphs.beside(graphs, 8192)
    assert mixed is not None and mixed.buckets[-1] == 2048 and mixed.logits is graphs.logits
    assert (mixed.max_requests, mixed.max_blocks, mixed.scratch_block) == (8, graphs.max_blocks, BLOCKS)
    assert MixedGraphs.beside(graphs, 0) is None
    graphs.windows = (0, 16)  # a model of two KV groups (Gemma 3): its steps stay eager
    assert MixedGraphs.beside(graphs, 512) is None


def test_long_decode_contexts_and_sliding_windows_stay_eager(monkeypatch):
    """A decode row over MAX_DECODE_CONTEXT keys would walk its context in one program per KV head (the eager step
    splits it over partitions); a model whose one KV group is a sliding window is attended without it here."""
    from tokenfleet.backends.torch import mixed_graphs
    from tokenfleet.engine.scheduler import ScheduledRequest

    _, runner = engine(True, monkeypatch)
    mixed = MixedGraphs(runner.model, runner.kv, 4, BLOCKS, 8, 64, max_blocks=4096, logits=runner.graphs.logits)  # type: ignore[union-attr]
    core, _ = engine(False, monkeypatch)
    core.add_request(RequestSpec([1, 2, 3], greedy(2), request_id="a"))
    requests = core.scheduler.requests
    limit = mixed_graphs.MAX_DECODE_CONTEXT
    blocks = tuple(range(-(-(limit + 1) // 4)))
    chunk = ScheduledRequest("a", 0, 3, blocks[:1], True)
    assert mixed.supports([ScheduledRequest("a", limit - 1, 1, blocks, True), chunk], requests)
    assert not mixed.supports([ScheduledRequest("a", limit, 1, blocks, True), chunk], requests)
    graphs = runner.graphs
    assert graphs is not None
    monkeypatch.setenv("TOKENFLEET_CUDA_GRAPHS_MIXED", "1")
    assert MixedGraphs.beside(graphs, 512) is not None
    graphs.windows = (16,)  # one KV group, all sliding-window layers
    assert MixedGraphs.beside(graphs, 512) is None
