"""The Gemma 3 import checked independently of transformers: every tensor of the GGUF, dequantized by the `gguf`
package's own reader, equals the weight we serve from the converted folder (norms are stored as 1 + w in a
GGUF, as llama.cpp applies them; HF's Gemma adds the 1 at run time). Nightly (`scripts/test.sh -m nightly`): the
default suite already holds the converted model's answers against transformers (the correctness gate)."""

from __future__ import annotations

import numpy as np
import pytest

GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, kind, _ = name.split(".")
    return f"model.layers.{layer}.{GGUF_TO_HF[kind]}.weight"


def check(selected) -> set[str]:  # type: ignore[no-untyped-def]
    """Compare the GGUF tensors ``selected(name)`` picks with the served weights; the quantization kinds seen."""
    gguf = pytest.importorskip("gguf")
    from safetensors import safe_open

    from tokenfleet.models.gguf_import import ensure_model, gemma3_source

    folder = ensure_model("gemma3-270m")
    reader = gguf.GGUFReader(str(gemma3_source().path))
    served = safe_open(str(folder / "model.safetensors"), "pt")
    assert len(reader.tensors) == len(list(served.keys())) == 236
    kinds = set()
    for tensor in reader.tensors:
        if not selected(tensor.name):
            continue
        kinds.add(tensor.tensor_type.name)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.name.endswith("norm.weight"):
            expected = expected - 1.0  # GGUF stores Gemma's norms as 1 + w
        ours = served.get_tensor(hf_name(tensor.name)).float().numpy()
        assert ours.shape == expected.shape, tensor.name
        np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6, err_msg=tensor.name)
    return kinds


@pytest.mark.nightly  # ~30 s here, 12 of them the gguf reader parsing the 262k-token vocabulary
def test_every_gguf_tensor_equals_the_weight_we_load():
    kinds = check(lambda name: True)
    assert {"Q4_K", "F32"} <= kinds  # quantized tensors were among those compared, not only plain floats
