"""KV transfer between a prefill and a decode replica: the layout contract, how a prompt's
blocks are cut into chunks, and the checks on arrival. Pure (no torch, no I/O).

A chunk is some blocks of one layer, K and V as [num_kv_heads, num_blocks, block_size,
head_dim] raw little-endian values. Blocks are numbered by their index in the prompt, not by
physical block id: each side maps them onto its own block table. The decode worker skips
the leading blocks it already holds; the prefill worker sends the rest, layer by layer, each
layer cut so a chunk stays under the gRPC message limit.

Sliding-window layers (``KVLayout.layer_windows``) send only the blocks their window reaches from the
position after the prompt: the decode side keeps no others, the prefill side may hold no others.

``KVReceiver`` accepts a stream only if it is complete and consistent: same layout, chunks
in sequence, each (layer, block) exactly once, exact byte sizes, and a trailer whose byte
count matches. Anything else raises ``KVTransferError``; nothing is installed silently wrong.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenfleet.engine.output import TokenLogprobs
from tokenfleet.kvcache.layout import KVLayout, window_first_block

MAX_CHUNK_BYTES = 1 << 20  # K + V per message; gRPC's default limit is 4 MiB


class KVTransferError(ValueError):
    """A KV stream that cannot be installed (mismatched layout, truncated, corrupted), or a
    prefill replica that failed or went away (KV sources raise it for transport errors)."""


class KVLayoutError(KVTransferError):
    """The two sides' KV layouts differ (another model, dtype or block size): FAILED_PRECONDITION."""


@dataclass(frozen=True)
class ChunkSpec:
    seq: int
    layer: int
    first_block: int  # prompt block index
    num_blocks: int


def plan_chunks(layout: KVLayout, first_block: int, num_blocks: int,
                max_chunk_bytes: int = MAX_CHUNK_BYTES, num_tokens: int | None = None) -> list[ChunkSpec]:
    """Layer by layer, blocks [first_block, first_block + num_blocks) in chunks under the limit; a
    sliding-window layer from the first block its window reaches from position ``num_tokens`` (the
    prompt's length; default: the end of the last block)."""
    per_chunk = max(1, max_chunk_bytes // (2 * layout.block_bytes))
    end = first_block + num_blocks
    position = (end * layout.block_size) if num_tokens is None else num_tokens
    specs: list[ChunkSpec] = []
    for layer in range(layout.num_layers):
        first = max(first_block, window_first_block(position, layout.layer_window(layer), layout.block_size))
        for start in range(first, end, per_chunk):
            n = min(per_chunk, end - start)
            specs.append(ChunkSpec(len(specs), layer, start, n))
    return specs


class KVReceiver:
    """Checks one transfer's chunks as they arrive, against what the sender announced."""

    def __init__(self, layout: KVLayout, num_prompt_blocks: int, held_blocks: int, num_prompt_tokens: int | None = None):
        self.layout = layout
        self.num_prompt_blocks = num_prompt_blocks
        self.held_blocks = held_blocks
        self.num_prompt_tokens = num_prompt_tokens
        self._expected: list[ChunkSpec] | None = None
        self._next = 0
        self.num_bytes = 0

    def start(self, first_block: int, num_blocks: int, num_chunks: int, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        if first_block != self.held_blocks:
            raise KVTransferError(f"sender skips {first_block} blocks; {self.held_blocks} are held here")
        if first_block + num_blocks != self.num_prompt_blocks:
            raise KVTransferError(
                f"sender announces blocks {first_block}..{first_block + num_blocks}; the prompt has {self.num_prompt_blocks}")
        self._expected = plan_chunks(self.layout, first_block, num_blocks, max_chunk_bytes, self.num_prompt_tokens)
        if num_chunks != len(self._expected):
            raise KVTransferError(f"sender announces {num_chunks} chunks; the layout gives {len(self._expected)}")

    def accept(self, seq: int, layer: int, first_block: int, num_blocks: int, k: bytes, v: bytes) -> ChunkSpec:
        """Validate the next chunk; returns its spec (where to install it)."""
        if self._expected is None:
            raise KVTransferError("KV chunk before the transfer was announced")
        if self._next >= len(self._expected):
            raise KVTransferError(f"unexpected chunk {seq}: all {len(self._expected)} already received")
        spec = self._expected[self._next]
        if (seq, layer, first_block, num_blocks) != (spec.seq, spec.layer, spec.first_block, spec.num_blocks):
            raise KVTransferError(
                f"chunk {(seq, layer, first_block, num_blocks)} out of order; expected "
                f"{(spec.seq, spec.layer, spec.first_block, spec.num_blocks)}")
        size = num_blocks * self.layout.block_bytes
        if len(k) != size or len(v) != size:
            raise KVTransferError(f"chunk {seq}: {len(k)}/{len(v)} bytes of K/V, expected {size} each")
        self._next += 1
        self.num_bytes += len(k) + len(v)
        return spec

    def finish(self, num_bytes: int) -> None:
        """The sender's trailer: every chunk must have arrived and the byte counts agree."""
        if self._expected is None or self._next != len(self._expected):
            got = self._next
            want = "?" if self._expected is None else len(self._expected)
            raise KVTransferError(f"truncated KV stream: {got} of {want} chunks")
        if num_bytes != self.num_bytes:
            raise KVTransferError(f"trailer says {num_bytes} bytes; {self.num_bytes} received")

    @property
    def complete(self) -> bool:
        return self._expected is not None and self._next == len(self._expected)


# ---- the stream a prefill replica sends ----------------------------------------------------------
@dataclass(frozen=True)
class PrefillStarted:
    token_id: int  # the first generated token
    logprobs: TokenLogprobs | None
    num_cached_tokens: int  # prompt tokens the prefill replica took from its own prefix cache
    first_block: int  # = blocks the caller holds, not sent
    num_blocks: int
    num_chunks: int


@dataclass(frozen=True)
class KVChunkData:
    seq: int
    layer: int
    first_block: int
    num_blocks: int
    k: bytes
    v: bytes


@dataclass(frozen=True)
class Handoff:
    """Opaque backend state (e.g. TensorRT-LLM's DisaggregatedParams); KV moves out of band."""

    payload: bytes


@dataclass(frozen=True)
class PrefillDone:
    num_bytes: int


PrefillEvent = PrefillStarted | KVChunkData | Handoff | PrefillDone


class KVSource(Protocol):
    """Opens a transfer from a prefill replica: (held block hashes, our layout) -> its events.
    Transport failures surface as KVTransferError."""

    def __call__(self, held_block_hashes: Sequence[bytes], layout: KVLayout) -> AsyncGenerator[PrefillEvent, None]: ...
