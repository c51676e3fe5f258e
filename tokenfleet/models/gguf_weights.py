"""A GGUF file's weights read as they ship: block-quantized matrices stay quantized (``ggml_quant.QuantTensor``),
float ones come back as torch tensors, all under the names ``loader.read_safetensors`` gives the imported folder
(``layers.0.self_attn.q_proj.weight``, ``embed_tokens.weight``, ``norm.weight``, ...).

The file is memory-mapped (``MappedGGUF``, copy-on-write: a tensor written to changes private pages, never the
file) and every tensor is a ``torch.from_numpy`` view of the mapping, except where the converter's changes are
undone, which copies:

- Llama (``general.architecture`` "llama"): llama.cpp's converter reorders the rows of each head of the Q and K
  projections from the two-halves rotary layout HF uses to the interleaved pairs llama.cpp rotates (row ``2i + j`` of
  a head holds HF's row ``j * head_dim / 2 + i``); we put HF's order back. Rows are independent, so on a quantized
  matrix this is a row selection of its bytes (``QuantTensor.select_rows``): Q and K of every layer are copied
  (SmolLM2 135M: 60 matrices, 8.3 MB of its 96.6 MB).
- Gemma 3 (``gemma3``): the converter stores each RMSNorm weight as ``1 + w`` (the factor llama.cpp multiplies by);
  HF's weights, and so the imported folder, hold ``w``, and our loader adds the 1 back. The norms (fp32, 224 KB for
  Gemma 3 270M) come back as ``w = stored - 1`` in fp32, new tensors; nothing else is changed (no rotary permutation:
  Gemma's converter keeps HF's layout).

Only the architectures our loader serves are read. A tensor type that is neither a float type nor one of
``ggml_quant.TYPES``, or a tensor name we cannot place, is a ``ValueError`` naming the tensor, before any tensor is
built. Tied embeddings: a GGUF of a tied model has no ``output.weight``, so no ``lm_head.weight`` comes back.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenfleet.models.ggml_quant import BY_ID, QuantTensor

ARCHITECTURES = ("llama", "gemma3")

# per-layer tensors: GGUF ``blk.N.<key>.weight`` -> ``layers.N.<value>.weight``
_LAYER_COMMON = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_NAMES = {
    # Llama has one norm before the MLP: GGUF's ffn_norm is HF's post_attention_layernorm
    "llama": {**_LAYER_COMMON, "ffn_norm": "post_attention_layernorm"},
    # Gemma 3 has four norms around its two blocks, and RMSNorms on the heads' queries and keys
    "gemma3": {**_LAYER_COMMON,
               "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm"},
}
GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}
# In some Llama 3 GGUFs: the llama3 rope scaling's per-frequency factors, which the config's rope_scaling also gives
SKIPPED = frozenset({"rope_freqs.weight"})

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(architecture: str, gguf_name: str) -> str | None:
    """Our name of the GGUF tensor ``gguf_name``; None for a tensor that is skipped on purpose (``SKIPPED``);
    ValueError for one we cannot place."""
    if gguf_name in SKIPPED:
        return None
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    names = LAYER_NAMES[architecture]
    if m is None or m.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {architecture} model")
    return f"layers.{m.group(1)}.{names[m.group(2)]}.weight"


def _field(reader, key: str):  # type: ignore[no-untyped-def]
    """A metadata value (None when absent); a key whose array the header reader skipped is an error, not absent."""
    if key in reader.skipped:
        raise ValueError(f"GGUF field {key!r} is an array we do not read")
    return reader.fields.get(key)


def _count(reader, key: str) -> int | None:  # type: ignore[no-untyped-def]
    value = _field(reader, key)
    if isinstance(value, list):  # per-layer values
        raise ValueError(f"GGUF field {key!r} varies by layer ({value[:4]}...): not a model our loader serves")
    return None if value is None else int(value)  # type: ignore[call-overload]


def architecture(reader) -> str:  # type: ignore[no-untyped-def]
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not one we read: {', '.join(ARCHITECTURES)}")
    return str(arch)


@dataclass(frozen=True)
class MappedTensor:
    """One tensor of a ``MappedGGUF``: ``shape`` as GGUF lists it (the row length first), ``data`` its bytes in the
    mapping (F32 and F16: typed numpy views; other types: uint8)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


