"""Stable, chained hashes of full KV blocks: the prefix hash every component computes alike.

hash(block_i) = sha256(hash(block_{i-1}) || token ids as little-endian int32)[:16], with
hash(block_{-1}) = sha256("tokenfleet-kv-v1" || salt)[:16]. The salt names the model and KV
layout (model id, dtype, block size) so different models never share a prefix hash. Never
Python's ``hash()``: it is salted per process, and routers must reproduce these values.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16


def root_hash(salt: str) -> bytes:
    return hashlib.sha256(b"tokenfleet-kv-v1\x00" + salt.encode()).digest()[:HASH_BYTES]


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    payload = struct.pack(f"<{len(token_ids)}i", *token_ids)
    return hashlib.sha256(parent + payload).digest()[:HASH_BYTES]


def hash_blocks(
    token_ids: Sequence[int], block_size: int, salt: str, parent_hashes: Sequence[bytes] = ()
) -> list[bytes]:
    """Hashes of every full block of ``token_ids``; reuses ``parent_hashes`` already computed."""
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else root_hash(salt)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
