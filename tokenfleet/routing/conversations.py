"""Where each conversation was served last: a bounded map, least recently used first out, whose entries expire.

A router remembers, after every pick of a request that continues a conversation, the replica it chose and how long
that turn's prompt was (``placement.ConversationHome``); the conversation's next turn is placed there while that
replica can take it. Keys are (model, version, conversation): a conversation never follows a replica of another
model or version, whose KV it could not use. The conversation is already a digest scoped to its tenant (the
gateway's), so two tenants never share an entry.

Pure: no clock (callers pass ``now``, in seconds of any monotonic clock) and no I/O, so the router, tests and the
simulator drive it alike. Memory is bounded by ``max_entries`` (about 200 bytes each: the key's strings, one block
hash, two numbers); an entry older than ``ttl_s`` is treated as absent, because by then the replica has let the
conversation's retained blocks go and the prefix-aware choice knows as much as the entry would.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenfleet.routing.placement import ConversationHome

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_ENTRIES = 100_000


@dataclass(frozen=True)
class ConversationConfig:
    ttl_s: float = DEFAULT_TTL_S  # an entry unused for this long is forgotten
    max_entries: int = DEFAULT_MAX_ENTRIES  # past this, the least recently used entry is forgotten

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {self.ttl_s}")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}")


class ConversationHomes:
    """(model, version, conversation) -> (its home, when it was recorded). ``home`` and ``remember`` mutate only
    this map; neither raises for an unknown or expired conversation. Entries are ordered by when they were
    recorded, so the expired ones are always the first out."""

    def __init__(self, config: ConversationConfig = ConversationConfig()):
        self.config = config
        self._entries: OrderedDict[tuple[str, str, str], tuple[ConversationHome, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def home(self, model: str, version: str, conversation: str, now: float) -> ConversationHome | None:
        """The conversation's home, unless it has none or it expired (an expired entry is dropped)."""
        key = (model, version, conversation)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now - entry[1] > self.config.ttl_s:
            del self._entries[key]
            return None
        return entry[0]

    def remember(self, model: str, version: str, conversation: str, home: ConversationHome, now: float) -> None:
        """Record where the conversation's latest turn went; it becomes the most recently used entry, and the
        least recently recorded ones go while the map is over its size."""
        key = (model, version, conversation)
        self._entries[key] = (home, now)
        self._entries.move_to_end(key)
        while len(self._entries) > self.config.max_entries:
            self._entries.popitem(last=False)
