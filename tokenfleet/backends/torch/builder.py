"""Assemble an EngineCore on the torch backend from an EngineConfig: tokenizer, model, KV cache, scheduler."""

from __future__ import annotations

import dataclasses

import structlog

from tokenfleet.backends.torch.device import configure_threads, resolve_device, small_step_threads
from tokenfleet.backends.torch.runner import TorchModelRunner
from tokenfleet.engine import kv_store, kv_tier
from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.core import CoreParts, EngineCore, kv_layout
from tokenfleet.engine.itl_guard import ItlGuard
from tokenfleet.engine.retention import Retention
from tokenfleet.engine.runner import ModelInfo
from tokenfleet.engine.scheduler import Scheduler
from tokenfleet.models.kv_fp8 import row_bytes
from tokenfleet.models.loader import choose_dtype, load_model, parse_dtype
from tokenfleet.models.tokenizer import Tokenizer

log = structlog.get_logger()


def build_engine_core(config: EngineConfig) -> EngineCore:
    threads = configure_threads(config.num_threads)
    device = resolve_device(config.device)
    choice = choose_dtype(config.dtype, device, config.quantization, config.model)
    if choice.source != "asked":
        log.info("dtype auto", **choice.log_fields())
    config = dataclasses.replace(config, dtype=choice.dtype)
    dtype = parse_dtype(config.dtype)
    model = load_model(config.model, dtype, device, config.quantization, config.kv_cache_dtype, config.block_size)
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    if max_model_len > model.config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
            f"({model.config.max_position_embeddings})"
        )
    groups = model.config.kv_groups  # a block holds one layer of a group: K+V of len(group.layers) layers
    per_token = 2 * len(groups[0].layers) * model.config.num_kv_heads * row_bytes(model.config.head_dim, dtype,
                                                                                  config.kv_cache_dtype)
    spec = config.spec_config()
    draft = None
    if spec is not None and spec.method == "draft":  # its KV shares the budget: a block holds both models' K/V
        from tokenfleet.backends.torch.draft import load_draft_model
        from tokenfleet.models.llama import LlamaModel

        if not isinstance(model, LlamaModel):
            raise ValueError("a draft model can speculate only for a Llama-architecture target here")
        draft = load_draft_model(spec, model)
        per_token += 2 * draft.config.num_layers * draft.config.num_kv_heads * draft.config.head_dim * dtype.itemsize
    num_blocks = config.num_kv_blocks(per_token)
    graph_batch = config.cuda_graph_max_batch or min(config.max_num_running, 256)
    runner = TorchModelRunner(model, num_blocks, config.block_size, cuda_graph_batch=graph_batch,
                              max_model_len=max_model_len, mixed_graph_tokens=config.max_num_batched_tokens)
    if device.type == "cpu":
        runner.step_threads = (small_step_threads(threads, config.small_step_threads), threads)
    if draft is not None:
        from tokenfleet.backends.torch.draft import DraftModel

        runner.drafter = DraftModel(draft, num_blocks, config.block_size, runner.build_batch)
    # without a second tier a pin past the pool window would rank nothing: 0 ends it with the pool horizon
    retention = Retention(config.kv_retention_max_s, config.kv_retention_tenant_blocks,
                          config.kv_retention_tier_max_s if config.kv_tier else 0.0)
    block_manager = BlockManager(num_blocks, config.block_size, tuple(g.window for g in groups), retention)
    scheduler = Scheduler(config.scheduler_config(max_model_len), block_manager, config.hash_salt())
    tokenizer = Tokenizer(config.model)
    info = ModelInfo(
        vocab_size=model.config.vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=model.config.eos_token_ids,
        layer_windows=model.config.layer_windows,
        kernel_checks=runner.kernel_checks,
    )
    if config.async_scheduling and device.type == "cpu":  # the forward is synchronous there
        log.warning("async_scheduling on CPU delays each step's outputs by one forward and gains nothing",
                    device=str(device))
    for name, folder in config.lora_adapters:
        runner.load_adapter(name, folder)
    tier = None
    if config.kv_tier:
        if len(groups) > 1:
            raise ValueError("a second KV tier is not supported yet for models with sliding-window layers")
        namespace = kv_store.namespace(kv_layout(scheduler, runner, info).key(), config.model)
        tier = kv_tier.SecondTier(kv_store.open_store(config.kv_tier, namespace), config.kv_tier_bytes, namespace,
                                  config.kv_tier_tenant_bytes, kv_store.read_key(config.kv_tier_key_file),
                                  retained=retention.tier_pinned)
    single_group = len(groups) == 1  # whole blocks move only with one KV group (sliding-window models: not yet)
    parts = CoreParts(
        blocks=runner, tier=tier, peer_blocks=single_group, speculation=spec,
        overlap=runner if config.async_scheduling else None, adapters=runner, costs=runner,
        # a queued step is scheduled before the last one's time is known: no guard with overlap
        itl_guard=ItlGuard(config.itl_guard, runner.cost.pair_cost, config.objectives())
        if config.itl_guard and not config.async_scheduling else None)
    core = EngineCore(scheduler, runner, tokenizer, info, parts)
    runner.capture_graphs()  # CUDA only, and only where the model and attention allow (cuda_graphs.graphs_supported)
    return core
