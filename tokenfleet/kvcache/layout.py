"""The KV layout contract: what two replicas must share before one installs the other's blocks.

A block's bytes are K (or V) of ``block_size`` positions of one layer, ``[num_kv_heads, block_size,
head_dim]`` values of ``dtype``. ``hash_salt`` names model, dtype and block size, so block hashes
(``block_hash``) of different layouts never collide.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class KVLayout:
    hash_salt: str  # model + dtype + block size (tokenfleet.kvcache.block_hash)
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_bytes(self) -> int:
        """Bytes of K (or of V) for one block of one layer."""
        return self.num_kv_heads * self.block_size * self.head_dim * DTYPE_SIZES[self.dtype]

    def key(self) -> str:
        """Every field in one string: replicas advertise it in etcd (equal keys, equal layouts)."""
        return "/".join(str(v) for v in (self.hash_salt, self.dtype, self.block_size, self.num_layers,
                                         self.num_kv_heads, self.head_dim))

    def mismatch(self, other: KVLayout) -> str | None:
        """Why blocks of ``other`` cannot be installed here, or None."""
        for name in ("hash_salt", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"KV layout mismatch: {name} is {theirs!r} there, {mine!r} here"
        return None
