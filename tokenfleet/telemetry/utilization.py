"""MFU and MBU of a worker: each step's model FLOPs and bytes, over the device's peaks.

The step's work, from its shape (the simulator's roofline, ``planning.costs``, counts the same way):
- FLOPs: 2 x the matmul weights' parameters x tokens computed (embedding lookups are not matmuls), plus the LM head
  (2 x vocab x hidden) for each row sampled, plus attention: 4 x layers x query width x (query, key) pairs.
- bytes: every weight once per step, plus the K and V of every key read (each row's context after the step).

The peaks: a known card's datasheet figures (dense bf16 / fp8 tensor FLOP/s, HBM bytes/s); any other device, the CPU
included, is measured at start (a matmul at the model's dtype and a large copy, about a tenth of a second), so the
ratios mean the same on every machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# dense tensor-core FLOP/s (bf16, fp8) and HBM bytes/s, by the name torch reports
KNOWN_GPUS: dict[str, tuple[float, float, float]] = {
    "H100 80GB HBM3": (989e12, 1979e12, 3.35e12),  # SXM
    "H100 PCIe": (756e12, 1513e12, 2.0e12),
    "H100 NVL": (835e12, 1671e12, 3.9e12),
    "H200": (989e12, 1979e12, 4.8e12),
    "A100-SXM4-80GB": (312e12, 312e12, 2.04e12),
    "A100-SXM4-40GB": (312e12, 312e12, 1.56e12),
    "L40S": (362e12, 733e12, 0.864e12),
}


@dataclass(frozen=True)
class StepCost:
    weight_bytes: float  # every parameter, read once per step
    matmul_params: float  # parameters of the per-token matmuls (not the embedding table, not the LM head)
    head_flops_per_sample: float  # 2 x vocab x hidden
    attention_flops_per_pair: float  # 4 x layers x query width
    kv_bytes_per_token: float  # K and V of one position, all layers

    @property
    def pair_cost(self) -> float:
        """One attention (query, key) pair's FLOPs in tokens through the matmuls (engine.itl_guard's unit)."""
        return self.attention_flops_per_pair / (2 * self.matmul_params) if self.matmul_params else 0.0

    def of(self, tokens: int, samples: int, pairs: int, keys: int) -> tuple[float, float]:
        flops = 2 * self.matmul_params * tokens + self.head_flops_per_sample * samples \
            + self.attention_flops_per_pair * pairs
        return flops, self.weight_bytes + self.kv_bytes_per_token * keys

    @classmethod
    def of_model(cls, model: Any, kv_bytes_per_token: float) -> StepCost:
        """From a model's geometry (``config``: models.config.ModelConfig) and the tensors its ``weights`` hold (each
        counted once: a tied LM head is the embedding)."""
        c = model.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        return cls(float(_tensor_bytes(model.weights)), float(c.num_layers * per_layer),
                   2.0 * c.vocab_size * c.hidden_size, 4.0 * c.num_layers * q, kv_bytes_per_token)


def _tensor_bytes(root: Any) -> int:
    """Bytes of every distinct tensor storage reachable from ``root`` (dataclasses, lists, objects' attributes)."""
    import torch

    seen_storage: set[int] = set()
    seen_objects: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            try:
                key, size = item.untyped_storage().data_ptr(), item.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):  # an opaque tensor (a prepacked oneDNN weight)
                key, size = id(item), item.numel() * item.element_size()
            if key not in seen_storage:
                seen_storage.add(key)
                total += size
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and id(item) not in seen_objects and not isinstance(item, type):
            seen_objects.add(id(item))
            stack.extend(vars(item).values())
    return total


def peaks(device: Any, dtype: Any) -> tuple[float, float, str]:
    """(peak FLOP/s at ``dtype``, peak bytes/s, where the figures come from) for a torch device."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for known, (bf16, fp8, hbm) in KNOWN_GPUS.items():
            if known in name:
                return (fp8 if dtype in (torch.float8_e4m3fn,) else bf16), hbm, f"datasheet ({name})"
    return (*measure(device, dtype), "measured at start")


def measure(device: Any, dtype: Any, seconds: float = 0.05) -> tuple[float, float]:
    """Matmul FLOP/s at ``dtype`` and copy bytes/s on ``device``, each timed for about ``seconds``."""
    import torch

    def timed(fn: Any) -> float:
        fn()  # warm
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / count

    n = 1024 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    flops = 2 * n**3 / timed(lambda: a @ b)
    src = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / timed(lambda: dst.copy_(src))  # read + write
    return flops, copy
