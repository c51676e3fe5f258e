"""What a TensorRT-LLM worker builds: the LLM class and its constructor arguments, from the
model's registry record and the worker's flags. Pure: the API module is passed in."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tokenfleet.engine.spec_decode import trtllm_speculative_config

TRT_ENGINE, PYTORCH = "trt", "pytorch"
TRANSCEIVERS = ("DEFAULT", "UCX", "NIXL", "MPI")
ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class TrtllmSpec:
    """One TensorRT-LLM instance. ``model``: a TRT engine dir (``kind="trt"``) or an HF / ModelOpt
    checkpoint (``kind="pytorch"``)."""

    model: str
    kind: str = TRT_ENGINE
    tokenizer: str | None = None  # HF tokenizer folder; engine dirs hold none (end_id, stop strings, text)
    role: str = "both"  # prefill: context_only requests; decode: generation_only; both: aggregated
    tensor_parallel_size: int = 1
    kv_free_gpu_memory_fraction: float = 0.85
    kv_max_gpu_bytes: int = 0  # 0: no byte cap (the fraction alone)
    kv_fp8: bool = True  # pytorch: KvCacheConfig(dtype="fp8"); trt: FP8 KV must be baked into the engine
    block_reuse: bool = True  # prefix caching
    tokens_per_block: int = 32  # must match between prefill and decode instances
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    enable_chunked_prefill: bool = True
    guided_decoding_backend: str | None = "xgrammar"  # the TRT backend accepts only xgrammar
    transceiver: str = "UCX"
    kv_transfer_timeout_ms: int = 60_000  # always set (reference §10.2: leaked blocks otherwise)
    gather_generation_logits: bool = False  # TRT engines: needed for logprobs (costs memory; bug #10810)
    speculative: dict[str, Any] | None = None  # passed as speculative_config ({"decoding_type": ..., ...})
    extra: dict[str, Any] = field(default_factory=dict)  # further LLM(...) kwargs, verbatim

    def __post_init__(self) -> None:
        if self.kind not in (TRT_ENGINE, PYTORCH):
            raise ValueError(f"TensorRT-LLM kind must be {TRT_ENGINE!r} or {PYTORCH!r}, got {self.kind!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.transceiver not in TRANSCEIVERS:
            raise ValueError(f"transceiver must be one of {', '.join(TRANSCEIVERS)}, got {self.transceiver!r}")
        if self.kv_transfer_timeout_ms <= 0:
            raise ValueError("kv_transfer_timeout_ms must be positive")
        if not 0 < self.kv_free_gpu_memory_fraction <= 1:
            raise ValueError("kv_free_gpu_memory_fraction must be in (0, 1]")
        if self.kind == TRT_ENGINE and self.guided_decoding_backend not in (None, "xgrammar"):
            raise ValueError("the TRT-engine backend supports only the xgrammar guided decoding backend")

    @classmethod
    def from_record(cls, record: Any, role: str, **overrides: Any) -> TrtllmSpec:
        """From a registry ModelRecord (backend "trtllm"): ``quantization`` "fp8" means FP8 weights
        and KV, ``kv_cache_dtype`` "fp8" FP8 KV; ``default_sampling`` is not ours to read. A record path ending in an engine dir
        (``rank0.engine`` inside) is a TRT engine; anything else a checkpoint for the PyTorch backend."""
        from pathlib import Path

        kind = TRT_ENGINE if (Path(record.path) / "rank0.engine").exists() else PYTORCH
        options = {"model": record.path, "kind": kind, "role": role, "tokenizer": getattr(record, "tokenizer", "") or None,
                   "tensor_parallel_size": record.tensor_parallel_size,
                   "kv_fp8": "fp8" in (record.quantization, getattr(record, "kv_cache_dtype", ""))}
        if kind == PYTORCH:
            options["guided_decoding_backend"] = "llguidance"
        if getattr(record, "speculative_config", ""):
            options["speculative"] = json.loads(record.speculative_config)
        # None means "not given", except for the guided backend, where it means "off".
        given = {k: v for k, v in overrides.items() if v is not None or k == "guided_decoding_backend"}
        if kind == TRT_ENGINE:  # what the build baked in wins over the record; a contradicting flag is an error
            baked = engine_facts(record.path)
            for key, value in baked.items():
                if key in given and given[key] != value:
                    raise ValueError(f"{record.path} was built with {key}={value!r}; the worker was given {given[key]!r}")
            options.update(baked)
        options.update(given)
        return cls(**options)


def engine_facts(path: str) -> dict[str, Any]:
    """What a TRT engine dir's ``config.json`` fixes at build time: the KV dtype (FP8 KV is baked in,
    ``kv_cache_quant_algo``), tokens per block (``plugin_config``; prefill and decode instances must
    agree, and routers hash prompts by it) and the TP size. Keys a build does not write are left out."""
    from pathlib import Path

    file = Path(path) / "config.json"
    if not file.exists():
        return {}
    config = json.loads(file.read_text())
    pretrained, build = config.get("pretrained_config", {}), config.get("build_config", {})
    facts: dict[str, Any] = {}
    quant = pretrained.get("quantization") or {}
    if "kv_cache_quant_algo" in quant:
        facts["kv_fp8"] = str(quant["kv_cache_quant_algo"] or "").upper() == "FP8"
    block = (build.get("plugin_config") or {}).get("tokens_per_block") or build.get("tokens_per_block")
    if block:
        facts["tokens_per_block"] = int(block)
    tp = (pretrained.get("mapping") or {}).get("tp_size")
    if tp:
        facts["tensor_parallel_size"] = int(tp)
    return facts


def llm_class(api: Any, spec: TrtllmSpec) -> Any:
    """``_tensorrt_engine.LLM`` for engine dirs (the default ``tensorrt_llm.LLM`` cannot load them)."""
    if spec.kind == TRT_ENGINE:
        return api.TrtEngineLLM
    return api.LLM


def llm_kwargs(api: Any, spec: TrtllmSpec) -> dict[str, Any]:
    """Constructor kwargs (the args classes are strict: only fields they define)."""
    kv: dict[str, Any] = {"enable_block_reuse": spec.block_reuse,
                          "free_gpu_memory_fraction": spec.kv_free_gpu_memory_fraction,
                          "tokens_per_block": spec.tokens_per_block,
                          "event_buffer_max_size": 1024 if spec.block_reuse else 0}  # KV events for routing
    if spec.kv_max_gpu_bytes:
        kv["max_gpu_total_bytes"] = spec.kv_max_gpu_bytes
    if spec.kind == PYTORCH and spec.kv_fp8:
        kv["dtype"] = "fp8"  # PyTorch backend only; TRT engines carry FP8 KV from their build
    kwargs: dict[str, Any] = {
        "tokenizer": spec.tokenizer,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "kv_cache_config": api.KvCacheConfig(**kv),
        "enable_chunked_prefill": spec.enable_chunked_prefill,
    }
    if spec.guided_decoding_backend:
        kwargs["guided_decoding_backend"] = spec.guided_decoding_backend
    if spec.max_batch_size:
        kwargs["max_batch_size"] = spec.max_batch_size
    if spec.max_num_tokens:
        kwargs["max_num_tokens"] = spec.max_num_tokens
    # Always: a "both" worker registers as a prefill replica too, and context_only requests need the
    # transceiver; never without a timeout (blocks of a request no decode side pulls stay pinned until it).
    kwargs["cache_transceiver_config"] = api.CacheTransceiverConfig(
        backend=spec.transceiver, kv_transfer_timeout_ms=spec.kv_transfer_timeout_ms)
    if spec.speculative:  # the record's JSON, shared with the torch engine; keys only that engine reads dropped
        kwargs["speculative_config"] = trtllm_speculative_config(spec.speculative)
    if spec.kind == TRT_ENGINE and spec.gather_generation_logits:
        kwargs["gather_generation_logits"] = True
    if kwargs["tokenizer"] is None:
        del kwargs["tokenizer"]  # a checkpoint carries its own
    if spec.kind == PYTORCH:
        kwargs["enable_iter_perf_stats"] = True  # get_stats needs it on the PyTorch backend
        if spec.role == "prefill":
            kwargs["disable_overlap_scheduler"] = True  # upstream's context servers run without it
    kwargs.update(spec.extra)
    return kwargs


def load_api() -> SimpleNamespace:
    """The parts of ``tensorrt_llm`` we use, imported now (only a trtllm worker calls this)."""
    trt = importlib.import_module("tensorrt_llm")
    llmapi = importlib.import_module("tensorrt_llm.llmapi")
    engine = importlib.import_module("tensorrt_llm._tensorrt_engine")
    utils = importlib.import_module("tensorrt_llm.executor.utils")
    return SimpleNamespace(
        LLM=trt.LLM, TrtEngineLLM=engine.LLM, SamplingParams=trt.SamplingParams,
        DisaggregatedParams=llmapi.DisaggregatedParams, KvCacheConfig=llmapi.KvCacheConfig,
        CacheTransceiverConfig=llmapi.CacheTransceiverConfig,
        GuidedDecodingParams=_guided_params_class(trt, llmapi), RequestError=utils.RequestError,
    )


def _guided_params_class(*modules: Any) -> Any:
    for module in modules:
        cls = getattr(module, "GuidedDecodingParams", None)
        if cls is not None:
            return cls
    sampling = importlib.import_module("tensorrt_llm.sampling_params")
    return sampling.GuidedDecodingParams
