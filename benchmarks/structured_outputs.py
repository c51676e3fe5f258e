"""Structured outputs: decode throughput with json_schema constraints vs unconstrained on the same
prompts (one engine, same process, alternating runs), and grammar compile times.

Two comparisons. "Equal length": a schema with one long string field, so constrained requests
run to max_tokens like the unconstrained ones (ignore_eos) and both runs have the same batch at
every step: the ratio is the per-token cost of the masks. "Realistic schemas": the three schemas
of the conformance tests; their JSON completes early (the grammar ends the request), so the batch
thins out and tokens/s drops for that reason too.

Usage: .venv/bin/python benchmarks/structured_outputs.py [--requests 16] [--max-tokens 64] [--rounds 2]
Prints a markdown report; numbers are ratios of runs in one process (the machine is shared)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenfleet.backends.torch.builder import build_engine_core
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.grammar import Guided
from tokenfleet.engine.guided import GuideCompiler
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.gguf_import import ensure_default_model

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "tennis", "music"]}, "maxItems": 3}},
        "required": ["name", "age", "hobbies"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "country": {"enum": ["FR", "IT", "DE"]}},
                 "required": ["name", "country"], "additionalProperties": False},
        "sunny": {"type": "boolean"}, "notes": {"type": "string"}},
        "required": ["city", "sunny", "notes"], "additionalProperties": False},
    "list": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "integer"}, "qty": {"enum": [1, 2, 3]}, "label": {"type": "string"}},
            "required": ["sku", "qty", "label"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
}
PROMPTS = ["Describe a person as JSON.", "Describe a city and its weather as JSON.", "List items of an order as JSON.",
           "Write a JSON record about a book."]


def run(core, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """All requests at once; (seconds, output tokens)."""
    for prompt, p in zip(prompts, params):
        core.add_request(RequestSpec(prompt, p))
    tokens, start = 0, time.perf_counter()
    while core.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model = ensure_default_model()
    core = build_engine_core(EngineConfig(model=str(model), dtype="bfloat16", num_threads=args.threads, device=args.device,
                                          num_blocks=2048))
    tok = core.tokenizer

    # Compile times: a fresh compiler per schema (no cache), then the cached path.
    start = time.perf_counter()
    compiler = GuideCompiler(tok.to_json(), core.model.vocab_size, core.model.eos_token_ids)
    setup = time.perf_counter() - start
    compile_ms = {}
    for name, schema in SCHEMAS.items():
        guided = Guided("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        compiler.prepare(guided)
        compile_ms[name] = 1000 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(100):
        compiler.matcher(Guided("json_schema", json.dumps(SCHEMAS["person"])))
    cached_us = 1e6 * (time.perf_counter() - t0) / 100

    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
    names = list(SCHEMAS)
    # ignore_eos on both sides would change the constrained runs (a finished grammar ends the request);
    # min/max tokens are equal and outputs are counted, so the rate compares per-token cost.
    def params(guided: Guided | None, i: int) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i, ignore_eos=guided is None,
                              guided=guided)

    long_field = Guided("json_schema", json.dumps({"type": "object", "properties": {
        "text": {"type": "string", "minLength": 8 * args.max_tokens}}, "required": ["text"]}))
    runs = {
        "unconstrained": [params(None, i) for i in range(args.requests)],
        "json_schema, equal length": [params(long_field, i) for i in range(args.requests)],
        "json_schema, realistic schemas": [params(Guided("json_schema", json.dumps(SCHEMAS[names[i % len(names)]])),
                                                  i) for i in range(args.requests)],
    }
    for group in runs.values():
        for p in group:
            if p.guided is not None:
                core.guides.prepare(p.guided)  # compiled before timing (the engine does it off-thread)
    run(core, prompts[:2], runs["unconstrained"][:2])  # warm up
    rates: dict[str, list[float]] = {label: [] for label in runs}
    tokens_of: dict[str, int] = {}
    for _ in range(args.rounds):
        for label, group in runs.items():
            core.scheduler.block_manager.reset_prefix_cache()
            seconds, tokens = run(core, prompts, group)
            rates[label].append(tokens / seconds)
            tokens_of[label] = tokens
    free_rate = statistics.median(rates["unconstrained"])
    print(f"## Structured outputs ({args.requests} concurrent requests, <= {args.max_tokens} tokens, "
          f"{args.device}, {args.threads} threads)\n")
    print("| run | output tokens | output tok/s (median) | rounds | vs unconstrained |\n|---|---|---|---|---|")
    for label in rates:
        rate = statistics.median(rates[label])
        print(f"| {label} | {tokens_of[label]} | {rate:.1f} | {', '.join(f'{r:.1f}' for r in rates[label])} "
              f"| {rate / free_rate:.2f} |")
    print()
    print(f"Grammar compiler setup (tokenizer tables + first mask, once per worker): {setup * 1000:.0f} ms")
    print("| schema | compile ms |\n|---|---|")
    for name, ms in compile_ms.items():
        print(f"| {name} | {ms:.2f} |")
    print(f"\nCached schema -> fresh matcher: {cached_us:.1f} µs")


if __name__ == "__main__":
    main()
