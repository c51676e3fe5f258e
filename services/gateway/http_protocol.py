"""uvicorn's HTTP/1.1 protocol with a deadline on the request head.

uvicorn closes a keep-alive connection idle between requests, but not one that sends its request
line and headers a byte at a time (slow loris): such a connection is held open for as long as the
client likes. Here every request head must be complete within ``HEAD_TIMEOUT_S`` of the
connection opening (or of the previous response ending); past that the connection is closed.
Bodies are bounded by size (app.BODY_LIMITS), not by time.
"""

from __future__ import annotations

import asyncio

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger()
HEAD_TIMEOUT_S = 10.0


class HeadTimeoutH11Protocol(H11Protocol):
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in: the request runs
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head gets the same time

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection whose request head did not arrive in time", client=self.client,
                     timeout_s=HEAD_TIMEOUT_S)
            self.transport.close()
