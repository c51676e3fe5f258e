"""A worker's TensorRT-LLM engine from its flags and the model's registry record.

TP > 1 runs under MPI: ``mpirun -n TP trtllm-llmapi-launch python -m tokenfleet.services.decode
--backend trtllm ...`` (rank 0 runs this process; the others run TensorRT-LLM's workers)."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from tokenfleet import envs
from tokenfleet.backends.trtllm.engine import TrtllmEngine
from tokenfleet.backends.trtllm.spec import TrtllmSpec, load_api


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TensorRT-LLM backend (--backend trtllm)")
    g.add_argument("--tensor-parallel-size", type=int, help="default: the registry record's")
    g.add_argument("--tokenizer", help="HF tokenizer folder (default: the registry record's; engine dirs have none)")
    g.add_argument("--gather-generation-logits", action="store_true",
                   help="TRT engines: allow logprobs (the engine gathers generation logits; more memory)")
    g.add_argument("--kv-free-gpu-memory-fraction", type=float, default=0.85,
                   help="share of the GPU memory free after loading that the KV cache takes")
    g.add_argument("--kv-max-gpu-bytes", type=int, default=0, help="KV cache byte cap (0: the fraction alone)")
    g.add_argument("--tokens-per-block", type=int,
                   help="KV block size; equal on prefill and decode (default: the engine's build, else 32)")
    g.add_argument("--transceiver", default="UCX", choices=["DEFAULT", "UCX", "NIXL", "MPI"],
                   help="KV transfer backend between prefill and decode instances")
    g.add_argument("--kv-transfer-timeout-ms", type=int, default=60_000,
                   help="context KV not pulled by then is freed (always set: blocks leak otherwise)")
    g.add_argument("--guided-decoding-backend", choices=["xgrammar", "llguidance", "none"],
                   help="default: xgrammar for TRT engines, llguidance for checkpoints")
    g.add_argument("--speculative-config", help="speculative decoding, JSON in TensorRT-LLM's speculative_config "
                   "schema (default: the registry record's). The torch engine: "
                   '\'{"decoding_type": "NGram", "max_draft_len": 5}\' (prompt lookup, switched by load); '
                   'TensorRT-LLM: any of its types, e.g. \'{"decoding_type": "Eagle", "max_draft_len": 4, '
                   '"speculative_model": "/eagle"}\'')


def model_limits(path: str) -> tuple[int, int, str]:
    """(vocab size, max sequence length, dtype tag) from an engine dir's or checkpoint's config.json."""
    config = json.loads((Path(path) / "config.json").read_text())
    pretrained = config.get("pretrained_config", config)  # TRT engine dirs nest the model config
    build = config.get("build_config", {})
    vocab = int(pretrained["vocab_size"])
    max_len = int(build.get("max_seq_len") or pretrained.get("max_position_embeddings") or 0)
    if not max_len:
        raise ValueError(f"{path}/config.json names no max_seq_len or max_position_embeddings")
    return vocab, max_len, str(pretrained.get("dtype", pretrained.get("torch_dtype", "auto")))


def api_loader_from_env() -> Any:
    """``TOKENFLEET_TRTLLM_API=module:function`` replaces ``load_api`` (the tests point it at the
    in-repo test double of the API; a site can point it at a patched build)."""
    target = envs.trtllm_api()
    if not target:
        return load_api
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_engine(args: argparse.Namespace, record: Any | None, api_loader: Any = None) -> TrtllmEngine:
    role = "both" if args.role == "both" else args.role
    guided = args.guided_decoding_backend
    overrides: dict[str, Any] = {
        "kv_free_gpu_memory_fraction": args.kv_free_gpu_memory_fraction,
        "kv_max_gpu_bytes": args.kv_max_gpu_bytes, "tokens_per_block": args.tokens_per_block,
        "transceiver": args.transceiver, "kv_transfer_timeout_ms": args.kv_transfer_timeout_ms,
        "max_batch_size": args.max_num_running, "max_num_tokens": args.max_num_batched_tokens,
        "tensor_parallel_size": args.tensor_parallel_size, "tokenizer": args.tokenizer,
        "gather_generation_logits": args.gather_generation_logits or None,
        "speculative": json.loads(args.speculative_config) if args.speculative_config else None,
    }
    if guided is not None:
        overrides["guided_decoding_backend"] = None if guided == "none" else guided
    if record is None:
        if not args.model:
            raise SystemExit("--backend trtllm needs --model (an engine dir or checkpoint) or --registry")
        record = _Bare(args.model)
    spec = TrtllmSpec.from_record(record, role, **overrides)
    vocab, max_len, dtype = model_limits(spec.model)
    if args.max_model_len:
        max_len = min(max_len, args.max_model_len)
    salt = f"{Path(spec.model).name}|trtllm-{'fp8' if spec.kv_fp8 else dtype}|{spec.tokens_per_block}"
    return TrtllmEngine(spec, salt, vocab, max_len, api_loader=api_loader or api_loader_from_env(),
                        transfer_timeout=args.kv_transfer_timeout_ms / 1000)


class _Bare:
    """A record's fields for a model given by path alone (FP8 when its config says so)."""

    def __init__(self, path: str):
        self.path, self.tensor_parallel_size = path, 1
        config = json.loads((Path(path) / "config.json").read_text())
        quant = config.get("pretrained_config", config).get("quantization") or config.get("quantization_config") or {}
        fp8 = "FP8" in str(quant.get("quant_algo", "")).upper() or "FP8" in str(quant.get("kv_cache_quant_algo", ""))
        self.quantization = "fp8" if fp8 else ""
