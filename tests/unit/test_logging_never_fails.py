"""A log line that cannot be written (stderr on a full disk) is dropped, never raised into the request that logged."""

from __future__ import annotations

import io

import pytest

from tokenfleet.telemetry.logging import NeverFailing


class FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")


def test_writes_to_a_full_disk_are_dropped_and_counted_and_the_rest_passes_through():
    stream = NeverFailing(FullDisk())
    print("a log line", file=stream, flush=True)  # what structlog's PrintLogger does
    assert stream.dropped == 2  # the line and its newline
    with pytest.raises(OSError):
        print("x", file=FullDisk())
    ok = NeverFailing(io.StringIO())
    print("kept", file=ok, flush=True)
    assert ok.getvalue() == "kept\n" and ok.dropped == 0  # other attributes are the stream's