class MappedGGUF:
    """A GGUF file memory-mapped copy-on-write (writable views, the file never written), its header read by
    planning.gguf_size.read_header: scalar and string metadata (``fields``), and each tensor a view of the mapping
    (``tensors``). gguf.GGUFReader builds an array for every metadata item, the vocabulary's included: about 12 s for
    Gemma 3's 262k tokens at every load; this reads the same header in a fraction of a second."""

    def __init__(self, path: str | os.PathLike[str]):
        from tokenfleet.planning.gguf_size import read_header

        header = read_header(path)
        self.fields, self.skipped = header.fields, header.skipped
        self.data = np.memmap(os.fspath(path), dtype=np.uint8, mode="c")
        self.tensors: list[MappedTensor] = []
        for t in header.tensors:
            try:
                kind = GGMLQuantizationType(t.type_id)
            except ValueError:
                raise ValueError(f"GGUF tensor {t.name!r} has unknown GGML type {t.type_id}") from None
            elements = int(np.prod(t.dims)) if t.dims else 1
            block_elems, block_bytes = GGML_QUANT_SIZES[kind]
            if elements % block_elems:
                raise ValueError(f"GGUF tensor {t.name!r}: {elements} values do not fill {kind.name} blocks")
            raw = self.data[t.offset:t.offset + elements // block_elems * block_bytes]
            if raw.size != elements // block_elems * block_bytes:
                raise ValueError(f"GGUF tensor {t.name!r} runs past the file's end")
            data = raw.view(np.float32) if kind.name == "F32" else raw.view(np.float16) if kind.name == "F16" else raw
            self.tensors.append(MappedTensor(t.name, kind, np.array(t.dims, dtype=np.int64), data))


def open_gguf(path: str | os.PathLike[str]) -> MappedGGUF:
    """The GGUF at ``path``, mapped (``MappedGGUF``)."""
    return MappedGGUF(path)


def drop_resident_pages(reader) -> None:  # type: ignore[no-untyped-def]
    """Let the file's mapped pages leave this process's resident set (madvise MADV_DONTNEED), once the model's
    weights are built: building them read every tensor (the fused Q/K/V and gate/up rows are copies), which left
    the whole file resident beside those copies. The tensors the model still views (the rest) fault back in from
    the page cache on first use. The mapping is copy-on-write, and only the quantized blocks, which nothing writes,
    stay views of it (``_tensor`` copies float tensors), so its pages are the file's and nothing is lost. Linux only;
    elsewhere nothing happens."""
    import ctypes
    import mmap
    import sys

    if not sys.platform.startswith("linux"):
        return
    address, size = reader.data.ctypes.data, reader.data.nbytes
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, size + address - start, mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of the GGUF mapping failed")


def _rotary_rows(rows: int, heads: int) -> torch.Tensor:
    """For each HF row of a Q or K projection with ``heads`` heads, the GGUF row that holds it: HF's row
    ``j * half + i`` of a head (``j`` in 0, 1; ``i`` < half) is the converter's row ``2i + j`` of that head."""
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of rotary pairs")
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _tensor(t) -> QuantTensor | torch.Tensor:  # type: ignore[no-untyped-def]
    """One ``ReaderTensor`` as a view of the mapping: [rows, cols] with cols GGUF's ne[0] (the row length)."""
    kind = t.tensor_type.name
    dims = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne[0] (the row length) first
    # float tensors are copied out of the mapping (norms: a few KB): only quantized blocks, which nothing writes,
    # stay views of it, so drop_resident_pages can never revert a written page
    if kind in ("F32", "F16"):
        return torch.from_numpy(t.data).reshape(dims).clone()
    if kind == "BF16":  # numpy has no bfloat16: the reader hands the bytes
        return torch.from_numpy(t.data).view(torch.bfloat16).reshape(dims).clone()
    _check_type(t)
    cols = dims[-1]
    rows = int(np.prod(dims[:-1])) if len(dims) > 1 else 1
    return QuantTensor(kind, rows, cols, torch.from_numpy(t.data).reshape(rows, -1))


def read_gguf_weights(path: str | os.PathLike[str]) -> dict[str, QuantTensor | torch.Tensor]:
    """The weights of the GGUF at ``path`` under our names (module docstring): quantized ones as ``QuantTensor``,
    float ones (norms, and whatever the file keeps in F32/F16/BF16) as torch tensors in the file's dtype."""
    return weights_from_reader(open_gguf(path))


def weights_from_reader(reader) -> dict[str, QuantTensor | torch.Tensor]:  # type: ignore[no-untyped-def]
    """``read_gguf_weights`` of an open reader (``open_gguf``); the views keep its mapping alive."""
    arch = architecture(reader)
    named = [(hf_name(arch, t.name), t) for t in reader.tensors]
    for name, t in named:  # every type checked before anything is built
        if name is not None:
            _check_type(t)
    heads = kv_heads = 0
    if arch == "llama":
        count = _count(reader, "llama.attention.head_count")
        if count is None:
            raise ValueError("a llama GGUF without llama.attention.head_count: its Q and K rows cannot be put back")
        heads = count
        kv_heads = _count(reader, "llama.attention.head_count_kv") or heads
    out: dict[str, QuantTensor | torch.Tensor] = {}
    for name, t in named:
        if name is None:
            continue
        w = _tensor(t)
        if arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            index = _rotary_rows(w.shape[0], heads if ".q_proj." in name else kv_heads)
            w = w.select_rows(index) if isinstance(w, QuantTensor) else w.index_select(0, index)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            if isinstance(w, QuantTensor):
                raise ValueError(f"GGUF tensor {t.name!r}: a quantized ({w.kind}) norm")
            w = w.float() - 1.0
        out[name] = w
    return out


def _check_type(t) -> None:  # type: ignore[no-untyped-def]
    kind = t.tensor_type.name
    if kind in ("F32", "F16", "BF16"):
        return
    quant = BY_ID.get(int(t.tensor_type))
    if quant is None or quant.name != kind:
        raise ValueError(f"GGUF tensor {t.name!r} has type {kind}, which we do not read "
                         f"(float: F32, F16, BF16; quantized: {', '.join(q.name for q in BY_ID.values())})")
