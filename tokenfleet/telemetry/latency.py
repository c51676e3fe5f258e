"""Recent per-request latencies (TTFT, TPOT) for load reports: a bounded window, means on demand."""

from __future__ import annotations

from collections import deque


class RecentLatencies:
    def __init__(self, window: int = 64):
        self._ttft: deque[float] = deque(maxlen=window)
        self._tpot: deque[float] = deque(maxlen=window)

    def record(self, start: float, first_token: float | None, last_token: float | None, num_tokens: int) -> None:
        """Times in seconds from one clock; a request with no token records nothing."""
        if first_token is None or last_token is None:
            return
        self._ttft.append(first_token - start)
        if num_tokens > 1:
            self._tpot.append((last_token - first_token) / (num_tokens - 1))

    @property
    def ttft_ms(self) -> float:
        return 1000 * sum(self._ttft) / len(self._ttft) if self._ttft else 0.0

    @property
    def tpot_ms(self) -> float:
        return 1000 * sum(self._tpot) / len(self._tpot) if self._tpot else 0.0
