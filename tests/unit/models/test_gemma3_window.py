"""Random-weight tiny Gemma 3 with a tiny sliding window: our paged-KV forward equals HF transformers'
logits (fp32) at every step of prompts 4x the window, through chunked prefill, prefix-cache hits and
preemption, while the sliding-window layers' block tables keep only the blocks their window reaches."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.backends.torch.runner import TorchModelRunner
from tokenfleet.engine.block_manager import NULL_BLOCK, BlockManager
from tokenfleet.engine.request import Request
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
from tokenfleet.models.loader import load_model

WINDOW, BLOCK = 10, 4  # a window that is not a multiple of the block size
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # 2 global, 4 sliding: 3 groups of 2


def save_tiny_gemma3(path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        max_position_embeddings=256, rms_norm_eps=1e-6, attn_implementation="eager",
    )
    model = Gemma3ForCausalLM(config).eval()
    for name, p in model.named_parameters():  # random norms too (HF initializes them to 0, i.e. a scale of 1)
        if "norm" in name:
            p.data.normal_(0, 0.3)
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    return path, save_tiny_gemma3(path)


def run(model_dir, prompts, num_steps, num_blocks=128, chunk=0, arrivals=None, check=None):
    """Prompts through scheduler + runner (argmax fed back); logits per request per step. ``arrivals``:
    step at which each prompt is added (default all at 0). ``check(scheduler)`` runs after every step."""
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    windows = tuple(g.window for g in model.config.kv_groups)
    runner = TorchModelRunner(model, num_blocks=num_blocks, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_prefill_chunk=chunk, max_model_len=256, max_num_batched_tokens=64),
                          BlockManager(num_blocks, BLOCK, windows), hash_salt="t")
    arrivals = arrivals or [0] * len(prompts)
    logits: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while step <= max(arrivals) or scheduler.has_unfinished():
        for i, prompt in enumerate(prompts):
            if arrivals[i] == step:
                params = SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True)
                scheduler.add_request(Request(f"r{i}", list(prompt), params, arrival_time=i, max_tokens=num_steps))
        out = scheduler.schedule(0.0)
        if not out.is_empty:
            step_logits = runner.compute_logits(out, scheduler.requests)
            sampling = [s.request_id for s in out.scheduled if s.samples]
            for request_id, row in zip(sampling, step_logits):
                logits[request_id].append(row)
            scheduler.update(out, {rid: int(row.argmax()) for rid, row in zip(sampling, step_logits)})
        scheduler.block_manager.check_invariants()
        if check is not None:
            check(scheduler)
        step += 1
    return logits, scheduler


def hf_reference(model, prompt, ours):
    seq, ref = list(prompt), []
    for row in ours:
        with torch.inference_mode():
            ref.append(model(torch.tensor([seq])).logits[0, -1].float())
        seq.append(int(row.argmax()))
    return ref


def assert_matches(hf, prompts, logits, num_steps):
    for i, prompt in enumerate(prompts):
        assert len(logits[f"r{i}"]) == num_steps
        for step, (a, b) in enumerate(zip(logits[f"r{i}"], hf_reference(hf, prompt, logits[f"r{i}"]))):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), f"prompt {i} step {step}: {(a - b).abs().max()}"


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_window_is_the_models(tiny):
    """Sanity: the HF model really attends within the window (else the parity below proves little)."""
    _, hf = tiny
    a, b = prompt(1, 30), prompt(2, 30)
    tail = a[-WINDOW:]
    with torch.inference_mode():
        full_a = hf(torch.tensor([a])).logits[0, -1]
        mixed = hf(torch.tensor([b[:-WINDOW] + tail])).logits[0, -1]
    assert not torch.allclose(full_a, mixed, atol=1e-3)  # the global layers see the start


def test_logits_match_transformers_past_the_window_in_one_prefill_and_in_chunks(tiny):
    path, hf = tiny
    prompts = [prompt(3, 4 * WINDOW), prompt(4, 7), prompt(5, 2 * WINDOW + 3)]
    for chunk in (0, 5):
        logits, _ = run(path, prompts, num_steps=12, chunk=chunk)
        assert_matches(hf, prompts, logits, 12)


def test_prefix_hits_across_both_kinds_of_layers_match_transformers(tiny):
    path, hf = tiny
    shared = prompt(6, 3 * WINDOW + 2)
    prompts = [shared + prompt(7, 5), shared + prompt(8, 9), shared[: 2 * WINDOW]]
    hits = []

    def count_hits(scheduler):
        hits.append(sum(r.num_cached_tokens for r in scheduler.requests.values()))

    logits, scheduler = run(path, prompts, num_steps=6, chunk=8, arrivals=[0, 12, 14], check=count_hits)
    assert max(hits) >= 2 * 16  # the later prompts took a prefix from the cache
    assert_matches(hf, prompts, logits, 6)


def test_preemption_recomputes_and_still_matches(tiny):
    path, hf = tiny
    prompts = [prompt(9, 3 * WINDOW), prompt(10, 3 * WINDOW + 1), prompt(11, 25)]
    logits, scheduler = run(path, prompts, num_steps=20, num_blocks=40)
    assert scheduler.num_preemptions > 0
    assert_matches(hf, prompts, logits, 20)


def test_sliding_layers_hold_blocks_bounded_by_the_window_at_4x_its_context(tiny):
    path, _ = tiny
    held: list[int] = []
    full_held: list[int] = []

    def measure(scheduler):
        bm = scheduler.block_manager
        for request_id in scheduler.requests:
            tables = bm.block_tables(request_id)
            for window, table in zip(bm.windows, tables):
                live = sum(1 for b in table if b != NULL_BLOCK)
                (held if window else full_held).append(live)

    chunk = 4
    run(path, [prompt(12, 2 * WINDOW)], num_steps=2 * WINDOW + 1, chunk=chunk, check=measure)  # context 4x + 1
    assert max(full_held) == -(-(4 * WINDOW) // BLOCK)  # global layers keep everything
    bound = -(-(WINDOW + chunk) // BLOCK) + 1
    assert 0 < max(held) <= bound < max(full_held)


def test_blocks_a_window_left_behind_serve_as_prefix_cache_then_are_evicted():
    bm = BlockManager(16, 4, windows=(0, 8))
    hashes = [bytes([i]) * 8 for i in range(6)]
    assert bm.allocate_slots("a", 24, start=0) is not None
    bm.cache_blocks("a", hashes)
    used = bm.num_used_blocks
    assert bm.allocate_slots("a", 25, start=24) is not None  # decode at 24: the window keeps keys 17..24
    live = [b for b in bm.block_tables("a")[1] if b != NULL_BLOCK]
    assert len(live) == 3 and bm.num_used_blocks == used - 4 + 2  # 4 sliding blocks dropped, 2 new (one per group)
    bm.free("a")
    hit = bm.match_prefix(hashes)
    assert len(hit) == 6  # the window group's last blocks are still cached
    assert hit.tables[1][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in hit.tables[1][4:]
    bm.check_invariants()
