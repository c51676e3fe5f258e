"""`tokenfleet plan`: the capacity arithmetic of ``planning.calc``, from flags to a table (or JSON)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tokenfleet.planning.calc import DTYPE_BYTES, GB, GPUS, MODELS, WEIGHT_DTYPES, Layout, Model, Plan, plan
from tokenfleet.planning.gguf_size import gguf_bytes_per_param


def add_command(sub: Any) -> None:
    p = sub.add_parser("plan", help="capacity arithmetic: memory, KV budget, concurrency, roofline speeds, replicas")
    p.add_argument("--model", default="llama3-70b",
                   help=f"a preset ({', '.join(MODELS)}) or an HF config.json")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--weight-dtype", default="fp8", choices=sorted(WEIGHT_DTYPES),
                   help="gguf: a GGUF's own block types (--gguf FILE, else planning.calc.GGUF_DEFAULT_BITS)")
    p.add_argument("--gguf", metavar="FILE", help="weights as this GGUF ships them: bytes per parameter from its tensor "
                                                  "types (sets --weight-dtype gguf)")
    p.add_argument("--kv-dtype", default="fp8", choices=sorted(DTYPE_BYTES))
    p.add_argument("--weights-gb", type=float, help="weight bytes per replica (default: parameters x dtype)")
    p.add_argument("--reserve-gb", type=float, default=10.0, help="per replica: activations, graphs, headroom")
    p.add_argument("--context", type=int, default=4096, help="tokens per resident request (prompt + output)")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64, help="requests per decode step")
    p.add_argument("--target-tps", type=float, help="aggregate output tokens/s to serve")
    p.add_argument("--prefill-efficiency", type=float, default=0.5)
    p.add_argument("--decode-efficiency", type=float, default=0.7)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(a: argparse.Namespace) -> int:
    model = MODELS[a.model] if a.model in MODELS else Model.from_config(a.model)
    layout = Layout(GPUS[a.gpu], a.tp, a.pp, "gguf" if a.gguf else a.weight_dtype, a.kv_dtype, a.reserve_gb * GB,
                    a.prefill_efficiency, a.decode_efficiency, gguf_bytes_per_param(a.gguf) if a.gguf else None)
    weights = a.weights_gb * GB if a.weights_gb else None
    result = plan(model, layout, a.context, a.prompt_tokens, a.batch, a.target_tps, weights)
    if a.json:
        print(json.dumps({"model": model.name, "gpu": layout.gpu.name, "tp": layout.tp, "pp": layout.pp,
                          **result.as_dict()}, indent=2))
        return 0
    rows = [
        ("model", f"{model.name} ({model.num_params / 1e9:.1f} B parameters)"),
        ("layout", f"{layout.num_gpus} x {layout.gpu.name} (TP {layout.tp}, PP {layout.pp}), weights "
                   f"{layout.weight_dtype}, KV {layout.kv_dtype}"),
        ("weights per GPU", f"{result.weight_bytes_per_gpu / GB:.1f} GB"),
        ("KV per token", f"{result.kv_bytes_per_token / 1e3:.0f} KB" + _window_note(model, result, a.context)),
        ("KV budget", f"{result.kv_budget_bytes / GB:.0f} GB (after {a.reserve_gb:.0f} GB reserve)"),
        ("resident tokens", f"{result.resident_tokens:,}"),
        ("max concurrent", f"{result.max_concurrent:,} requests of {a.context:,} tokens"
                           + (f" ({result.full_max_concurrent:,} with full-context KV)" if model.window else "")),
        ("prefill", f"{result.prefill_seconds * 1000:.0f} ms per {a.prompt_tokens:,}-token prompt"),
        ("decode step", f"{result.decode_step_seconds * 1000:.1f} ms at batch {a.batch} x {a.context:,} tokens"),
        ("tokens/s per replica", f"{result.tokens_per_s:,.0f}"),
    ]
    if result.replicas_for_target is not None:
        rows.append(("replicas", f"{result.replicas_for_target} for {a.target_tps:,.0f} tokens/s "
                                 f"({result.replicas_for_target * layout.num_gpus} GPUs)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _window_note(model: Model, result: Plan, context: int) -> str:
    if model.window is None:
        return ""
    return (f" at {context:,} tokens ({model.num_sliding_layers} of {model.num_layers} layers keep a {model.window:,}-token "
            f"window; {result.full_kv_bytes_per_token / 1e3:.0f} KB with full-context KV)")
