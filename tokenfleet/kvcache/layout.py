"""The KV layout contract: what two replicas must share before one installs the other's blocks.

A block's bytes are K (or V) of ``block_size`` positions of one layer, ``[num_kv_heads, block_size,
head_dim]`` values of ``dtype`` (``fp8_e4m3``: each head row followed by its fp32 scale and zero padding to 16
bytes, models.kv_fp8).
``hash_salt`` names model, dtype and block size, so block hashes (``block_hash``) of different layouts
never collide.

Models with sliding-window layers (Gemma 3) keep their KV in groups of layers (``kv_groups``): a
group's layers share one block table per request, and a sliding-window group's table keeps only the
blocks its window still reaches (``window_first_block``); the rest are the null block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1}
# "fp8_e4m3" (models.kv_fp8): a head row is head_dim e4m3 values, its fp32 scale and 12 zero bytes (ROW_PAD)
ROW_EXTRA_BYTES = {"fp8_e4m3": 16}


@dataclass(frozen=True)
class KVLayout:
    hash_salt: str  # model + dtype + block size (tokenfleet.kvcache.block_hash)
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # per model layer: 0 for full attention, else the layer's sliding window in tokens; () = all full
    layer_windows: tuple[int, ...] = ()

    def layer_window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def block_bytes(self) -> int:
        """Bytes of K (or of V) for one block of one layer."""
        row = self.head_dim * DTYPE_SIZES[self.dtype] + ROW_EXTRA_BYTES.get(self.dtype, 0)
        return self.num_kv_heads * self.block_size * row

    def key(self) -> str:
        """Every field in one string: replicas advertise it in etcd (equal keys, equal layouts)."""
        fields = [self.hash_salt, self.dtype, self.block_size, self.num_layers, self.num_kv_heads, self.head_dim]
        if self.layer_windows:
            fields.append(",".join(map(str, self.layer_windows)))
        return "/".join(map(str, fields))

    def mismatch(self, other: KVLayout) -> str | None:
        """Why blocks of ``other`` cannot be installed here, or None."""
        for name in ("hash_salt", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "layer_windows"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"KV layout mismatch: {name} is {theirs!r} there, {mine!r} here"
        return None


@dataclass(frozen=True)
class KVGroup:
    """Layers whose KV shares one block table per request. A block (page) of the pool holds one
    layer of each group, ``slot`` i for the group's i-th layer: every group has as many layers."""

    window: int  # 0: full attention (every block kept); else the sliding window in tokens
    layers: tuple[int, ...]


def kv_groups(layer_windows: tuple[int, ...]) -> tuple[KVGroup, ...]:
    """Group layers of equal window into groups of equal size (the gcd of the counts), full
    attention first: a Llama's layers are one group; Gemma 3 270M's 3 global and 15 sliding layers
    are 1 + 5 groups of 3, so a page is 3 layers' KV and a token in the window takes 6 pages."""
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    return tuple(KVGroup(window, tuple(layers[i:i + size]))
                 for window, layers in sorted(by_window.items()) for i in range(0, len(layers), size))


def layer_slots(layer_windows: tuple[int, ...], num_layers: int) -> list[tuple[int, int]]:
    """Per layer: (index of its group in ``kv_groups``, its slot in a block: its index in the group)."""
    out = [(0, 0)] * num_layers
    for g, group in enumerate(kv_groups(layer_windows or (0,) * num_layers)):
        for slot, layer in enumerate(group.layers):
            out[layer] = (g, slot)
    return out


def layer_groups(layer_windows: tuple[int, ...], num_layers: int) -> list[int]:
    """Per layer: the index of its group in ``kv_groups`` (all 0 when every layer is full)."""
    return [g for g, _ in layer_slots(layer_windows, num_layers)]


def window_first_block(position: int, window: int, block_size: int) -> int:
    """The first block a query at ``position`` reads under a sliding ``window`` (keys at
    ``position - window + 1`` and later; HF's ``kv_idx > q_idx - sliding_window``); 0 when full."""
    return max(0, position - window + 1) // block_size if window else 0
