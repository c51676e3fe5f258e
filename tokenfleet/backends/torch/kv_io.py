"""Raw bytes out of and into a runner's KV cache (``models.llama.KVCache``).

Two shapes: one layer of some blocks, as KV transfer between a prefill and a decode replica streams them
(``export_layer``/``import_layer``), and whole blocks over every layer, K then V, as the second KV tier stores them
(``export_blocks``/``import_blocks``). An FP8 cache moves its packed rows, scales included. Block ids come as
device tensors (the runner builds them); the cache is passed in each call, so a runner whose cache is replaced
(tests, the CUDA-graph scratch block) needs nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from tokenfleet.engine.kv_tier import PendingBlock
from tokenfleet.models.llama import KVCache


class KVBlockIO:
    def __init__(self, device: torch.device):
        self.device = device
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: evicted blocks go to host on it

    @staticmethod
    def geometry(kv: KVCache) -> tuple[int, int, int, str]:
        """(num_layers, num_kv_heads, head_dim, dtype name) of the cache ("fp8_e4m3": models.kv_fp8's rows)."""
        kv_heads = kv.k.shape[1]
        dtype = "fp8_e4m3" if kv.kv_cache_dtype == "fp8" else str(kv.k.dtype).removeprefix("torch.")
        return len(kv.layer_slots), kv_heads, kv.head_dim, dtype

    @staticmethod
    def export_layer(kv: KVCache, layer: int, index: torch.Tensor) -> tuple[bytes, bytes]:
        """K and V of the blocks ``index`` (of the layer's group) in one layer as raw [kv_heads, n, block_size,
        head_dim] values. Safe off the engine thread for blocks nobody writes (held, full or owned by a finished
        request)."""
        slot = kv.layer_slots[layer][1]
        return _raw(kv.k[slot].index_select(1, index)), _raw(kv.v[slot].index_select(1, index))

    def import_layer(self, kv: KVCache, layer: int, index: torch.Tensor, k: bytes, v: bytes) -> None:
        """Write received blocks into the cache (engine thread: the blocks are reserved, not yet read)."""
        slot = kv.layer_slots[layer][1]
        _, kv_heads, _, block_size, width = kv.k.shape
        shape = (kv_heads, index.shape[0], block_size, width)
        for cache, raw in ((kv.k, k), (kv.v, v)):
            values = torch.frombuffer(bytearray(raw), dtype=cache.dtype).view(shape)
            cache[slot].index_copy_(1, index, values.to(self.device))

    def export_blocks(self, kv: KVCache, index: torch.Tensor, wait: bool = True) -> list[bytes] | list[PendingBlock]:
        """Each block's K and V in every layer as one raw [2, layers, kv_heads, block_size, head_dim] value.
        ``wait=False`` on CUDA: the copy to host runs on a side stream into pinned memory and each value is a
        ``PendingBlock`` (the step goes on; whoever needs the bytes waits for the copy). The gather itself
        is ordered on the current stream, so the pool's blocks may be overwritten right after."""
        both = torch.stack([kv.k.index_select(2, index), kv.v.index_select(2, index)])
        both = both.permute(3, 0, 1, 2, 4, 5).contiguous()  # [n, 2, layers, kv_heads, block_size, head_dim]
        if wait or self.device.type != "cuda":
            return [_raw(block) for block in both.cpu()]
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the gather is done before the copy reads it
        with torch.cuda.stream(stream):
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        both.record_stream(stream)  # the allocator keeps the gathered copy until the side stream is done with it

        def result(i: int) -> bytes:
            copied.synchronize()
            return _raw(host[i])

        size = self.block_bytes(kv)
        return [PendingBlock(size, functools.partial(result, i)) for i in range(index.shape[0])]

    @staticmethod
    def block_bytes(kv: KVCache) -> int:
        """Size of one ``export_blocks`` value."""
        slots, kv_heads, _, block_size, width = kv.k.shape
        return kv.k.dtype.itemsize * 2 * slots * kv_heads * block_size * width

    def import_blocks(self, kv: KVCache, index: torch.Tensor, blocks: Sequence[bytes]) -> None:
        """Write values ``export_blocks`` produced back into the blocks ``index`` (before the forward reads them)."""
        slots, kv_heads, _, block_size, width = kv.k.shape
        shape = (len(blocks), 2, slots, kv_heads, block_size, width)
        size = self.block_bytes(kv)
        if any(len(data) != size for data in blocks):
            raise ValueError(f"a stored KV block is not {size} bytes: another layout")
        values = torch.frombuffer(bytearray(b"".join(blocks)), dtype=kv.k.dtype).view(shape)
        if self.device.type == "cuda":  # from pinned memory the upload is asynchronous, ordered before the forward
            values = values.pin_memory()
        values = values.to(self.device, non_blocking=True).permute(1, 2, 3, 0, 4, 5)  # [2, layers, kv_heads, n, ...]
        kv.k.index_copy_(2, index, values[0])
        kv.v.index_copy_(2, index, values[1])


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's values as bytes (little-endian on every platform we run on)."""
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()
