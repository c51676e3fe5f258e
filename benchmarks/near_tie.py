"""How a bf16 greedy answer at a near-tie depends on rounding: the default model's first token for "What is the
capital of France?" ("The" or "L").

Reported: the first token's top-2 logprob margin in fp32, with the native bf16 kernels and with the torch reference
kernels in bf16; the same margin when a one-ulp (bf16) change is made to a random share of every layer's attention
outputs (8 seeds per share), i.e. rounding that differs from ours as another CPU's instructions would; and the
model's greedy continuation when its first token is "L", to compare with what a machine that picks "L" answers.

    .venv/bin/python benchmarks/near_tie.py [--out benchmarks/reports/near-tie.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from serving.report import git_head, machine_line, write_report

from tokenfleet.engine.request_spec import RequestSpec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
THE, L = 504, 60  # the two tokens


def margins(core, ids: list[int], seeds: int, share: float) -> list[float]:
    """The first token's logprob("The") - logprob("L") per seed, attention outputs perturbed in ``share`` of places."""
    from tokenfleet.engine.sampling_params import SamplingParams

    model = core.runner.model
    attend = model.attention

    class OneUlp:
        handles_prefill = attend.handles_prefill

        def __init__(self, seed: int):
            self.g = torch.Generator().manual_seed(seed)

        def __call__(self, q, k, v, meta):
            out = attend(q, k, v, meta).float()
            if not share:
                return out.to(q.dtype)
            ulp = out.abs().clamp(min=1e-30).log2().floor().exp2() * 2**-7
            flip = (torch.rand(out.shape, generator=self.g) < share).float()
            sign = torch.randint(0, 2, out.shape, generator=self.g).float() * 2 - 1
            return (out + flip * sign * ulp).to(q.dtype)

    found = []
    for seed in range(seeds):
        model.attention = OneUlp(seed)
        rid = f"{share}-{seed}"
        core.add_request(RequestSpec(ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), request_id=rid,
                                     cache_scope=rid))  # no prefix-cache hits between seeds
        while core.has_unfinished():
            for out in core.step():
                top = dict(out.logprobs[0].top)
                found.append(top.get(THE, -99.0) - top.get(L, -99.0))
    model.attention = attend
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "near-tie.json"))
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    from tests.model.helpers import greedy, make_core, run_to_completion
    from tokenfleet.api.chat_template import render_chat
    from tokenfleet.models.gguf_import import ensure_default_model

    model_dir = ensure_default_model()
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_line(), "commit": git_head()}
    cores = {"fp32": make_core(model_dir, dtype="float32", num_blocks=256),
             "bf16 native kernels": make_core(model_dir, dtype="bfloat16", num_blocks=256)}
    os.environ["TOKENFLEET_KERNELS"] = "torch"
    cores["bf16 torch reference kernels"] = make_core(model_dir, dtype="bfloat16", num_blocks=256)
    del os.environ["TOKENFLEET_KERNELS"]
    tok = cores["fp32"].tokenizer
    ids = tok.encode(render_chat(tok, PROMPT))
    result["margin"] = {name: margins(core, ids, 1, 0.0)[0] for name, core in cores.items()}
    native = cores["bf16 native kernels"]
    result["perturbed"] = {str(share): margins(native, ids, args.seeds, share) for share in (2e-5, 2e-3, 5e-2)}
    forced = run_to_completion(native, {0: [("forced", ids + [L], greedy(24))]})["forced"]
    result["after_L"] = "L" + tok.decode(forced)
    write_report(args.out, result, markdown(result))


def markdown(r: dict) -> str:
    lines = [f"# A bf16 near-tie: the first token of \"What is the capital of France?\" ({r['started']})", "",
             f"Machine: {r['machine']}; commit {r['commit']}.", "",
             "logprob(\"The\") - logprob(\"L\") of the first token (positive: \"The capital of France is Paris.\"):", "",
             "| path | margin |", "|---|---|"]
    lines += [f"| {name} | {m:.3f} |" for name, m in r["margin"].items()]
    lines += ["", "bf16 native kernels with a one-ulp change in a share of every layer's attention outputs, per seed:", "",
              "| share changed | margins | answers \"L\" |", "|---|---|---|"]
    for share, found in r["perturbed"].items():
        lines.append(f"| {float(share):.3%} | {', '.join(f'{m:.3f}' for m in found)} | "
                     f"{sum(m < 0 for m in found)} of {len(found)} |")
    lines += ["", f"Greedy continuation after \"L\": {r['after_L']!r}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
