"""Load an HF folder (config.json + *.safetensors): the Llama family into ``LlamaWeights``, Gemma 3
into ``Gemma3Weights``; the architecture comes from config.json.

``quantization="gguf"``: the folder was imported with the GGUF kept (models.gguf_import: ``model.gguf``); its
block-quantized tensors stay quantized (models.ggml_quant.QuantTensor) and the linear layers, the embedding and the
LM head read them as they are (models.quant_linear); norms are the file's fp32 values.

``quantization="int8"``: the checkpoint's matrices (the linear layers, the embedding and so the tied LM head) are
quantized at load to int8 with an fp16 scale per 32 values (GGML's Q8_0 layout, so the same kernels serve them), and
decode steps multiply them with the activations quantized to int8 per 32 values (integer dot products: VNNI where the
CPU has it); longer steps dequantize the weights and multiply in the activations' dtype."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenfleet import envs
from tokenfleet.engine.runner import KernelCheck
from tokenfleet.models import auto_dtype, native, prefill_attention
from tokenfleet.models.attention import (
    NativePagedAttention,
    PagedAttention,
    TorchPagedAttention,
    fallbacks,
)
from tokenfleet.models.auto_dtype import DtypeChoice
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.gemma3 import Gemma3LayerWeights, Gemma3Model, Gemma3Weights
from tokenfleet.models.ggml_quant import QuantTensor, cat_rows
from tokenfleet.models.kernel_check import (
    checked_attention,
    checked_gpu_quant_linear,
    checked_layer_ops,
    checked_linear,
    checked_quant_linear,
)
from tokenfleet.models.kv_fp8 import check_device, check_kv_cache_dtype
from tokenfleet.models.layer_ops import LayerOps, TorchLayerOps, select_layer_ops
from tokenfleet.models.linear import Fp8Linear, LinearKernel, select_linear
from tokenfleet.models.llama import LayerWeights, LlamaModel, LlamaWeights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def select_attention(dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "") -> PagedAttention:
    """The attention a model runs (here, not in models.attention, which the kernels it chooses from import).
    The native kernel where it applies (on CPU: bf16, or fp32 with a cache in the model's dtype; a compiler
    present), the Triton kernel on CUDA (triton installed), else the torch reference; TOKENFLEET_KERNELS=torch|triton
    overrides. ``kv_cache_dtype`` "fp8" (models.kv_fp8): the native kernel's FP8 variant on CPU in bf16; the Triton
    and torch ones read both kinds."""
    choice = envs.kernels()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"TOKENFLEET_KERNELS={choice!r}: auto, torch or triton")
    if choice == "torch":
        return TorchPagedAttention()
    if device.type == "cuda" or choice == "triton":
        from tokenfleet.models import triton_attention

        if triton_attention.available():
            return triton_attention.TritonPagedAttention()
        if choice == "triton":
            raise ValueError("TOKENFLEET_KERNELS=triton but triton is not installed")
    fp8 = kv_cache_dtype == "fp8"
    if device.type == "cpu" and (dtype == torch.bfloat16 or (dtype == torch.float32 and not fp8)):
        lib = native.load("paged_attention")
        if lib is not None:
            return NativePagedAttention(lib, fp8=fp8, dtype=dtype)
    return TorchPagedAttention()


def resolve_dtype(name: str, device: torch.device, quantization: str = "", model_dir: str | Path | None = None) -> str:
    """``name``, or for "auto" the fastest dtype on ``device`` for the model at ``model_dir`` (models.auto_dtype
    says the rule and ``choose_dtype`` why)."""
    return choose_dtype(name, device, quantization, model_dir).dtype


def choose_dtype(name: str, device: torch.device, quantization: str = "",
                 model_dir: str | Path | None = None) -> DtypeChoice:
    """The DtypeChoice for ``name`` on ``device``: measured (once per machine, then cached) in the geometry of the
    model at ``model_dir`` where the CPU's flags do not settle it; the default model's without one."""
    if model_dir is None:
        return auto_dtype.choose_dtype(name, device, quantization)
    config = ModelConfig.from_dir(model_dir)
    return auto_dtype.choose_dtype(name, device, quantization, config.hidden_size, config.intermediate_size)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: supported are {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, quantization: str = "",
               kv_cache_dtype: str = "", block_size: int = 16) -> LlamaModel | Gemma3Model:
    """``quantization``: "" or "fp8" (models.linear: FP8 weights with per-channel scales). ``kv_cache_dtype``: ""
    (the model's dtype) or "fp8" (models.kv_fp8; the attention kernel is chosen to read it). The kernels chosen for
    this device are checked against the torch reference in the model's geometry (``block_size``: the engine's)
    before use (models.kernel_check; ``model.kernel_checks`` says how each did)."""
    config = ModelConfig.from_dir(model_dir)
    check_kv_cache_dtype(kv_cache_dtype)
    check_device(kv_cache_dtype, device)
    linear: LinearKernel
    tensors: dict[str, torch.Tensor | QuantTensor]
    built: Callable[[], None] = lambda: None  # noqa: E731 - what to do once the weights are built
    if quantization == "gguf":
        tensors, linear, linear_checks, built = _gguf(Path(model_dir), dtype, device)
    elif quantization == "int8":
        tensors, linear, linear_checks = _int8(read_safetensors(Path(model_dir)), dtype, device)
    else:
        tensors = dict(read_safetensors(Path(model_dir)))
        linear, linear_checks = checked_linear(select_linear(dtype, device, quantization), config, dtype, device)
    attention, ops, checks = checked_kernels(config, dtype, device, kv_cache_dtype, block_size)
    checks = (*linear_checks, *checks)
    model: LlamaModel | Gemma3Model
    if config.is_gemma3:
        model = Gemma3Model(config, _gemma3_weights(config, tensors, dtype, device, linear), dtype, device, linear,
                            attention)
    else:
        weights = _build_weights(config, tensors, dtype, device, linear)
        model = LlamaModel(config, weights, dtype, device, linear, attention, ops)
        model.source_dir = str(model_dir)
    del tensors  # what the model did not keep (a GGUF's unfused Q, K, V, gate and up views)
    built()
    model.kv_cache_dtype = kv_cache_dtype
    model.kernel_checks = checks
    return model


def checked_kernels(config: ModelConfig, dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "",
                    block_size: int = 16) -> tuple[PagedAttention, LayerOps, tuple[KernelCheck, ...]]:
    """The attention and layer-op kernels for this device, each checked against the torch reference here (a failed
    one is replaced by the reference), and how each check went. Gemma 3 has no fused layer ops to check."""
    selected = select_attention(dtype, device, kv_cache_dtype)
    candidates = () if isinstance(selected, TorchPagedAttention) else itertools.chain([selected], fallbacks(selected))
    attention, attention_checks = checked_attention(candidates, config, dtype, device, kv_cache_dtype, block_size)
    if isinstance(attention, NativePagedAttention) and attention.dtype == torch.bfloat16 and not attention.fp8:
        # whether prefill chunks stay in the kernel or go to SDPA: this machine's faster (models.prefill_attention)
        choice = prefill_attention.choose(attention, config.num_heads, config.num_kv_heads, config.head_dim,
                                          block_size)
        attention.handles_prefill = choice.in_kernel
        attention.prefill_reason = choice.reason
    if config.is_gemma3:
        return attention, TorchLayerOps(config), attention_checks
    ops, ops_checks = checked_layer_ops(select_layer_ops(config, dtype, device), TorchLayerOps(config), config, dtype,
                                        device, kv_cache_dtype)
    return attention, ops, (*attention_checks, *ops_checks)


def _gguf(model_dir: Path, dtype: torch.dtype, device: torch.device
          ) -> tuple[dict[str, torch.Tensor | QuantTensor], LinearKernel, tuple[KernelCheck, ...], Callable[[], None]]:
    """The GGUF's tensors (quantized ones kept), the quantized linear kernel checked on their shapes here, and what
    to call once the model's weights are built (the file's pages dropped from the resident set:
    gguf_weights.drop_resident_pages)."""
    from tokenfleet.models.gguf_import import GGUF_FILE
    from tokenfleet.models.gguf_weights import drop_resident_pages, open_gguf, weights_from_reader
    from tokenfleet.models.quant_linear import select_quant_linear

    envs.quant_activations()  # a bad setting fails before the file is read
    path = model_dir / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{model_dir} has no {GGUF_FILE}: import the model with --keep-quantized")
    reader = open_gguf(path)
    tensors = weights_from_reader(reader)
    shapes = {(t.kind, t.rows, t.cols) for t in tensors.values() if isinstance(t, QuantTensor)}
    if _gpu_quant(device):
        linear, checks = _checked_gpu_quant_linear(shapes, dtype, device)
    else:
        linear, checks = checked_quant_linear(select_quant_linear(envs.quant_activations() == "int8"), shapes, dtype)
    return tensors, linear, checks, functools.partial(drop_resident_pages, reader)


def _gpu_quant(device: torch.device) -> bool:
    """Quantized records on a GPU (or, for tests, on a CPU under TOKENFLEET_KERNELS=triton): models.triton_quant."""
    return device.type != "cpu" or envs.kernels() == "triton"


def _checked_gpu_quant_linear(shapes: set[tuple[str, int, int]], dtype: torch.dtype, device: torch.device
                              ) -> tuple[LinearKernel, tuple[KernelCheck, ...]]:
    from tokenfleet.models.triton_quant import GpuQuantLinear, select_matmul

    return checked_gpu_quant_linear(GpuQuantLinear(device, dtype, select_matmul(device)), shapes, dtype, device)


def _int8(tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
          ) -> tuple[dict[str, torch.Tensor | QuantTensor], LinearKernel, tuple[KernelCheck, ...]]:
    """The checkpoint with its matrices quantized to int8 blocks (Q8_0), and the int8-activation kernel checked on
    their shapes here."""
    from tokenfleet.models.ggml_quant import quantize_q8_0
    from tokenfleet.models.quant_linear import QuantLinear, native_quant_matmul

    out: dict[str, torch.Tensor | QuantTensor] = {
        name: quantize_q8_0(t) if t.dim() == 2 and t.shape[1] % 32 == 0 else t for name, t in tensors.items()}
    shapes = {(t.kind, t.rows, t.cols) for t in out.values() if isinstance(t, QuantTensor)}
    if _gpu_quant(device):
        return out, *_checked_gpu_quant_linear(shapes, dtype, device)
    linear, checks = checked_quant_linear(
        QuantLinear(native_quant_matmul(), int8_activations=envs.quant_activations() == "int8"), shapes, dtype)
    return out, linear, checks


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors


def _head(linear: LinearKernel, lm_head: torch.Tensor | QuantTensor) -> torch.Tensor | QuantTensor:
    """The LM head as ``linear`` takes it; FP8 models keep it in the model's dtype (its logits pick tokens); a GGUF's
    stays as the file holds it (the default model's: Q8_0)."""
    return lm_head if isinstance(linear, Fp8Linear) else linear.prepare(lm_head)


def _rows(lm_head: torch.Tensor | QuantTensor) -> torch.Tensor | None:
    """The LM head's plain rows for refine_top_logits (bf16 logits refined in fp32); a quantized head has none: its
    logits are computed in fp32 from the quantized values already."""
    return None if isinstance(lm_head, QuantTensor) else lm_head


def _taker(t: dict[str, torch.Tensor | QuantTensor], dtype: torch.dtype, device: torch.device) -> Any:
    def take(name: str) -> Any:
        """A tensor in the model's dtype on ``device``; a quantized one as it is (QuantTensor)."""
        if name not in t:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        value = t[name]
        if isinstance(value, QuantTensor):  # on a GPU, the embedding table's blocks move there
            return value if value.data.device == device else QuantTensor(value.kind, value.rows, value.cols,
                                                                          value.data.to(device))
        return value.to(device=device, dtype=dtype).contiguous()

    return take


def _build_weights(
    config: ModelConfig, t: dict[str, torch.Tensor | QuantTensor], dtype: torch.dtype, device: torch.device,
    linear: LinearKernel
) -> LlamaWeights:
    take = _taker(t, dtype, device)

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=linear.prepare(cat_rows([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])),
                o_proj=linear.prepare(take(p + "self_attn.o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=linear.prepare(cat_rows([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                down=linear.prepare(take(p + "mlp.down_proj.weight")),
            )
        )
    embed = take("embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in t:
        if not config.tie_word_embeddings:
            raise ValueError("checkpoint lacks lm_head.weight and tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = take("lm_head.weight")
    return LlamaWeights(embed=embed, layers=layers, norm=take("norm.weight"), lm_head=_head(linear, lm_head),
                        lm_head_rows=_rows(lm_head))


def _gemma3_weights(config: ModelConfig, t: dict[str, torch.Tensor | QuantTensor], dtype: torch.dtype,
                    device: torch.device, linear: LinearKernel) -> Gemma3Weights:
    take = _taker(t, dtype, device)

    def scale(name: str) -> torch.Tensor:  # Gemma's RMSNorm multiplies by (1 + weight), in fp32
        value = t.get(name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        return (1.0 + value.float()).to(device)

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layers.append(Gemma3LayerWeights(
            input_norm=scale(p + "input_layernorm.weight"),
            qkv=linear.prepare(cat_rows([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])),
            q_norm=scale(p + "self_attn.q_norm.weight"),
            k_norm=scale(p + "self_attn.k_norm.weight"),
            o_proj=linear.prepare(take(p + "self_attn.o_proj.weight")),
            post_attention_norm=scale(p + "post_attention_layernorm.weight"),
            pre_feedforward_norm=scale(p + "pre_feedforward_layernorm.weight"),
            post_feedforward_norm=scale(p + "post_feedforward_layernorm.weight"),
            gate_up=linear.prepare(cat_rows([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
            down=linear.prepare(take(p + "mlp.down_proj.weight")),
            sliding=config.layer_types[i] == "sliding_attention",
        ))
    embed = take("embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings or "lm_head.weight" not in t else take("lm_head.weight")
    return Gemma3Weights(embed=embed, layers=layers, norm=scale("norm.weight"), lm_head=_head(linear, lm_head),
                         lm_head_rows=_rows(lm_head))


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, quantization: str = "",
                 seed: int = 0, kv_cache_dtype: str = "") -> LlamaModel:
    """A Llama of ``config``'s geometry with random weights (N(0, 0.02), unit norms), built on ``device`` one
    matrix at a time (an 8B model never exists twice, quantized or not): speed runs need no checkpoint."""
    if config.is_gemma3:
        raise ValueError("random_model builds Llama-family geometries only")
    check_device(check_kv_cache_dtype(kv_cache_dtype), device)
    linear, linear_checks = checked_linear(select_linear(dtype, device, quantization), config, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config

    def rand(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones() -> torch.Tensor:
        return torch.ones(c.hidden_size, dtype=dtype, device=device)

    q_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layers = [LayerWeights(input_norm=ones(), qkv=linear.prepare(rand(q_rows, c.hidden_size)),
                           o_proj=linear.prepare(rand(c.hidden_size, c.num_heads * c.head_dim)), post_norm=ones(),
                           gate_up=linear.prepare(rand(2 * c.intermediate_size, c.hidden_size)),
                           down=linear.prepare(rand(c.hidden_size, c.intermediate_size)))
              for _ in range(c.num_layers)]
    embed = rand(c.vocab_size, c.hidden_size)
    lm_head = embed if c.tie_word_embeddings else rand(c.vocab_size, c.hidden_size)
    weights = LlamaWeights(embed=embed, layers=layers, norm=ones(), lm_head=_head(linear, lm_head), lm_head_rows=lm_head)
    attention, ops, checks = checked_kernels(config, dtype, device, kv_cache_dtype)
    model = LlamaModel(config, weights, dtype, device, linear, attention, ops)
    model.kv_cache_dtype = kv_cache_dtype
    model.kernel_checks = (*linear_checks, *checks)
    return model
