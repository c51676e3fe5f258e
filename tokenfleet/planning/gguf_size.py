"""A GGUF file's weight bytes by tensor type, from its header alone: what weight format "gguf" costs per parameter
(``calc.Layout.weight_bytes_per_param``) for the file a model would be served from.

The header is walked here rather than through ``gguf.GGUFReader``, which builds an array for every metadata value
(12 s for Gemma 3 270M's 262k-token vocabulary; this walk skips it in a fraction of a second). Layout (GGUF v2 and
v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 metadata count; each metadata entry a string
key, a u32 value type and the value (strings: u64 length and bytes; arrays: u32 item type, u64 count, the items);
then per tensor a string name, u32 dimension count, u64 dimensions (the row length first), u32 GGML type and u64
offset. Bytes of a tensor: its elements over the type's block size times the block's bytes (``gguf``'s table).
``read_header`` returns the header itself (scalar and string metadata, the tensors' entries and offsets): the
loader's mapped reader (models.gguf_weights.MappedGGUF) is built on it.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TypeTotal:
    """The tensors of one GGML type in a GGUF file: how many, their elements and their bytes."""

    count: int
    elements: int
    nbytes: int


class _Header:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> int:
        return int(self.scalar(fmt))

    def scalar(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value  # type: ignore[no-any-return]

    def string(self) -> bytes:
        n = self.unpack("<Q")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def skip(self, value_type: int) -> None:
        if value_type in _SCALAR_BYTES:
            self.pos += _SCALAR_BYTES[value_type]
        elif value_type == _STRING:
            n = self.unpack("<Q")  # read before adding: ``self.pos += self.unpack(...)`` would lose the length's 8 bytes
            self.pos += n
        elif value_type == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALAR_BYTES:
                self.pos += count * _SCALAR_BYTES[item]
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            raise ValueError(f"GGUF metadata value type {value_type} is unknown")


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a GGUF header: ``dims`` as GGUF lists them (the row length first), its GGML type id,
    and ``offset``, its bytes' start in the file."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


ARRAY_ITEMS = 1024  # arrays of scalars up to this long are read (per-layer values); longer ones (a vocabulary) skipped


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata: scalars, strings and short arrays of scalars (lists); the keys of the arrays skipped
    (strings, or longer than ARRAY_ITEMS: a vocabulary is most of a header); and its tensors' entries."""

    fields: dict[str, object]
    skipped: frozenset[str]
    tensors: tuple[TensorInfo, ...]


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of the GGUF at ``path`` (module docstring's layout), its tensors' offsets resolved: the data start
    after the tensor entries, aligned to ``general.alignment`` (32 when absent)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        h = _Header(buf)
        num_tensors, num_fields = _begin(h, path)
        fields: dict[str, object] = {}
        skipped: set[str] = set()
        for _ in range(num_fields):
            key = h.string().decode()
            value_type = h.unpack("<I")
            if value_type in _SCALAR_FORMATS:
                fields[key] = h.scalar(_SCALAR_FORMATS[value_type])
            elif value_type == _STRING:
                fields[key] = h.string().decode(errors="replace")
            elif value_type == _ARRAY and _short_scalar_array(h):
                item, count = h.unpack("<I"), h.unpack("<Q")
                fields[key] = [h.scalar(_SCALAR_FORMATS[item]) for _ in range(count)]
            else:
                skipped.add(key)
                h.skip(value_type)
        entries = []
        for _ in range(num_tensors):
            name = h.string().decode()
            dims = tuple(h.unpack("<Q") for _ in range(h.unpack("<I")))
            entries.append((name, dims, h.unpack("<I"), h.unpack("<Q")))
        alignment = int(fields.get("general.alignment", 32))  # type: ignore[call-overload]
        start = -(-h.pos // alignment) * alignment
        size = len(buf)
    tensors = tuple(TensorInfo(name, dims, type_id, start + offset) for name, dims, type_id, offset in entries)
    for t in tensors:
        if t.offset > size:
            raise ValueError(f"{os.fspath(path)}: tensor {t.name!r} starts past the file's end")
    return GGUFHeader(fields, frozenset(skipped), tensors)


def _short_scalar_array(h: _Header) -> bool:
    """Whether the array at the cursor (its item type and count not yet read) holds at most ARRAY_ITEMS scalars."""
    item, count = struct.unpack_from("<IQ", h.buf, h.pos)
    return item in _SCALAR_FORMATS and count <= ARRAY_ITEMS


def _begin(h: _Header, path: str | os.PathLike[str]) -> tuple[int, int]:
    """Checks the magic and version; (tensor count, metadata count)."""
    if h.buf[:4] != b"GGUF":
        raise ValueError(f"{os.fspath(path)}: not a GGUF file")
    h.pos = 4
    version = h.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{os.fspath(path)}: GGUF version {version} (little-endian 2 or 3 are read)")
    return h.unpack("<Q"), h.unpack("<Q")


def gguf_tensor_types(path: str | os.PathLike[str]) -> dict[str, TypeTotal]:
    """Every tensor of the GGUF at ``path`` by GGML type name (F32, Q4_K, ...): count, elements, bytes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    totals: dict[str, list[int]] = {}
    for t in read_header(path).tensors:  # the same walk the loader's reader makes
        try:
            kind = GGMLQuantizationType(t.type_id)
        except ValueError:
            raise ValueError(f"{os.fspath(path)}: tensor {t.name!r} has unknown GGML type {t.type_id}") from None
        elements = 1
        for d in t.dims:
            elements *= d
        block_elems, block_bytes = GGML_QUANT_SIZES[kind]
        total = totals.setdefault(kind.name, [0, 0, 0])
        total[0] += 1
        total[1] += elements
        total[2] += elements // block_elems * block_bytes
    return {k: TypeTotal(*v) for k, v in sorted(totals.items())}


def gguf_bytes_per_param(path: str | os.PathLike[str]) -> float:
    """The GGUF's tensor bytes over its elements: weight bytes per parameter served as the file ships."""
    types = gguf_tensor_types(path).values()
    return sum(t.nbytes for t in types) / sum(t.elements for t in types)
