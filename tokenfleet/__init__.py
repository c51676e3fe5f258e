"""tokenfleet: an LLM inference serving platform."""

from __future__ import annotations

__version__ = "0.1.0"
