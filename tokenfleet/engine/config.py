"""Engine configuration: one frozen object, each component gets its own slice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenfleet.engine.itl_guard import Objectives
from tokenfleet.engine.scheduler import SchedulerConfig
from tokenfleet.engine.spec_decode import SpecConfig


@dataclass(frozen=True)
class EngineConfig:
    model: str  # path of an HF folder (config.json, *.safetensors, tokenizer.json)
    # "auto": the fastest dtype here (models.auto_dtype): bfloat16 on GPUs, with FP8 weights and on CPUs where bf16
    # measured faster (AVX512-BF16, AMX), float32 on CPUs without bf16 dot products
    dtype: str = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # KV budget; ignored when num_blocks is set
    num_blocks: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    max_num_running: int = 128
    max_num_waiting: int = 1024
    max_prefill_chunk: int = 0
    enable_prefix_caching: bool = True
    fair_queuing: bool = True  # tenants of one priority by virtual token counters (engine.fair_queue)
    fair_prompt_weight: float = 1.0  # counter cost of one computed prompt token (prefix-cache hits are free)
    fair_output_weight: float = 2.0  # counter cost of one generated token
    num_threads: int | None = None  # CPU torch threads; None = TOKENFLEET_NUM_THREADS or all usable cores
    # CPU torch threads of steps of at most backends.torch.device.SMALL_STEP_TOKENS tokens (one stream's decode);
    # None: num_threads (device.small_step_threads)
    small_step_threads: int | None = None
    # Second KV tier (engine.kv_tier): "" (none), "memory" or "disk:DIR"; its byte budget, a per-tenant
    # quota (0: none) and an optional AES key file (16, 24 or 32 bytes, or 32-64 hex digits) sealing its records
    kv_tier: str = ""
    kv_tier_bytes: int = 4 << 30
    kv_tier_tenant_bytes: int = 0
    kv_tier_key_file: str = ""
    # Retention (engine.retention): a request's retention_s is clamped to kv_retention_max_s in the pool and to
    # kv_retention_tier_max_s in the second tier (with one); one tenant's conversations retain at most
    # kv_retention_tenant_blocks distinct blocks, pool and tier together (0: no quota)
    kv_retention_max_s: float = 300.0
    kv_retention_tier_max_s: float = 86400.0
    kv_retention_tenant_blocks: int = 0
    # Speculative decoding (engine.spec_decode.SpecConfig.parse): the registry record's speculative_config JSON,
    # e.g. {"decoding_type": "NGram", "max_draft_len": 5}; "" = off
    speculative_config: str = ""
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) loaded at start
    # the registry record's: "" (the checkpoint's weights), "fp8" (FP8 weights, per-channel scales: models.linear) or
    # "gguf" (the GGUF file's own block-quantized tensors: models.gguf_weights) or "int8" (int8 weights and
    # activations: models.loader)
    quantization: str = ""
    # the registry record's: "" (the model's dtype) or "fp8" (e4m3 with per-token, per-head scales: models.kv_fp8)
    kv_cache_dtype: str = ""
    # CUDA: decode steps of up to this many requests replay captured graphs; 0 = min(max_num_running, 256)
    cuda_graph_max_batch: int = 0
    # Overlapped scheduling (CoreParts.overlap): the next decode step is queued on the device before the
    # host reads this one's tokens. Off by default until measured on a GPU (benchmarks/gpu_step.py).
    async_scheduling: bool = False
    # A step beside decoding streams takes at most this times a decode-only step: prompt chunks get the rest
    # (engine.itl_guard); 0 = off (chunks up to max_num_batched_tokens whatever decodes); off with async_scheduling
    itl_guard: float = 1.5
    # The objectives the replica serves (engine.itl_guard.Objectives): TTFT <= ttft_slo_ms + ttft_slo_per_token_ms
    # x prompt tokens, TPOT <= tpot_slo_ms. With the ITL guard on, a long prompt whose TTFT deadline is at risk at
    # itl_guard's pace may take steps of up to 0.8 x tpot_slo_ms beside decoding streams (their slack under the
    # objective); tpot_slo_ms 0 = the factor alone
    ttft_slo_ms: float = 500.0
    ttft_slo_per_token_ms: float = 1.0
    tpot_slo_ms: float = 100.0

    def objectives(self) -> Objectives:
        return Objectives(self.ttft_slo_ms / 1000, self.ttft_slo_per_token_ms / 1000, self.tpot_slo_ms / 1000)

    def __post_init__(self) -> None:
        if self.itl_guard and self.itl_guard <= 1:
            raise ValueError(f"itl_guard must be 0 (off) or above 1, got {self.itl_guard}")
        self.objectives()  # ValueError: a negative or NaN objective
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_retention_max_s < 0 or self.kv_retention_tier_max_s < 0 or self.kv_retention_tenant_blocks < 0:
            raise ValueError(f"kv_retention_max_s ({self.kv_retention_max_s}), kv_retention_tier_max_s "
                             f"({self.kv_retention_tier_max_s}) and kv_retention_tenant_blocks "
                             f"({self.kv_retention_tenant_blocks}) must be >= 0")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.quantization not in ("", "fp8", "gguf", "int8"):
            raise ValueError(f"quantization must be '', 'fp8', 'gguf' or 'int8', got {self.quantization!r}")
        if self.kv_cache_dtype not in ("", "fp8"):
            raise ValueError(f"kv_cache_dtype must be '' (the model's dtype) or 'fp8', got {self.kv_cache_dtype!r}")
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        self.spec_config()  # a bad speculative_config fails here, before any weight is loaded

    def spec_config(self) -> SpecConfig | None:
        return SpecConfig.parse(self.speculative_config)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_running=self.max_num_running,
            max_num_waiting=self.max_num_waiting,
            max_prefill_chunk=self.max_prefill_chunk,
            max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            fair_queuing=self.fair_queuing,
            fair_prompt_weight=self.fair_prompt_weight,
            fair_output_weight=self.fair_output_weight,
        )

    def num_kv_blocks(self, kv_bytes_per_token: int) -> int:
        """KV blocks: ``num_blocks`` when set, else as many as ``kv_cache_bytes`` holds.
        ``kv_bytes_per_token``: K and V of one token in one block, in bytes (every layer's, for a
        model of one KV group; one group's layers otherwise: a block holds one group)."""
        if self.num_blocks is not None:
            return self.num_blocks
        per_block = self.block_size * kv_bytes_per_token
        blocks = self.kv_cache_bytes // per_block
        if blocks < 1:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} holds no block of {per_block} bytes")
        return int(blocks)

    def hash_salt(self) -> str:
        """Prefix hashes differ across models and KV layouts, never across processes."""
        quantized = f"|{self.quantization}" if self.quantization else ""  # other weights, other K/V
        # other K/V bytes; FP8 rows are "-r16" (padded to 16 bytes, models.kv_fp8): a second tier or a peer holding
        # the unpadded rows of earlier versions is another layout, never read as this one
        kv = ""
        if self.kv_cache_dtype:
            kv = f"|kv-{self.kv_cache_dtype}" + ("-r16" if self.kv_cache_dtype == "fp8" else "")
        return f"{Path(self.model).name}|{self.dtype}|{self.block_size}{quantized}{kv}"
