"""LoRA adapters (PEFT format) on a Llama-family model, many at once in one batch.

An adapter adds ``scale * (x A^T) B^T`` to a linear layer's output (A: [r, in], B: [out, r]; scale = alpha / r, or
alpha / sqrt(r) with rsLoRA). Our layers are fused (q, k and v in one matrix; gate and up in another), so an
adapter's A matrices of one fused layer are stacked (one [x A^T] for the whole layer) and each sub-layer's B writes
its own slice of the output. B is stored pre-scaled.

A step's rows are grouped by adapter once (``LoraBatch``: rows per adapter, built by the model runner from the
requests); every adapted layer then runs one small GEMM pair per adapter present in the step on just its rows and
adds the result in place. Rows of requests without an adapter cost nothing.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenfleet.models.config import ModelConfig
from tokenfleet.models.linear import LinearKernel

# our fused layer -> the HF sub-layers it concatenates, in order
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.lora_([AB])\.weight$")


@dataclass
class FusedLora:
    """One fused layer's adapter: stacked A [sum r, in] and each sub-layer's (output offset, rank offset, B)."""

    a: torch.Tensor
    parts: list[tuple[int, int, torch.Tensor]]  # (first output column, first rank row, scaled B [out, r])


@dataclass
class LoraAdapter:
    name: str
    rank: int
    layers: list[dict[str, FusedLora]]  # per layer: fused layer name -> its adapter (absent: not adapted)


class LoraSet:
    """Every loaded adapter's matrices stacked per fused layer: A_all [C, in] (each adapter's stacked A in its own
    rows) and B_all [out, C] (each adapter's B in its own columns, zeros elsewhere), prepared for the model's matmul
    kernel. A step then adds ((x A_all^T) * mask) B_all^T, the mask keeping each row's own adapter's columns: two
    GEMMs per fused layer whatever the mix of adapters in the step, no gathers (the extra work is C wide: the sum of
    the loaded adapters' ranks on that layer)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, linear: LinearKernel,
                 base_weights: Callable[[], list[dict[str, torch.Tensor]]] | None):
        """``base_weights``: the model's fused layer weights, unprepared ([out, in] per fused layer per layer):
        each A_all is stacked under its base weight so one GEMM yields the layer's output and x A_all^T (at a
        decode step's few rows a GEMM costs mostly its call: this saves one per adapted layer). None for a base
        whose weights stay quantized (gguf, int8): the base is multiplied as the model holds it, and x A_all^T
        by a GEMM of its own (the adapters' matrices in the model's dtype), no dense copy of the base made."""
        self.config, self.dtype, self.device, self.linear = config, dtype, device, linear
        self.base_weights = base_weights
        self.adapters: dict[str, LoraAdapter] = {}
        self.columns: dict[str, dict[str, tuple[int, int]]] = {}  # fused layer -> adapter -> its columns
        self.width: dict[str, int] = {}  # fused layer -> C
        self.column_index: dict[str, torch.Tensor] = {}  # fused layer -> arange(C) on the device
        # (prepared [W; A_all], B_all, out); a quantized base: (prepared A_all, B_all, 0)
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]] = []
        self.version = 0  # bumped whenever the stacked matrices are rebuilt (CUDA graphs captured over them go stale)

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def add(self, adapter: LoraAdapter) -> None:
        self.adapters[adapter.name] = adapter
        self._rebuild()

    def _rebuild(self) -> None:
        self.version += 1
        outputs, inputs = _sizes(self.config)
        self.columns, self.width = {}, {}
        for f in FUSED:  # per fused layer, one column range per adapter: its widest stacked A there
            start, ranges = 0, {}
            for name, adapter in self.adapters.items():
                rows = max((layer[f].a.shape[0] for layer in adapter.layers if f in layer), default=0)
                if rows:
                    ranges[name] = (start, start + rows)
                    start += rows
            self.columns[f], self.width[f] = ranges, start
        self.column_index = {f: torch.arange(width, dtype=torch.long, device=self.device)
                             for f, width in self.width.items() if width}
        self.layers = []
        base = self.base_weights() if self.adapters and self.base_weights is not None else []
        for i in range(self.config.num_layers if self.adapters else 0):
            layer: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
            for f, subs in FUSED.items():
                if not self.width[f]:
                    continue
                a_all = torch.zeros(self.width[f], inputs[subs[0]], dtype=self.dtype, device=self.device)
                b_all = torch.zeros(sum(outputs[s] for s in subs), self.width[f], dtype=self.dtype, device=self.device)
                for name, (c0, _) in self.columns[f].items():
                    fl = self.adapters[name].layers[i].get(f)
                    if fl is not None:
                        a_all[c0: c0 + fl.a.shape[0]] = fl.a
                        for col, row, b in fl.parts:
                            b_all[col: col + b.shape[0], c0 + row: c0 + row + b.shape[1]] = b
                if not base:
                    layer[f] = (self.linear.prepare(a_all), self.linear.prepare(b_all), 0)
                    continue
                w = base[i][f].to(device=self.device, dtype=self.dtype)
                layer[f] = (self.linear.prepare(torch.cat([w, a_all]).contiguous()), self.linear.prepare(b_all),
                            w.shape[0])
            self.layers.append(layer)

    def batch(self, row_adapters: list[tuple[str, int, int]], num_rows: int) -> LoraBatch | None:
        """The step's masks: rows [first, end) of each (adapter, first, end) keep that adapter's columns."""
        if not row_adapters:
            return None
        first = {f: torch.zeros(num_rows, dtype=torch.long) for f in self.column_index}
        end = {f: torch.zeros(num_rows, dtype=torch.long) for f in self.column_index}
        for f in self.column_index:
            for name, r0, r1 in row_adapters:
                if name in self.columns[f]:
                    first[f][r0:r1], end[f][r0:r1] = self.columns[f][name]
        return LoraBatch.from_ranges(self, {f: v.to(self.device) for f, v in first.items()},
                                     {f: v.to(self.device) for f, v in end.items()})


