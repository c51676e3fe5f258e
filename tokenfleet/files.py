"""Writing a file so that a reader never sees it half-written: the one helper for files processes
re-read while others may replace them (certificates, the tenants file)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a temporary file beside ``path`` (created with ``mode``), flush it to disk,
    then rename it over ``path``: readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)  # the umask may have narrowed O_CREAT's mode
    os.replace(tmp, path)
