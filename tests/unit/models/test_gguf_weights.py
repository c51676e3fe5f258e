"""GGUF weights read as they ship (models.gguf_weights): every tensor of both shipped GGUFs, dequantized by the `gguf`
package's numpy reference, equals the imported folder's fp32 tensor of the same name bit for bit, and the names are the
ones the loader takes; small written GGUFs check the rotary un-permutation, the float types and the refusals.

What the shipped files hold (tensor data; the rest of a file is its header, mostly the tokenizer's vocabulary):

SmolLM2-135M-Instruct.Q4_1.gguf, 98,362,432 bytes, 272 tensors:
  Q4_1   210 tensors  66,355,200 bytes  (every projection)
  Q8_0     1 tensor   30,081,024 bytes  (the tied embedding)
  F32     61 tensors     140,544 bytes  (norms)
  quantized 96,436,224 bytes (98.0% of the file); 96,576,768 bytes of tensors in all

gemma-3-270m-q4_k_m.gguf, 253,113,024 bytes, 236 tensors:
  Q8_0    10 tensors 179,824,640 bytes  (the tied embedding, 178,257,920 of them; 9 v projections)
  Q5_0    81 tensors  43,591,680 bytes  (q, k, gate, up; 9 v projections)
  Q4_K    27 tensors  13,271,040 bytes  (o projections; 9 down projections)
  Q6_K     9 tensors   9,676,800 bytes  (9 down projections)
  F32    109 tensors     223,744 bytes  (norms)
  quantized 246,364,160 bytes (97.3% of the file); 246,587,904 bytes of tensors in all
  Q4_K_M's K-quants need rows of whole 256-value blocks: the 640-wide rows (q, k, v, gate, up, the embedding) fall
  back to Q5_0 / Q8_0. Layers 0, 1, 4, 7, 10, 13, 15, 16, 17 get the larger types for v (Q8_0, where q and k are
  Q5_0: one layer's q, k and v are not all one type) and down (Q6_K; Q4_K elsewhere).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tokenfleet.models.config import ModelConfig
from tokenfleet.models.ggml_quant import QuantTensor
from tokenfleet.models.gguf_weights import open_gguf, read_gguf_weights, weights_from_reader
from tokenfleet.planning.gguf_size import TypeTotal, gguf_tensor_types

gguf = pytest.importorskip("gguf")

SMOLLM2_TYPES = {
    "F32": TypeTotal(61, 35_136, 140_544),
    "Q4_1": TypeTotal(210, 106_168_320, 66_355_200),
    "Q8_0": TypeTotal(1, 28_311_552, 30_081_024),
}
SMOLLM2_FILE_BYTES = 98_362_432
GEMMA3_TYPES = {
    "F32": TypeTotal(109, 55_936, 223_744),
    "Q4_K": TypeTotal(27, 23_592_960, 13_271_040),
    "Q5_0": TypeTotal(81, 63_406_080, 43_591_680),
    "Q6_K": TypeTotal(9, 11_796_480, 9_676_800),
    "Q8_0": TypeTotal(10, 169_246_720, 179_824_640),
}
GEMMA3_FILE_BYTES = 253_113_024


def loader_names(config: ModelConfig) -> set[str]:
    """The tensors loader._build_weights / _gemma3_weights take for ``config`` (tied: no lm_head)."""
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    if config.is_gemma3:
        per_layer += ["self_attn.q_norm", "self_attn.k_norm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    names = {f"layers.{i}.{n}.weight" for i in range(config.num_layers) for n in per_layer}
    names |= {"embed_tokens.weight", "norm.weight"}
    return names if config.tie_word_embeddings else names | {"lm_head.weight"}


def dequantized(w: QuantTensor | torch.Tensor) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return w.float()
    values = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType[w.kind])
    return torch.from_numpy(values).reshape(w.rows, w.cols)


def check_model(gguf_path: Path, folder: Path, types: dict[str, TypeTotal], file_bytes: int) -> None:
    from safetensors import safe_open

    reference = gguf.GGUFReader(str(gguf_path))
    reader = open_gguf(gguf_path)  # our header walk and mapping: the same tensors, bytes and scalar fields
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in reader.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in reference.tensors]
    for ours, theirs in zip(reader.tensors, reference.tensors, strict=True):
        assert ours.data.dtype == theirs.data.dtype or ours.tensor_type.name not in ("F32", "F16"), ours.name
        assert np.array_equal(ours.data.view(np.uint8).reshape(-1), theirs.data.view(np.uint8).reshape(-1)), ours.name
    for key in ("general.architecture", "general.alignment", f"{reader.fields['general.architecture']}.block_count",
                f"{reader.fields['general.architecture']}.attention.head_count"):
        if key in reference.fields:
            assert reader.fields[key] == reference.fields[key].contents(), key
    from tokenfleet.models.gguf_import import gguf_pre_tokenizer

    pre = reference.fields.get("tokenizer.ggml.pre")
    assert gguf_pre_tokenizer(gguf_path) == (pre.contents() if pre is not None else None)
    assert "tokenizer.ggml.tokens" in reader.skipped  # the vocabulary: skipped, and asking for it is an error
    assert gguf_tensor_types(gguf_path) == types  # the planner's header walk
    assert {k: (v.count, v.elements, v.nbytes) for k, v in types.items()} == {  # the gguf package's reader
        k: (sum(1 for t in reference.tensors if t.tensor_type.name == k),
            sum(int(t.n_elements) for t in reference.tensors if t.tensor_type.name == k),
            sum(int(t.n_bytes) for t in reference.tensors if t.tensor_type.name == k)) for k in types}
    assert len(reader.tensors) == sum(v.count for v in types.values())
    assert gguf_path.stat().st_size == file_bytes
    weights = weights_from_reader(reader)
    config = ModelConfig.from_dir(folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as imported:
        assert set(weights) == {k.removeprefix("model.") for k in imported.keys()} == loader_names(config)
        for name, w in weights.items():
            ours, theirs = dequantized(w), imported.get_tensor("model." + name)
            assert ours.dtype == theirs.dtype == torch.float32, name
            assert torch.equal(ours, theirs), name
    quantized = {t.name: t for t in reader.tensors if t.tensor_type.name != "F32"}
    assert sum(w.nbytes for w in weights.values() if isinstance(w, QuantTensor)) == sum(
        int(t.n_bytes) for t in reference.tensors if t.tensor_type.name != "F32")
    # the embedding and V (not permuted) are views of the mapped file, not copies
    views = {"token_embd.weight": "embed_tokens.weight", "blk.0.attn_v.weight": "layers.0.self_attn.v_proj.weight"}
    for gguf_name, name in views.items():
        w = weights[name]
        assert isinstance(w, QuantTensor) and w.data.data_ptr() == quantized[gguf_name].data.ctypes.data


def test_smollm2_gguf_weights_equal_the_imported_ones(default_model_dir):
    from tokenfleet.models.gguf_import import default_source

    check_model(default_source().path, default_model_dir, SMOLLM2_TYPES, SMOLLM2_FILE_BYTES)


def test_gemma3_gguf_weights_equal_the_imported_ones():
    from tokenfleet.models.gguf_import import GEMMA3_MODEL_NAME, ensure_model, gemma3_source

    # ~18 s (not marked slow: under 20), 12 of them the gguf reader parsing the header's 262k-token vocabulary
    check_model(gemma3_source().path, ensure_model(GEMMA3_MODEL_NAME), GEMMA3_TYPES, GEMMA3_FILE_BYTES)


# ---- small written GGUFs ----------------------------------------------------------------------------------------


def converter_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of a Q or K projection: each head's two halves interleaved in pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]], heads: int = 2,
               kv_heads: int | list[int] = 1) -> Path:
    """``tensors``: GGUF name -> (float32 values [rows, cols], GGMLQuantizationType to store them as)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    for name, (values, kind) in tensors.items():
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif kind == gguf.GGMLQuantizationType.BF16:
            bits = torch.from_numpy(values.astype(np.float32)).bfloat16().view(torch.uint16).numpy()
            writer.add_tensor(name, bits.view(np.uint8).reshape(*values.shape[:-1], -1), raw_dtype=kind)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values.astype(np.float32), kind), raw_dtype=kind)  # bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_q_and_k_rows_come_back_in_hf_order_quantized_or_not(tmp_path):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2 * 8, 64)).astype(np.float32), rng.standard_normal((1 * 8, 64)).astype(np.float32)
    Q8, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    path = write_gguf(tmp_path / "m.gguf", "llama", {
        "blk.0.attn_q.weight": (converter_permute(q, 2), Q8),
        "blk.0.attn_k.weight": (converter_permute(k, 1), F32),
        "blk.0.attn_v.weight": (k, Q8),
    })
    weights = read_gguf_weights(path)
    assert set(weights) == {f"layers.0.self_attn.{x}_proj.weight" for x in "qkv"}
    wq = weights["layers.0.self_attn.q_proj.weight"]
    assert isinstance(wq, QuantTensor) and wq.kind == "Q8_0" and wq.shape == (16, 64)
    expected_q = gguf.quants.dequantize(gguf.quants.quantize(q, Q8), Q8)  # the rows' own rounding, in HF order
    assert torch.equal(dequantized(wq), torch.from_numpy(expected_q))
    assert torch.equal(weights["layers.0.self_attn.k_proj.weight"], torch.from_numpy(k))
    expected_v = gguf.quants.dequantize(gguf.quants.quantize(k, Q8), Q8)  # V is not permuted
    assert torch.equal(dequantized(weights["layers.0.self_attn.v_proj.weight"]), torch.from_numpy(expected_v))


