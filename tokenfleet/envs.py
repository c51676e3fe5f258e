"""Every environment variable tokenfleet reads, in one place (all prefixed ``TOKENFLEET_``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of tokenfleet's on-disk cache (imported models live under ``models/``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenfleet"
    return Path(os.environ.get("TOKENFLEET_CACHE_DIR", str(default)))


def num_threads() -> int | None:
    """Torch intra-op threads for the engine; None lets the engine pick (see backends.torch.threads)."""
    value = os.environ.get("TOKENFLEET_NUM_THREADS")
    return int(value) if value else None


def device() -> str | None:
    """Device override for the torch backend ("cpu", "cuda", "cuda:1"); None = auto."""
    return os.environ.get("TOKENFLEET_DEVICE") or None


def check_invariants() -> bool:
    """Check the KV block manager's bookkeeping after every engine step (tests, debugging; slow)."""
    return os.environ.get("TOKENFLEET_CHECK_INVARIANTS", "") not in ("", "0")


def native_kernels() -> bool:
    """Build and use the native CPU kernels (models/csrc) when a C compiler is present; "0" forces pure torch."""
    return os.environ.get("TOKENFLEET_NATIVE_KERNELS", "1") not in ("0", "false", "no")
