"""structlog setup: JSON lines on stderr, one call per process. A line that cannot be written (stderr redirected to a
file on a full disk) is dropped: logging never fails the request that logged."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


class NeverFailing:
    """A text stream whose writes and flushes never raise (OSError: a full disk, a closed pipe): what cannot be
    written is dropped and counted. Everything else is the wrapped stream's."""

    def __init__(self, stream: Any):
        self.stream, self.dropped = stream, 0

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):
            self.dropped += 1
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def never_failing_stderr() -> None:
    """This process's stderr made NeverFailing (once)."""
    if not isinstance(sys.stderr, NeverFailing):
        sys.stderr = NeverFailing(sys.stderr)  # type: ignore[assignment]


def configure_logging(service: str, level: str = "INFO") -> None:
    never_failing_stderr()
    logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
