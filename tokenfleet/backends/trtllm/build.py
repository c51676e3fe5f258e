"""FP8 TensorRT engines for H100: ModelOpt quantization, ``trtllm-build``, an accuracy gate, and
the registry record (``tokenfleet engines build`` / ``tokenfleet engines gate``).

The build is the classic, reproducible route (shared/reference/trtllm-api.md §5 A), run inside
the TensorRT-LLM image: ``examples/quantization/quantize.py --qformat fp8 --kv_cache_dtype fp8``
(TP fixed at conversion) then ``trtllm-build`` with paged and FP8 context FMHA and context logits
gathered (the gate's perplexity needs them). FP8 accuracy regressions recur per model and per
release, so an engine is registered ``ready`` only when the gate passes: perplexity on a bundled
text within ``max_ppl_increase`` of the bf16 checkpoint's, and greedy continuations of fixed
prompts agreeing with the bf16 ones for at least ``min_agreement`` of their tokens (up to the
first divergence). Otherwise it is registered ``disabled`` with the figures in its description.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLE_TEXT = Path(__file__).with_name("eval_sample.txt")
GATE_PROMPTS = (
    "The three primary colors are",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "The capital of France is",
    "In 1969, the first humans to walk on the Moon were",
    "A haiku about autumn:",
    "To make a cup of tea, first",
    "The chemical symbol for gold is",
)


@dataclass(frozen=True)
class BuildPlan:
    checkpoint: str  # HF bf16 checkpoint
    output: str  # engine dir
    tp: int = 1
    max_batch_size: int = 256
    max_num_tokens: int = 8192
    max_seq_len: int = 8192
    calib_size: int = 512
    examples_dir: str = "/app/tensorrt_llm/examples"  # in the NGC TensorRT-LLM release image

    @property
    def quantized_dir(self) -> str:
        return f"{self.output}.ckpt"

    def commands(self) -> list[list[str]]:
        quantize = [sys.executable, f"{self.examples_dir}/quantization/quantize.py", "--model_dir", self.checkpoint,
                    "--dtype", "bfloat16", "--qformat", "fp8", "--kv_cache_dtype", "fp8",
                    "--calib_size", str(self.calib_size), "--tp_size", str(self.tp),
                    "--output_dir", self.quantized_dir]
        build = ["trtllm-build", "--checkpoint_dir", self.quantized_dir, "--output_dir", self.output,
                 "--gemm_plugin", "auto", "--use_fp8_context_fmha", "enable", "--use_paged_context_fmha", "enable",
                 "--gather_context_logits",  # prompt logprobs, for the gate's perplexity
                 "--max_batch_size", str(self.max_batch_size), "--max_num_tokens", str(self.max_num_tokens),
                 "--max_seq_len", str(self.max_seq_len), "--workers", str(self.tp)]
        return [quantize, build]


@dataclass(frozen=True)
class GateResult:
    reference_ppl: float
    engine_ppl: float
    agreement: float  # mean share of greedy tokens equal to the reference's, up to the first divergence
    passed: bool
    reasons: tuple[str, ...]

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED: " + "; ".join(self.reasons)
        return (f"FP8 gate {verdict} (perplexity {self.engine_ppl:.3f} vs bf16 {self.reference_ppl:.3f}, "
                f"greedy agreement {self.agreement:.0%})")


def perplexity(token_logprobs: Sequence[float]) -> float:
    if not token_logprobs:
        raise ValueError("no logprobs to score")
    return math.exp(-sum(token_logprobs) / len(token_logprobs))


def agreement(reference: Sequence[int], candidate: Sequence[int]) -> float:
    """Share of the reference's tokens the candidate reproduces before it first diverges."""
    if not reference:
        return 1.0
    same = 0
    for a, b in zip(reference, candidate):
        if a != b:
            break
        same += 1
    return same / len(reference)


def judge(reference_ppl: float, engine_ppl: float, agreements: Sequence[float], max_ppl_increase: float = 0.05,
          min_agreement: float = 0.5) -> GateResult:
    reasons = []
    if not engine_ppl <= reference_ppl * (1 + max_ppl_increase):  # also catches NaN
        reasons.append(f"perplexity {engine_ppl:.3f} exceeds bf16 {reference_ppl:.3f} by more than "
                       f"{max_ppl_increase:.0%}")
    mean = sum(agreements) / len(agreements) if agreements else 0.0
    if mean < min_agreement:
        reasons.append(f"greedy agreement {mean:.0%} is below {min_agreement:.0%}")
    return GateResult(reference_ppl, engine_ppl, mean, not reasons, tuple(reasons))


async def measure(api: Any, llm: Any, prompts: Sequence[list[int]], text: list[int], max_tokens: int = 32
                  ) -> tuple[float, list[list[int]]]:
    """(perplexity of ``text``, greedy continuations of ``prompts``) from one LLM instance."""
    scored = llm.generate_async(text, sampling_params=api.SamplingParams(max_tokens=1, top_k=1, prompt_logprobs=0))
    result = await scored.aresult()
    values = []
    for entry in result.outputs[0].prompt_logprobs or []:
        if entry:  # {token id: Logprob} for the prompt token at this position
            values.append(float(next(iter(entry.values())).logprob) if isinstance(entry, dict) else float(entry))
    greedy = []
    for prompt in prompts:
        out = await llm.generate_async(prompt, sampling_params=api.SamplingParams(max_tokens=max_tokens, top_k=1,
                                                                                 ignore_eos=True)).aresult()
        greedy.append(list(out.outputs[0].token_ids))
    return perplexity(values), greedy


async def run_gate(api: Any, engine_dir: str, reference_dir: str, tokenize: Any, tp: int = 1,
                   max_ppl_increase: float = 0.05, min_agreement: float = 0.5) -> GateResult:
    prompts = [tokenize(p) for p in GATE_PROMPTS]
    text = tokenize(SAMPLE_TEXT.read_text())
    reference = api.LLM(model=reference_dir, tensor_parallel_size=tp)  # bf16 through the PyTorch backend
    try:
        ref_ppl, ref_greedy = await measure(api, reference, prompts, text)
    finally:
        reference.shutdown()
    engine = api.TrtEngineLLM(model=engine_dir, tokenizer=reference_dir, tensor_parallel_size=tp)  # no tokenizer inside
    try:
        eng_ppl, eng_greedy = await measure(api, engine, prompts, text)
    finally:
        engine.shutdown()
    return judge(ref_ppl, eng_ppl, [agreement(r, c) for r, c in zip(ref_greedy, eng_greedy)], max_ppl_increase,
                 min_agreement)


def record_for(plan: BuildPlan, name: str, version: str, result: GateResult | None) -> Any:
    from tokenfleet.cluster.registry import ModelRecord

    return ModelRecord(name=name, version=version, path=str(Path(plan.output).resolve()), backend="trtllm",
                       quantization="fp8", tensor_parallel_size=plan.tp, tokenizer=plan.checkpoint,
                       max_model_len=plan.max_seq_len, status="ready" if result is not None and result.passed
                       else "disabled",
                       description=result.describe() if result is not None else "FP8 engine; accuracy not gated")
