"""Assemble an EngineCore from an EngineConfig: tokenizer, model, KV cache, scheduler."""

from __future__ import annotations

from pathlib import Path

from tokenfleet.backends.torch.device import configure_threads, resolve_device
from tokenfleet.backends.torch.runner import TorchModelRunner
from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.core import EngineCore, ModelInfo
from tokenfleet.engine.scheduler import Scheduler
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.loader import load_model, parse_dtype
from tokenfleet.models.tokenizer import Tokenizer


def num_kv_blocks(config: EngineConfig, model: ModelConfig, elem_size: int) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = config.block_size * model.kv_bytes_per_token * elem_size
    blocks = config.kv_cache_bytes // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no block of {per_block} bytes")
    return int(blocks)


def hash_salt(config: EngineConfig) -> str:
    """Prefix hashes differ across models and KV layouts, never across processes."""
    return f"{Path(config.model).name}|{config.dtype}|{config.block_size}"


def build_engine_core(config: EngineConfig) -> EngineCore:
    configure_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = parse_dtype(config.dtype)
    model = load_model(config.model, dtype, device)
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    if max_model_len > model.config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
            f"({model.config.max_position_embeddings})"
        )
    num_blocks = num_kv_blocks(config, model.config, dtype.itemsize)
    runner = TorchModelRunner(model, num_blocks, config.block_size)
    scheduler = Scheduler(config.scheduler_config(max_model_len), BlockManager(num_blocks, config.block_size),
                          hash_salt(config))
    tokenizer = Tokenizer(config.model)
    info = ModelInfo(
        vocab_size=model.config.vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=model.config.eos_token_ids,
    )
    return EngineCore(scheduler, runner, tokenizer, info)
