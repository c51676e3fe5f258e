"""Our perplexity against llama.cpp's `llama-perplexity` on the original GGUF: the model import checked by a second,
independent implementation (its own GGUF reader, tokenizer, kernels).

The text is committed (benchmarks/data/perplexity_text.txt, the Mozilla Public License 2.0, ~3,000 tokens). Both
sides score the same token ids, llama.cpp's own tokenization of it (`llama-tokenize`), with llama-perplexity's
protocol: the ids cut into chunks of --ctx tokens, each chunk's first token replaced by BOS, the second half of
each chunk scored (the log-probability of token i+1 given tokens 0..i, for i from ctx/2 to ctx-2). Ours: the
served engine (`tokenfleet.llm.LLM`, the paged KV, chunked prefill and kernels a worker runs) in --dtype, the
logprobs of the prompt tokens (`prompt_logprobs`). Whether our tokenizer gives the same ids is reported too.

llama.cpp computes with its quantized weights (Q4_K / Q4_1 blocks against Q8 activations) and an f16 KV cache.
Each of our --configs QUANTIZATION:DTYPE scores the text too: ``none`` the weights dequantized by our import,
``gguf`` the GGUF's tensors kept quantized (a NAME-gguf folder), ``int8`` int8 weights and activations. Quantized
configs prefill a decode-sized step at a time (gguf: --quantized-chunk tokens, 32; int8: the int8 path's rows,
models.quant_linear.INT8_ROWS), so every position goes through the serving kernels (the native quantized matmul,
int8's integer dots) rather than prefill's dequantized weights. Perplexities close
to, not equal to, llama.cpp's are the expected result; --tolerance (2 %) is the pass line; int8 is also compared
with the same model's bf16.

    benchmarks/peers/build_llama_cpp.sh          # prints LLAMA_BIN
    .venv/bin/python benchmarks/gguf_perplexity.py --llama-bin LLAMA_BIN [--models gemma3-270m smollm2-135m-instruct]
        [--ctx 512 1024] [--out benchmarks/reports/DATE-cpu-gguf-perplexity.json]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from serving.report import git_head, machine_line, write_report

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "benchmarks" / "data" / "perplexity_text.txt"


def llama_tokens(bin_dir: Path, gguf: Path, text: Path, bos: bool = True) -> list[int]:
    """llama.cpp's token ids of ``text`` (with BOS where the model asks for one, unless ``bos`` is False)."""
    done = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable",
                           "--no-escape", *([] if bos else ["--no-bos"])],
                          capture_output=True, text=True, check=True, timeout=600)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("[")][-1]
    return [int(t) for t in line.strip("[] \n").split(",") if t.strip()]


def same_ids(tokenizer, ours: list[int], theirs: list[int]) -> str:  # type: ignore[no-untyped-def]
    """"yes", or where our tokenization of the text first parts from llama.cpp's, with the pieces each made there."""
    if ours == theirs:
        return "yes"
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    pieces = [repr(" · ".join(tokenizer.decode([t]) for t in ids[at:at + 4])) for ids in (ours, theirs)]
    return f"no: {len(ours)} vs {len(theirs)} ids, first apart at id {at}: ours {pieces[0]}, llama.cpp's {pieces[1]}"


