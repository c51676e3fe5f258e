"""Where the second KV tier's records live (``kv_tier``): the media, the record header a restarted worker's
index is rebuilt from, and what names and seals a store (its namespace, the AES key file).

- ``MemoryStore``: host memory (on CUDA the core's copies to it are the device -> host transfers).
- ``DiskStore``: one file per block, what a CPU node uses, its pool being RAM already. The directory is created
  0700 and files 0600: they hold tenants' prompts in KV form. A store directory serves one namespace; the
  siblings of other namespaces (another model version or layout) are deleted when it opens.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

MAGIC = b"TFKV"
VERSION = 1
HEADER = struct.Struct("<4sBBH")  # magic, version, flags (1: sealed), tenant length
DIGEST = 16


class BlockStore(Protocol):
    name: str
    persistent: bool  # outlives the process (the pool is copied into it at shutdown)

    def write(self, key: str, data: bytes) -> None: ...

    def read(self, key: str) -> bytes | None: ...

    def delete(self, key: str) -> None: ...

    def scan(self) -> Iterable[tuple[str, int, float, bytes]]:
        """(key, size, last use, the record's first bytes) of what is stored, for an index rebuilt at start."""
        ...


class MemoryStore:
    name = "memory"
    persistent = False

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def write(self, key: str, data: bytes) -> None:
        with self._lock:
            self._data[key] = data

    def read(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def scan(self) -> Iterable[tuple[str, int, float, bytes]]:
        return []  # host memory does not outlive the process


class DiskStore:
    """One file per block under ``root/<namespace>``, written to a temporary name then renamed."""

    name = "disk"
    persistent = True  # outlives the process: a restarted worker finds its records

    def __init__(self, root: str | Path, namespace: str):
        self.root = Path(root)
        self.dir = self.root / namespace
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sibling in self.root.iterdir():  # other namespaces: another model version or KV layout
            if sibling.is_dir() and sibling.name != namespace:
                shutil.rmtree(sibling, ignore_errors=True)
        self.dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)
        os.chmod(self.dir, 0o700)

    def write(self, key: str, data: bytes) -> None:
        path = self.dir / key
        tmp = self.dir / f".{key}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, key: str) -> bytes | None:
        try:
            path = self.dir / key
            data = path.read_bytes()
            os.utime(path)  # a restore is a use: a restarted worker's index keeps recently used records
            return data
        except OSError:
            return None

    def delete(self, key: str) -> None:
        (self.dir / key).unlink(missing_ok=True)

    def scan(self) -> Iterable[tuple[str, int, float, bytes]]:
        for entry in os.scandir(self.dir):
            if entry.is_file() and not entry.name.startswith("."):
                st = entry.stat()
                with open(entry.path, "rb") as f:  # the header and tenant only, not the block
                    head = f.read(HEADER.size)
                    if len(head) == HEADER.size:
                        head += f.read(HEADER.unpack(head)[3])
                yield entry.name, st.st_size, st.st_mtime, head
            elif entry.name.startswith("."):  # a write cut short by a crash
                Path(entry.path).unlink(missing_ok=True)


def namespace(layout_key: str, model_dir: str | Path) -> str:
    """Names what a stored block is valid for: the KV layout and the exact weights (every file of the
    model folder but the tokenizer's, hashed), so a new model version starts an empty tier."""
    h = hashlib.blake2b(layout_key.encode(), digest_size=16)
    for path in sorted(Path(model_dir).glob("*")):
        if path.is_file() and (path.suffix == ".safetensors" or path.name == "config.json"):
            h.update(path.name.encode())
            with path.open("rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()


def open_store(spec: str, namespace_: str) -> BlockStore:
    """``memory`` or ``disk:DIR``."""
    if spec == "memory":
        return MemoryStore()
    if spec.startswith("disk:") and len(spec) > 5:
        return DiskStore(spec[5:], namespace_)
    raise ValueError(f"KV tier {spec!r}: expected 'memory' or 'disk:DIR'")


def read_key(path: str) -> bytes | None:
    """The AES key in ``path`` (raw 16/24/32 bytes, or them in hex); None for no path. The file must not be
    readable by others."""
    if not path:
        return None
    p = Path(path)
    if p.stat().st_mode & 0o077:
        raise ValueError(f"{path}: a KV tier key file must be readable by its owner only (chmod 600)")
    raw = p.read_bytes().strip()
    try:
        return bytes.fromhex(raw.decode()) if len(raw) in (32, 48, 64) else raw
    except (UnicodeDecodeError, ValueError):
        return raw