@dataclass
class LoraBatch:
    """A step's rows and their adapters: per fused layer, a column mask over the loaded adapters' stacked ranks."""

    lora: LoraSet
    masks: dict[str, torch.Tensor]  # fused layer -> [rows, C]

    @classmethod
    def from_ranges(cls, lora: LoraSet, first: dict[str, torch.Tensor], end: dict[str, torch.Tensor]) -> LoraBatch:
        """The masks built on the device from each row's column range per fused layer (``first``/``end`` [rows],
        equal for a row without an adapter there): the ranges are numbers, so a captured CUDA graph replays any mix
        of adapters with them uploaded each step (backends.torch.cuda_graphs)."""
        return cls(lora, {f: ((cols[None, :] >= first[f][:, None]) & (cols[None, :] < end[f][:, None])).to(lora.dtype)
                          for f, cols in lora.column_index.items()})

    def project(self, layer: int, name: str, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """The fused layer ``name``'s output for ``x``, each row with its adapter (``base``: the plain weight)."""
        linear = self.lora.linear
        weights = self.lora.layers[layer].get(name)
        if weights is None:
            return linear(x, base)
        stacked, b_all, out = weights
        if out == 0:  # a quantized base: its own matmul, then x A_all^T
            result, low = linear(x, base), linear(x, stacked)
        else:
            both = linear(x, stacked)  # [rows, out + C]: the base output, then x A_all^T
            result, low = both[:, :out].contiguous(), both[:, out:]
        result += linear(low.mul_(self.masks[name]), b_all)
        return result


def load_peft_adapter(name: str, folder: str | Path, config: ModelConfig, dtype: torch.dtype,
                      device: torch.device) -> LoraAdapter:
    """A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) for a model of ``config``.
    ValueError for what it cannot serve (another architecture's shapes, DoRA, biases, embedding adapters)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder} is not a PEFT adapter folder: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora") or cfg.get("bias", "none") != "none" or cfg.get("fan_in_fan_out"):
        raise ValueError(f"adapter {name}: DoRA, LoRA biases and fan_in_fan_out are not supported")
    try:
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"adapter {name}: adapter_config.json needs a rank r: {e}") from None
    if rank <= 0 or not math.isfinite(alpha):
        raise ValueError(f"adapter {name}: rank {rank} and lora_alpha {alpha} must be positive and finite")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"adapter {name}: per-module ranks (rank_pattern/alpha_pattern) are not supported")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"adapter {name}: tensor {key!r} adapts a layer this engine does not adapt")
        if int(match[1]) >= config.num_layers:
            raise ValueError(f"adapter {name}: tensor {key!r} is for layer {match[1]}; this model has {config.num_layers}")
        if not bool(torch.isfinite(value).all()):  # one NaN would spread to every row of a step (stacked GEMMs)
            raise ValueError(f"adapter {name}: tensor {key!r} holds NaN or infinite values")
        found.setdefault((int(match[1]), match[2]), {})[match[3]] = value
    sizes, inputs = _sizes(config)
    layers: list[dict[str, FusedLora]] = [{} for _ in range(config.num_layers)]
    for layer in range(config.num_layers):
        for fused, subs in FUSED.items():
            present = [s for s in subs if (layer, s) in found]
            if not present:
                continue
            a_rows, parts, col, row = [], [], 0, 0
            for sub in subs:
                out_size = sizes[sub]
                if sub in present:
                    pair = found[(layer, sub)]
                    a, b = pair.get("A"), pair.get("B")
                    if a is None or b is None or tuple(a.shape) != (rank, inputs[sub]) or tuple(b.shape) != (out_size, rank):
                        raise ValueError(f"adapter {name}: layer {layer} {sub} has shapes "
                                         f"{None if a is None else tuple(a.shape)}, {None if b is None else tuple(b.shape)}"
                                         f"; this model needs {(rank, inputs[sub])}, {(out_size, rank)}")
                    a_rows.append(a)
                    parts.append((col, row, (b.float() * scale).to(device=device, dtype=dtype)))
                    row += rank
                col += out_size
            layers[layer][fused] = FusedLora(torch.cat(a_rows).to(device=device, dtype=dtype).contiguous(), parts)
    if not any(layers):
        raise ValueError(f"adapter {name} adapts no layer of this model")
    return LoraAdapter(name, rank, layers)


def _sizes(config: ModelConfig) -> tuple[dict[str, int], dict[str, int]]:
    """Each sub-layer's output and input sizes."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    h, m = config.hidden_size, config.intermediate_size
    outputs = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": h,
               "mlp.gate_proj": m, "mlp.up_proj": m, "mlp.down_proj": h}
    inputs = {"self_attn.q_proj": h, "self_attn.k_proj": h, "self_attn.v_proj": h, "self_attn.o_proj": q,
              "mlp.gate_proj": h, "mlp.up_proj": h, "mlp.down_proj": m}
    return outputs, inputs


def fused_base_weights(model_dir: str | Path, config: ModelConfig) -> list[dict[str, torch.Tensor]]:
    """A Llama checkpoint's linear weights fused as the engine fuses them ([out, in] per fused layer, per layer)."""
    from tokenfleet.models.loader import read_safetensors

    tensors = read_safetensors(Path(model_dir))
    return [{f: torch.cat([tensors[f"layers.{i}.{sub}.weight"] for sub in subs]) for f, subs in FUSED.items()}
            for i in range(config.num_layers)]