def test_float_types_keep_their_dtype_and_gemma3_norms_lose_their_stored_one(tmp_path):
    rng = np.random.default_rng(1)
    norm = rng.standard_normal(32).astype(np.float32)
    proj = rng.standard_normal((4, 32)).astype(np.float32)
    T = gguf.GGMLQuantizationType
    path = write_gguf(tmp_path / "g.gguf", "gemma3", {
        "blk.0.attn_q_norm.weight": (1.0 + norm, T.F32),
        "blk.0.attn_q.weight": (proj, T.F16),
        "blk.0.attn_k.weight": (proj, T.BF16),
        "blk.0.post_ffw_norm.weight": (1.0 + norm, T.F32),
    })
    weights = read_gguf_weights(path)
    assert torch.equal(weights["layers.0.self_attn.q_norm.weight"], torch.from_numpy((1.0 + norm) - 1.0))
    assert torch.equal(weights["layers.0.post_feedforward_layernorm.weight"], torch.from_numpy((1.0 + norm) - 1.0))
    q, k = weights["layers.0.self_attn.q_proj.weight"], weights["layers.0.self_attn.k_proj.weight"]
    assert isinstance(q, torch.Tensor) and q.dtype == torch.float16 and torch.equal(q, torch.from_numpy(proj).half())
    assert isinstance(k, torch.Tensor) and k.dtype == torch.bfloat16 and torch.equal(k, torch.from_numpy(proj).bfloat16())


