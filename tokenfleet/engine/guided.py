"""Grammar-constrained decoding, engine side: compiling grammars for a tokenizer (cached per
grammar, thread-safe so it runs off the engine thread) into the matchers requests carry. The
specs and why llguidance: ``tokenfleet.engine.grammar``; the token masks a backend's sampler
applies: ``tokenfleet.backends.torch.grammar_masks``."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np

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
        row = np.empty(mask_width(vocab_size), dtype=np.int32)
        warm.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

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
    """int32 words in one row of an allowed-token bitmask."""
    return (vocab_size + 31) // 32
