"""The second KV tier inside the engine (default model, fp32): a prompt whose blocks the pool evicted is
restored from the tier (memory or disk) with greedy output identical to computing it and to an engine
without a tier; the restored tokens count as cached; a damaged stored block is detected and recomputed;
random cancellation leaks no block in the pool and keeps the tier's accounting exact."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.model.helpers import greedy, make_core, run_to_completion
from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.request_spec import RequestSpec

SYSTEM = "You are the support assistant of a bicycle shop. Be concise, friendly and precise. " * 4


def chat(core, text: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return core.tokenizer.encode(render_chat(core.tokenizer, messages))


def flood(core, tag: str, n: int = 6) -> None:
    """Distinct prompts that need the whole pool: every cached block of earlier prompts is evicted."""
    prompts = [[(i * 131 + j * 17) % 20_000 + 500 for j in range(150)] for i in range(n)]
    run_to_completion(core, {0: [(f"{tag}-{i}", p, greedy(2)) for i, p in enumerate(prompts)]})


@pytest.fixture(scope="module")
def reference(default_model_dir):
    return make_core(default_model_dir, num_blocks=40)


@pytest.mark.parametrize("medium", ["memory", "disk"])
def test_evicted_prefix_is_restored_from_the_tier_with_identical_output(default_model_dir, reference, tmp_path, medium):
    spec = "memory" if medium == "memory" else f"disk:{tmp_path}"
    core = make_core(default_model_dir, num_blocks=40, kv_tier=spec, kv_tier_bytes=64 << 20)
    prompt = chat(core, "How do I fix a flat tyre?")
    expected = run_to_completion(reference, {0: [("ref", prompt, greedy(12))]})["ref"]
    first = run_to_completion(core, {0: [("a1", prompt, greedy(12))]})["a1"]
    flood(core, "f1")
    stats = core.snapshot()
    assert stats.tier_entries > 0
    core.add_request(RequestSpec(prompt, greedy(12), request_id="a2"))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    again = [t for o in outputs for t in o.new_token_ids]
    assert first == again == expected
    after = core.snapshot()
    assert after.tier_hit_blocks - stats.tier_hit_blocks >= len(prompt) // 16 - 1  # all but the last block
    assert outputs[-1].num_cached_tokens >= (len(prompt) // 16 - 1) * 16  # cached_tokens counts the tier
    core.scheduler.block_manager.check_invariants()
    if medium == "disk":
        core.tier.flush()
        files = [p for p in Path(tmp_path).rglob("*") if p.is_file()]
        assert len(files) == core.snapshot().tier_entries


def test_a_damaged_stored_block_is_detected_and_recomputed(default_model_dir, reference, tmp_path):
    core = make_core(default_model_dir, num_blocks=40, kv_tier=f"disk:{tmp_path}", kv_tier_bytes=64 << 20)
    prompt = chat(core, "Which lubricant should I use for the chain?")
    expected = run_to_completion(reference, {0: [("ref", prompt, greedy(12))]})["ref"]
    run_to_completion(core, {0: [("a1", prompt, greedy(12))]})
    flood(core, "f")
    core.tier.flush()
    for path in Path(tmp_path).rglob("*"):
        if path.is_file():
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x08
            path.write_bytes(bytes(data))
    got = run_to_completion(core, {0: [("a2", prompt, greedy(12))]})["a2"]
    assert got == expected
    stats = core.snapshot()
    assert stats.tier_corrupt_blocks >= 1
    core.scheduler.block_manager.check_invariants()


def test_random_cancellation_leaks_nothing_in_either_tier(default_model_dir, tmp_path):
    core = make_core(default_model_dir, num_blocks=32, kv_tier=f"disk:{tmp_path}", kv_tier_bytes=4 << 20,
                     kv_tier_tenant_bytes=3 << 20)
    rng = random.Random(7)
    texts = ["brakes", "gears", "tyres", "saddle", "lights", "chain"]
    live: list[str] = []
    for step in range(120):
        if rng.random() < 0.3:
            rid = f"r{step}"
            if rng.random() < 0.3:  # a distinct prompt: presses cached blocks out of the pool
                prompt = [rng.randrange(500, 20_000) for _ in range(rng.randint(40, 200))]
            else:
                prompt = chat(core, f"Tell me about {rng.choice(texts)}." * rng.randint(1, 4))
            core.add_request(RequestSpec(prompt, greedy(rng.randint(1, 10)), request_id=rid, tenant=rng.choice(["a", "b"])))
            live.append(rid)
        if live and rng.random() < 0.2:
            core.abort(live.pop(rng.randrange(len(live))))
        core.step()
        core.scheduler.block_manager.check_invariants()
    while core.has_unfinished():
        core.step()
    bm = core.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    core.tier.flush()
    stats = core.snapshot()
    files = [p for p in Path(tmp_path).rglob("*") if p.is_file()]
    assert stats.tier_hit_blocks > 0 and len(files) == stats.tier_entries
    assert sum(p.stat().st_size for p in files) == stats.tier_bytes_used <= 4 << 20
    assert all(v <= 3 << 20 for v in core.tier.snapshot().per_tenant_bytes.values())


def test_a_restarted_engine_restores_its_pool_from_the_disk_tier(default_model_dir, reference, tmp_path):
    """Closing copies the pool's cached blocks (never evicted, so not yet in the tier) to disk; an engine
    started on the same folder serves the prompt from them, output unchanged."""
    spec = f"disk:{tmp_path}"
    core = make_core(default_model_dir, num_blocks=40, kv_tier=spec, kv_tier_bytes=64 << 20)
    prompt = chat(core, "Which chain lube for winter?")
    expected = run_to_completion(reference, {0: [("ref", prompt, greedy(8))]})["ref"]
    assert run_to_completion(core, {0: [("a", prompt, greedy(8))]})["a"] == expected
    assert core.snapshot().tier_entries == 0  # nothing evicted yet: the blocks live only in the pool
    pooled = core.scheduler.block_manager.cached_hashes()
    core.close()
    restarted = make_core(default_model_dir, num_blocks=40, kv_tier=spec, kv_tier_bytes=64 << 20)
    assert pooled <= set(restarted.tier.hashes())
    restarted.add_request(RequestSpec(prompt, greedy(8), request_id="b"))
    outputs = []
    while restarted.has_unfinished():
        outputs += restarted.step()
    assert [t for o in outputs for t in o.new_token_ids] == expected
    assert outputs[-1].num_cached_tokens >= (len(prompt) // 16 - 1) * 16
    restarted.close()
