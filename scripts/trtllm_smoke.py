"""Verify a TensorRT-LLM engine end to end through tokenfleet's adapter, on a GPU node.

Run inside the TensorRT-LLM image (Python 3.12, CUDA 13, tensorrt-llm 1.2.x) with tokenfleet
installed, on a node with the engine's GPUs:

    python scripts/trtllm_smoke.py --model /engines/llama-70b-fp8-tp8 [--tp 8] [--tokenizer HF_DIR]
    # TP > 1: mpirun -n 8 trtllm-llmapi-launch python scripts/trtllm_smoke.py --model ... --tp 8

Steps, each printed PASS/FAIL with its detail:
  load         build the LLM (engine dir -> the TRT-engine class; checkpoint -> PyTorch backend)
               and pass the one-token health generation
  stream       stream a short chat; deltas non-empty, no duplicated tokens, finish reason set
  abort        cancel a long stream after a few tokens; the request ends, the engine still serves
  disagg       context_only on one instance -> hand-off -> generation_only on a second instance
               (both with the cache transceiver); greedy output equals the aggregated run
  stats        iteration stats and KV events arrive (load signals for the router)

``--api tests.trtllm_double:api`` runs the same steps against the repo's test double of the API
(to check the script itself where TensorRT-LLM is not installed). Exit status: 0 when every
step passed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without `pip install`

from tokenfleet.backends.trtllm.engine import TrtllmEngine  # noqa: E402 (imports no tensorrt_llm)
from tokenfleet.backends.trtllm.spec import PYTORCH, TRT_ENGINE, TrtllmSpec, load_api  # noqa: E402
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="TRT engine dir or HF/ModelOpt checkpoint")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokenizer", help="HF tokenizer dir for the chat prompt (default: --model)")
    p.add_argument("--transceiver", default="UCX", choices=["DEFAULT", "UCX", "NIXL", "MPI"])
    p.add_argument("--kv-fraction", type=float, default=0.4,
                   help="KV share per instance: the disagg step runs two instances on the same GPUs")
    p.add_argument("--skip", action="append", default=[], choices=["stream", "abort", "disagg", "stats"])
    p.add_argument("--api", help="module:function returning the API namespace (default: tensorrt_llm)")
    return p.parse_args()


def prompt_ids(args: argparse.Namespace, text: str) -> list[int]:
    folder = args.tokenizer or args.model
    if (Path(folder) / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(Path(folder) / "tokenizer.json")).encode(text).ids
    return [1 + (ord(c) % 200) for c in text]  # no tokenizer: any ids in range exercise the engine


class Smoke:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.results: list[tuple[str, bool, str]] = []
        kind = TRT_ENGINE if (Path(args.model) / "rank0.engine").exists() else PYTORCH
        if kind == TRT_ENGINE and not args.tokenizer:
            raise SystemExit("an engine dir holds no tokenizer: pass --tokenizer HF_DIR (the checkpoint's)")
        config = json.loads((Path(args.model) / "config.json").read_text())
        pretrained = config.get("pretrained_config", config)
        self.vocab = int(pretrained.get("vocab_size", 32000))
        self.max_len = int(config.get("build_config", {}).get("max_seq_len") or
                           pretrained.get("max_position_embeddings", 4096))
        self.spec = dict(model=args.model, kind=kind, tensor_parallel_size=args.tp, gather_generation_logits=False,
                         tokenizer=args.tokenizer or (None if kind == TRT_ENGINE else args.model),
                         kv_free_gpu_memory_fraction=args.kv_fraction, transceiver=args.transceiver,
                         guided_decoding_backend="xgrammar" if kind == TRT_ENGINE else "llguidance")
        self.loader = load_api
        if args.api:
            module, _, name = args.api.partition(":")
            self.loader = getattr(importlib.import_module(module), name)

    def engine(self, role: str) -> TrtllmEngine:
        return TrtllmEngine(TrtllmSpec(role=role, **self.spec), "smoke", self.vocab, self.max_len,
                            api_loader=self.loader)

    async def step(self, name: str, fn: Callable[[], Awaitable[str]]) -> bool:
        start = time.monotonic()
        try:
            detail = await fn()
            ok = True
        except Exception as e:  # noqa: BLE001 - a smoke step reports every failure and goes on
            detail, ok = f"{type(e).__name__}: {e}", False
            traceback.print_exc()
        detail = f"{detail} ({time.monotonic() - start:.1f} s)"
        self.results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name:7s} {detail}", flush=True)
        return ok

    async def run(self) -> int:
        both = self.engine("both")

        async def load() -> str:
            await both.start()
            return f"{self.spec['kind']} LLM up, health generation ok"

        if await self.step("load", load):
            prompt = prompt_ids(self.args, "Write one sentence about the sea.")
            if "stream" not in self.args.skip:
                await self.step("stream", lambda: self.stream(both, prompt))
            if "abort" not in self.args.skip:
                await self.step("abort", lambda: self.abort(both, prompt))
            if "stats" not in self.args.skip:
                await self.step("stats", lambda: self.stats(both))
            aggregated = await self.tokens(both, prompt, "reference")
            await both.shutdown()
            if "disagg" not in self.args.skip:
                await self.step("disagg", lambda: self.disagg(prompt, aggregated))
        failed = [name for name, ok, _ in self.results if not ok]
        print(f"{len(self.results) - len(failed)}/{len(self.results)} steps passed" +
              (f"; failed: {', '.join(failed)}" if failed else ""))
        return 1 if failed else 0

    async def tokens(self, engine: TrtllmEngine, prompt: list[int], request_id: str, **kw: object) -> list[int]:
        return [t async for out in engine.generate(RequestSpec(prompt, GREEDY, request_id, **kw)) for t in out.new_token_ids]

    async def stream(self, engine: TrtllmEngine, prompt: list[int]) -> str:
        outs = [out async for out in engine.generate(RequestSpec(prompt, GREEDY, "stream"))]
        tokens = [t for o in outs for t in o.new_token_ids]
        assert outs[-1].finished and outs[-1].finish_reason is not None, "no final output"
        assert sum(o.finished for o in outs) == 1, "more than one final"
        assert 0 < len(tokens) <= GREEDY.max_tokens and outs[-1].num_output_tokens == len(tokens), "token counts"
        return f"{len(tokens)} tokens in {len(outs)} deltas, finish {outs[-1].finish_reason.value}"

    async def abort(self, engine: TrtllmEngine, prompt: list[int]) -> str:
        long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        stream = engine.generate(RequestSpec(prompt, long, "abort"))
        got = 0
        async with contextlib.aclosing(stream):
            async for out in stream:
                got += len(out.new_token_ids)
                if got >= 4:
                    break  # closing the stream aborts the request
        after = await self.tokens(engine, prompt, "after-abort")
        assert after, "the engine stopped serving after an abort"
        return f"aborted after {got} tokens; the next request produced {len(after)}"

    async def stats(self, engine: TrtllmEngine) -> str:
        for _ in range(20):
            s = engine.stats()
            if s.num_steps:
                return (f"running {s.num_running}, waiting {s.num_waiting}, KV blocks used {s.num_blocks_used}, "
                        f"{len(engine.cached_block_hashes())} routable prefix blocks")
            await asyncio.sleep(0.5)
        raise AssertionError("no iteration stats arrived (PyTorch backend: enable_iter_perf_stats)")

    async def disagg(self, prompt: list[int], aggregated: list[int]) -> str:
        prefill, decode = self.engine("prefill"), self.engine("decode")
        await prefill.start()
        await decode.start()
        events: list[str] = []

        def source(held, layout):
            async def stream():
                async with contextlib.aclosing(prefill.prefill(RequestSpec(prompt, GREEDY, "ctx", 0), held, layout)) as evs:
                    async for event in evs:
                        events.append(type(event).__name__)
                        yield event
            return stream()

        try:
            got = await self.tokens(decode, prompt, "gen", kv_source=source)
            remote = decode.stats().num_remote_prefills
        finally:
            await decode.shutdown()
            await prefill.shutdown()
        assert remote == 1, f"the decode instance fell back to a local prefill (events: {events})"
        assert got == aggregated, f"disaggregated {got[:8]}... != aggregated {aggregated[:8]}..."
        return f"{' -> '.join(events)}; {len(got)} tokens equal to the aggregated run, first token once"


if __name__ == "__main__":  # guarded: TensorRT-LLM's MPI workers import the main module
    raise SystemExit(asyncio.run(Smoke(parse_args()).run()))