def test_a_type_we_do_not_read_names_the_tensor(tmp_path):
    values = np.ones((2, 32), np.float32)
    path = write_gguf(tmp_path / "q4_0.gguf", "llama", {"blk.3.ffn_up.weight": (values, gguf.GGMLQuantizationType.Q4_0)})
    with pytest.raises(ValueError, match=r"'blk\.3\.ffn_up\.weight' has type Q4_0"):
        read_gguf_weights(path)


def test_unknown_tensors_and_architectures_are_refused(tmp_path):
    F32 = gguf.GGMLQuantizationType.F32
    values = np.ones((2, 32), np.float32)
    llama_with_q_norm = write_gguf(tmp_path / "a.gguf", "llama", {"blk.0.attn_q_norm.weight": (values, F32)})
    with pytest.raises(ValueError, match="'blk.0.attn_q_norm.weight' has no place in a llama model"):
        read_gguf_weights(llama_with_q_norm)
    with pytest.raises(ValueError, match="architecture 'qwen2'"):
        read_gguf_weights(write_gguf(tmp_path / "b.gguf", "qwen2", {"blk.0.attn_q.weight": (values, F32)}))
    skipped = write_gguf(tmp_path / "c.gguf", "llama", {"rope_freqs.weight": (values[0], F32), "output.weight": (values, F32)})
    assert set(read_gguf_weights(skipped)) == {"lm_head.weight"}


def mapping_rss_kb(address: int) -> int:
    """This process's resident kB of the mapping holding ``address`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(v, 16) for v in head.split("-"))
            if start <= address < end:
                rss = next(entry for entry in lines[i + 1:] if entry.startswith("Rss:"))
                return int(rss.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux: /proc/self/smaps")
def test_dropping_the_mappings_resident_pages_keeps_every_value(tmp_path):
    """gguf_weights.drop_resident_pages after the weights are built: the mapping leaves the resident set, and the
    views fault back in with the file's bytes."""
    from tokenfleet.models.gguf_weights import drop_resident_pages

    rng = np.random.default_rng(3)
    path = write_gguf(tmp_path / "m.gguf", "llama", {
        "blk.0.ffn_down.weight": (rng.standard_normal((64, 1024)), gguf.GGMLQuantizationType.Q8_0),  # several pages
        "output_norm.weight": (rng.standard_normal((1, 64)), gguf.GGMLQuantizationType.F32)})
    reader = open_gguf(path)
    weights = weights_from_reader(reader)
    before = {name: dequantized(w).clone() for name, w in weights.items()}  # every page read
    assert mapping_rss_kb(reader.data.ctypes.data) >= 64
    drop_resident_pages(reader)
    assert mapping_rss_kb(reader.data.ctypes.data) == 0
    for name, w in weights.items():
        assert torch.equal(dequantized(w), before[name]), name


def test_per_layer_head_counts_are_refused_by_name(tmp_path):
    """The header reader keeps short arrays (per-layer values): a model whose KV heads vary by layer is refused
    with the field named, not read as one count."""
    rng = np.random.default_rng(4)
    path = write_gguf(tmp_path / "m.gguf", "llama", {
        "blk.0.attn_k.weight": (rng.standard_normal((64, 64)), gguf.GGMLQuantizationType.Q8_0)}, kv_heads=[1, 2])
    reader = open_gguf(path)
    assert reader.fields["llama.attention.head_count_kv"] == [1, 2]
    with pytest.raises(ValueError, match="head_count_kv.*varies by layer"):
        weights_from_reader(reader)
