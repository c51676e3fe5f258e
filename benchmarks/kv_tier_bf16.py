"""bf16: do greedy outputs change with where a prompt's prefix came from? Match rates, not equality.

In fp32 the tests assert identical greedy outputs whether a prefix was computed, found in the pool,
restored from the second tier (disk) or fetched from a peer (tests/unit/engine/test_kv_tier_engine.py,
tests/integration/test_peer_fetch.py). In bf16 a prefix hit changes the computation (the prompt's tail
attends to cached K/V instead of being computed in one pass with it), so outputs may drift from a full
recompute; the tiers and peers move the pool's bytes unchanged, so they should match a pool hit exactly.

Per conversation (a tenant's system prompt, a question, the model's own reply, a follow-up), the
follow-up turn is generated (greedy, --max-tokens) five ways on the default model in bf16:
  recompute - prefix caching off: the whole prompt computed in one pass;
  pool      - the first turn ran on the same engine: the transcript's blocks (the reply's included) hit;
  tier      - as pool, then other prompts evicted them into a disk tier: restored from disk;
  peer      - a fresh engine fetched the blocks from the pool engine (read_blocks -> stage_blocks);
  chunked   - prefix caching off, prefill in 32-token chunks (how much chunking alone moves bf16).
Reports, against recompute and against pool: sequences identical, and tokens matching up to the first
divergence.

    .venv/bin/python benchmarks/kv_tier_bf16.py [--conversations 16] [--out benchmarks/reports/kv-tier-bf16.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from serving.report import git_head  # noqa: E402

from tokenfleet.api.chat_template import render_chat  # noqa: E402
from tokenfleet.backends.torch.builder import build_engine_core  # noqa: E402
from tokenfleet.engine.config import EngineConfig  # noqa: E402
from tokenfleet.engine.core import EngineCore  # noqa: E402
from tokenfleet.engine.request_spec import RequestSpec  # noqa: E402
from tokenfleet.engine.sampling_params import SamplingParams  # noqa: E402
from tokenfleet.kvcache.block_hash import hash_blocks  # noqa: E402
from tokenfleet.kvcache.salt import chain_salt  # noqa: E402

SYSTEMS = [
    "You are the support assistant of a bicycle shop. Be concise, friendly and precise. Mention opening hours "
    "(9 to 18, Monday to Saturday) only when asked. Prices are in euros. " * 2,
    "You are a travel agent's assistant. Answer in short paragraphs, suggest at most three options, and always "
    "ask about the budget before booking anything. " * 2,
]
QUESTIONS = ["How do I fix a flat tyre?", "Which lights do I need for riding at night?", "Is a steel frame heavy?",
             "What should I pack for a weekend in Lisbon?", "Trains or flights from Paris to Milan?",
             "How often should I oil the chain?", "Can you suggest a quiet beach in Portugal?",
             "What is a good first road bike?"]
FOLLOW_UPS = ["Thanks. And how long does that take?", "Could you make that shorter?", "What would it cost?",
              "Anything else I should know?"]


def core(model: str, **options: object) -> EngineCore:
    options.setdefault("dtype", "bfloat16")
    options.setdefault("num_threads", 1)  # leaves a core to the rest of the machine (2-thread torch crawls if shared)
    return build_engine_core(EngineConfig(model=model, **options))  # type: ignore[arg-type]


def run(engine: EngineCore, prompt: list[int], max_tokens: int, request_id: str) -> list[int]:
    engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), request_id=request_id))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "kv-tier-bf16.json"))
    args = parser.parse_args()
    from tokenfleet.models.gguf_import import ensure_default_model

    model = str(Path(ensure_default_model()).resolve())
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    tier_dir = tempfile.mkdtemp(prefix="tokenfleet-bf16-tier-")
    recompute = core(model, enable_prefix_caching=False)
    chunked = core(model, enable_prefix_caching=False, max_prefill_chunk=32)
    pool = core(model, num_blocks=2048)
    tiered = core(model, num_blocks=64, kv_tier=f"disk:{tier_dir}", kv_tier_bytes=1 << 30)
    tok = pool.tokenizer
    layout = pool.kv_layout()
    rows = []
    for c in range(args.conversations):
        messages = [{"role": "system", "content": SYSTEMS[c % len(SYSTEMS)]},
                    {"role": "user", "content": QUESTIONS[c % len(QUESTIONS)] + f" (ticket {c})"}]
        first = tok.encode(render_chat(tok, messages))
        reply = run(pool, first, args.max_tokens, f"c{c}-t0")
        run(tiered, first, args.max_tokens, f"c{c}-t0")
        messages += [{"role": "assistant", "content": tok.decode(reply)},
                     {"role": "user", "content": FOLLOW_UPS[c % len(FOLLOW_UPS)]}]
        second = tok.encode(render_chat(tok, messages))
        out = {"recompute": run(recompute, second, args.max_tokens, f"c{c}-r"),
               "chunked": run(chunked, second, args.max_tokens, f"c{c}-k")}
        hashes = hash_blocks(second, layout.block_size, chain_salt(layout.hash_salt, ""))
        payloads = pool.read_blocks(hashes)  # before the pool engine runs the follow-up itself
        peer = core(model, num_blocks=256)
        peer.stage_blocks(hashes[: len(payloads)], payloads)
        out["peer"] = run(peer, second, args.max_tokens, f"c{c}-p")
        out["pool"] = run(pool, second, args.max_tokens, f"c{c}-t1")
        for i in range(6):  # 6 x 19 blocks through a 64-block pool: the conversation's blocks go to disk
            run(tiered, [(c * 977 + i * 131 + j * 17) % 20_000 + 500 for j in range(300)], 1, f"c{c}-flood{i}")
        hits_before = tiered.snapshot().tier_hit_blocks
        out["tier"] = run(tiered, second, args.max_tokens, f"c{c}-t1")
        rows.append({"conversation": c, "prompt_tokens": len(second), "shared_blocks": len(payloads),
                     "tier_restored_blocks": tiered.snapshot().tier_hit_blocks - hits_before,
                     "peer_staged_blocks": len(payloads), "outputs": out})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "outputs"}), flush=True)
    tiered.close()
    paths = ("pool", "tier", "peer", "chunked")
    summary = {}
    for base in ("recompute", "pool"):
        for path in paths:
            if path == base:
                continue
            same = [r["outputs"][path] == r["outputs"][base] for r in rows]
            agree = [agreement(r["outputs"][path], r["outputs"][base])
                     / max(1, len(r["outputs"][path]), len(r["outputs"][base])) for r in rows]  # EOS ends some early
            summary[f"{path} vs {base}"] = {"identical": sum(same) / len(rows),
                                            "tokens_before_divergence": statistics.mean(agree)}
    result = {"started": started, "git": git_head(), "args": vars(args), "rows": rows, "summary": summary,
              "command": "benchmarks/kv_tier_bf16.py " + " ".join(sys.argv[1:])}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    lines = ["# bf16: greedy outputs by where the prefix came from", "", f"{started}, git {result['git']}", "",
             f"{len(rows)} conversations, the follow-up turn ({min(r['prompt_tokens'] for r in rows)}-"
             f"{max(r['prompt_tokens'] for r in rows)} prompt tokens, {args.max_tokens} greedy tokens), default model "
             "in bf16. Restored from disk: "
             f"{sum(r['tier_restored_blocks'] for r in rows)} blocks; staged from the peer: "
             f"{sum(r['peer_staged_blocks'] for r in rows)}.", "",
             "| path | identical sequences | tokens matching before the first divergence (mean) |", "|---|---|---|"]
    lines += [f"| {k} | {v['identical']:.0%} | {v['tokens_before_divergence']:.0%} |" for k, v in summary.items()]
    out_path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
