"""Grammar-constrained decoding, engine side: compiling grammars for a tokenizer (cached per
grammar, thread-safe so it runs off the engine thread) and the token masks the sampler applies.
The specs and why llguidance: ``tokenfleet.engine.grammar``."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from tokenfleet.engine.grammar import GrammarError, Guided, grammar_text


class GuideCompiler:
    """Compiles grammars for one tokenizer and vocabulary; thread-safe; LRU-cached per grammar."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._cache: OrderedDict[Guided, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self.num_compiled = 0
        # The first mask ever computed builds the tokenizer's token trie (seconds): pay it now.
        warm = self._compile(Guided("json_object"))
        fill_masks([warm], torch.empty(1, mask_width(vocab_size), dtype=torch.int32))

    def prepare(self, guided: Guided) -> None:
        """Compile into the cache (call off the engine thread). GrammarError if it does not compile."""
        with self._lock:
            if guided in self._cache:
                self._cache.move_to_end(guided)
                return
        matcher = self._compile(guided)
        with self._lock:
            self._cache[guided] = matcher
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def matcher(self, guided: Guided) -> llguidance.LLMatcher:
        """A fresh matcher in the start state (a copy of the cached one; compiles on a miss)."""
        with self._lock:
            cached = self._cache.get(guided)
        if cached is None:
            self.prepare(guided)
            with self._lock:
                cached = self._cache[guided]
        return cached.deep_copy()

    def _compile(self, guided: Guided) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_text(guided), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {guided.kind}: {matcher.get_error()}")
        return matcher


def mask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


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