def llama_perplexity(bin_dir: Path, gguf: Path, text: Path, ctx: int, threads: int) -> dict:
    started = time.monotonic()
    done = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
                           "-b", str(ctx), "-t", str(threads)], capture_output=True, text=True, timeout=3600)
    out = done.stdout + done.stderr
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}):\n{out[-3000:]}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
    return {"ppl": float(found.group(1)), "ppl_error": float(found.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None, "seconds": time.monotonic() - started}


def chunks_of(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: whole ``ctx``-token slices, the first token of each replaced by BOS (for a model
    that adds one)."""
    chunks = [tokens[i * ctx:(i + 1) * ctx] for i in range(len(tokens) // ctx)]
    return [[bos, *c[1:]] if bos is not None else c for c in chunks]


def scored_logprobs(prompt_logprobs: list[float], ctx: int) -> list[float]:
    """The logprobs llama-perplexity scores in one chunk: of tokens ctx/2+1 .. ctx-1 (prompt_logprobs[i] is token
    i+1's)."""
    first = ctx // 2
    return prompt_logprobs[first:ctx - 1]


def our_perplexity(llm, tokens: list[int], ctx: int, bos: int | None) -> dict:  # type: ignore[no-untyped-def]
    from tokenfleet.engine.sampling_params import SamplingParams

    started = time.monotonic()
    chunks = chunks_of(tokens, ctx, bos)
    outs = llm.generate(chunks, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    values: list[float] = []
    for chunk, out in zip(chunks, outs):
        logprobs = [p.logprob for p in out.prompt_logprobs]
        assert len(logprobs) == len(chunk) - 1 and [p.token_id for p in out.prompt_logprobs] == chunk[1:]
        values += scored_logprobs(logprobs, ctx)
    return {"ppl": math.exp(-sum(values) / len(values)), "scored_tokens": len(values), "chunks": len(chunks),
            "seconds": time.monotonic() - started}


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Perplexity: tokenfleet vs llama.cpp on the original GGUF ({result['started']})", "",
             f"Text: `{a['text']}` ({result['text_chars']} characters). Both sides score llama.cpp's tokenization of "
             "it with llama-perplexity's protocol (chunks of `ctx` tokens, first token replaced by BOS, second half "
             "of each chunk scored). tokenfleet: the engine in each config (weights: `none` dequantized from the GGUF "
             "by our import, `gguf` the GGUF's tensors kept quantized, `int8` int8 weights and activations; quantized "
             f"configs prefill {a['quantized_chunk']} tokens a step, through the decode-sized kernels); llama.cpp: "
             "`llama-perplexity -c ctx -b ctx` on the GGUF itself (its quantized kernels, f16 KV cache), "
             f"{a['threads']} threads. Machine: {result['machine']}. git {result['git']}.", "",
             "| model | GGUF | tokens | same ids from our tokenizer | ctx | chunks | llama.cpp PPL | weights | dtype | "
             "tokenfleet PPL | ratio | pass (within {:.0%}) |".format(a["tolerance"]),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | `{Path(r['gguf']).name}` | {r['tokens']} | {r['same_ids']} | {r['ctx']} | "
                     f"{r['llama']['chunks']} | {r['llama']['ppl']:.4f} ± {r['llama']['ppl_error']:.4f} | "
                     f"{r.get('quantization') or 'none'} | {r.get('dtype', a.get('dtype'))} | "
                     f"{r['ours']['ppl']:.4f} | {r['ratio']:.4f} | {'yes' if r['pass'] else 'NO'} |")
    pairs = result.get("int8_vs_bf16") or []
    if pairs:
        lines += ["", "int8 against the same model's bf16 (same text, same protocol; bar: within 2 %):", ""]
        lines += [f"- {p['model']} ctx {p['ctx']}: int8 {p['int8']:.4f}, bf16 {p['bf16']:.4f}, ratio "
                  f"{p['ratio']:.4f} ({'pass' if abs(p['ratio'] - 1) <= 0.02 else 'MISS'})" for p in pairs]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bin", required=True, help="folder of llama-perplexity and llama-tokenize")
    parser.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2-135m-instruct"])
    parser.add_argument("--ctx", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--configs", nargs="+", default=["none:float32", "gguf:float32", "int8:float32", "none:bfloat16"],
                        help="QUANTIZATION:DTYPE of our engine to score (QUANTIZATION none, gguf or int8)")
    parser.add_argument("--quantized-chunk", type=int, default=32,
                        help="prefill tokens a step for quantized configs (0: the engine's default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--text", default=str(TEXT))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" /
                                             f"{time.strftime('%Y-%m-%d')}-cpu-gguf-perplexity.json"))
    args = parser.parse_args()
    os.environ.setdefault("TOKENFLEET_THREADS", str(args.threads))

    from tokenfleet.llm import LLM
    from tokenfleet.models.gguf_import import QUANTIZED_SUFFIX, ensure_model, source
    from tokenfleet.models.quant_linear import INT8_ROWS

    bin_dir = Path(args.llama_bin)
    # llama-perplexity's -f drops one trailing newline and llama-tokenize's does not: give both a text without one
    content = Path(args.text).read_text().rstrip("\n")
    text = Path(tempfile.mkdtemp(prefix="ppl-")) / "text.txt"
    text.write_text(content)
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": git_head(),
                    "machine": machine_line(), "text_chars": len(content), "rows": []}
    configs = [tuple(c.split(":", 1)) for c in args.configs]
    for name in args.models:
        gguf = source(name).path
        tokens = llama_tokens(bin_dir, gguf, text)
        bos = tokens[0] if len(tokens) == len(llama_tokens(bin_dir, gguf, text, bos=False)) + 1 else None
        ctxs = [c for c in args.ctx if len(tokens) >= 2 * c]
        theirs = {ctx: llama_perplexity(bin_dir, gguf, text, ctx, args.threads) for ctx in ctxs}
        for quantization, dtype in configs:
            quantized = quantization != "none"
            folder = ensure_model(name + QUANTIZED_SUFFIX if quantization == "gguf" else name)
            options = {"max_prefill_chunk": INT8_ROWS if quantization == "int8" else args.quantized_chunk} \
                if quantized and args.quantized_chunk else {}
            llm = LLM(model=str(folder), dtype=dtype, max_model_len=max(args.ctx) + 1,
                      quantization="" if not quantized else quantization, **options)
            same = same_ids(llm.tokenizer, llm.tokenizer.encode_prompt(content), tokens)
            for ctx in ctxs:
                ours = our_perplexity(llm, tokens, ctx, bos)
                ratio = ours["ppl"] / theirs[ctx]["ppl"]
                row = {"model": name, "gguf": str(gguf), "tokens": len(tokens), "same_ids": same, "ctx": ctx,
                       "quantization": "" if not quantized else quantization, "dtype": dtype,
                       "llama": theirs[ctx], "ours": ours, "ratio": ratio, "pass": abs(ratio - 1) <= args.tolerance}
                result["rows"].append(row)
                print(f"{name} ctx {ctx} {quantization}:{dtype}: llama.cpp {theirs[ctx]['ppl']:.4f}, tokenfleet "
                      f"{ours['ppl']:.4f} ({ratio:.4f})", flush=True)
            del llm
    by = {(r["model"], r["ctx"], r["quantization"], r["dtype"]): r["ours"]["ppl"] for r in result["rows"]}
    result["int8_vs_bf16"] = [
        {"model": m, "ctx": c, "int8": ppl, "bf16": by[(m, c, "", "bfloat16")], "ratio": ppl / by[(m, c, "", "bfloat16")]}
        for (m, c, q, _), ppl in by.items() if q == "int8" and (m, c, "", "bfloat16") in by]
    write_report(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
