"""Grammar masks for the torch sampler: the matchers' allowed-token bitmasks (llguidance writes
them, one int32 row per guided request) applied to a step's logits as -inf."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from tokenfleet.engine.guided import mask_width

__all__ = ["apply_masks", "fill_masks", "mask_width"]


def fill_masks(matchers: Sequence[llguidance.LLMatcher], out: torch.Tensor) -> None:
    """Allowed-token bitmasks, one int32 row per matcher, into ``out`` (CPU, contiguous)."""
    row_bytes = out.shape[1] * 4
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(out[i].data_ptr(), row_bytes)


def apply_masks(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Set to -inf the logits of tokens a row's bitmask forbids (in place on ``logits[rows]``).
    The packed mask (vocab/32 words a row) moves to the logits' device and is unpacked there."""
    vocab, device = logits.shape[-1], logits.device
    if device.type == "cpu":  # numpy's unpackbits is several times faster than tensor ops here
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        forbidden = torch.from_numpy(bits) == 0
    else:
        packed = bitmask.to(device, non_blocking=True)
        forbidden = ((packed.unsqueeze(-1) & _bit_values(device)) == 0).reshape(len(rows), -1)[:, :vocab]
    if list(rows) == list(range(logits.shape[0])):  # every row guided: edit in place
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(list(rows), dtype=torch.long, device=device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(forbidden, float("-inf"))
    logits.index_copy_(0, index, sub)


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    """1 << i for i in 0..31 as int32 (bit 31 is the sign bit), on ``device``."""
    if device not in _BIT_VALUES:
        values = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)
        _BIT_VALUES[device] = values.to(device)
    return _BIT_VALUES[device]
