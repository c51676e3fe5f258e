"""Weight formats in the capacity arithmetic: "int8" with its per-channel scales, "gguf" from a GGUF file's own tensor
types (its header walked by planning.gguf_size) or a documented default, through ``tokenfleet plan`` and scenarios."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from tokenfleet.planning.calc import (
    GB,
    GGUF_DEFAULT_BITS,
    GPUS,
    INT8_SCALE_BYTES,
    MODELS,
    Layout,
    bytes_per_param,
    plan,
    weight_bytes,
)
from tokenfleet.planning.gguf_size import TypeTotal, gguf_bytes_per_param, gguf_tensor_types

gguf = pytest.importorskip("gguf")

L8 = MODELS["llama3-8b"]
H100 = GPUS["h100"]


def test_int8_weights_cost_a_byte_and_an_fp16_scale_per_32_values():
    per_layer = 32 * 128 + 2 * 8 * 128 + 4096 + 2 * 14336 + 4096  # q, k, v, o, gate, up, down rows
    assert L8.num_output_channels == 32 * per_layer + 2 * 128256  # untied: embedding and LM head rows
    assert bytes_per_param(L8, "int8") == 1 + INT8_SCALE_BYTES == 34 / 32  # the engine's Q8_0 blocks
    assert weight_bytes(L8, "int8") - weight_bytes(L8, "fp8") == pytest.approx(L8.num_params / 16)
    assert MODELS["gemma3-270m"].num_output_channels == 18 * (256 * 6 + 640 + 2 * 2048 + 640) + 262144  # tied
    assert bytes_per_param(L8, "bf16") == 2.0


def test_gguf_without_a_file_is_the_documented_default_and_unknown_formats_are_refused():
    assert bytes_per_param(L8, "gguf") == GGUF_DEFAULT_BITS / 8
    assert Layout(H100, weight_dtype="gguf").weight_bytes(L8) == pytest.approx(L8.num_params * GGUF_DEFAULT_BITS / 8)
    with pytest.raises(ValueError, match="weight dtype 'q4'"):
        bytes_per_param(L8, "q4")


def test_a_known_bytes_per_param_drives_the_plan():
    layout = Layout(H100, tp=1, weight_dtype="gguf", kv_dtype="bf16", weight_bytes_per_param=0.7)
    result = plan(L8, layout)
    assert result.weight_bytes_per_gpu == pytest.approx(0.7 * L8.num_params)
    assert result.kv_budget_bytes == pytest.approx(80 * GB - 0.7 * L8.num_params)
    default = plan(L8, Layout(H100, tp=1, weight_dtype="gguf", kv_dtype="bf16"))
    assert default.weight_bytes_per_gpu == pytest.approx(GGUF_DEFAULT_BITS / 8 * L8.num_params)


def write_gguf(path: Path) -> Path:
    """Metadata of every kind the walk skips (a string array among them), then three tensor types."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_head_count(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_token_scores([0.5] * 300)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_bool("test.flag", True)
    rng = np.random.default_rng(0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((4, 64)).astype(np.float16))
    Q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), Q8),
                      raw_dtype=Q8)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(rng.standard_normal((16, 64)).astype(np.float32), Q8),
                      raw_dtype=Q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_walk_counts_what_the_gguf_reader_counts(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    types = gguf_tensor_types(path)
    assert types == {"F16": TypeTotal(1, 256, 512), "F32": TypeTotal(1, 64, 256), "Q8_0": TypeTotal(2, 1536, 1632)}
    reader = gguf.GGUFReader(str(path))
    assert {k: v.nbytes for k, v in types.items()} == {
        k: sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name == k) for k in types}
    assert gguf_bytes_per_param(path) == (512 + 256 + 1632) / (256 + 64 + 1536)


def test_not_a_gguf_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_tensor_types(tmp_path / "x.gguf")


def test_the_default_models_gguf_costs_its_own_bytes_per_parameter():
    from tokenfleet.models.gguf_import import default_source

    path = default_source().path
    assert gguf_bytes_per_param(path) == (140_544 + 66_355_200 + 30_081_024) / (35_136 + 106_168_320 + 28_311_552)
    assert 5.7 < 8 * gguf_bytes_per_param(path) < 5.8  # a third of it an 8-bit embedding


def run_plan(capsys, *flags: str) -> dict:
    from tokenfleet.cli.plan import add_command

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers())
    args = parser.parse_args(["plan", *flags, "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_and_scenarios_take_a_gguf_file(tmp_path, capsys):
    path = write_gguf(tmp_path / "tiny.gguf")
    common = ["--model", "llama3-8b", "--gpu", "h100", "--tp", "1", "--kv-dtype", "bf16"]
    body = run_plan(capsys, *common, "--gguf", str(path))
    assert body["weight_bytes_per_gpu"] == pytest.approx(L8.num_params * gguf_bytes_per_param(path))
    body = run_plan(capsys, *common, "--weight-dtype", "gguf")
    assert body["weight_bytes_per_gpu"] == pytest.approx(L8.num_params * GGUF_DEFAULT_BITS / 8)
    body = run_plan(capsys, *common, "--weight-dtype", "int8")
    assert body["weight_bytes_per_gpu"] == pytest.approx(weight_bytes(L8, "int8"))

    from tokenfleet.planning.scenario import add_hardware_flags, hardware

    parser = argparse.ArgumentParser()
    add_hardware_flags(parser)
    model, layout = hardware(parser.parse_args(["--model", "llama3-8b", "--gguf", str(path)]))
    assert layout.weight_dtype == "gguf" and layout.weight_bytes_per_param == gguf_bytes_per_param(path)
    assert layout.weight_bytes(model) == pytest.approx(model.num_params * gguf_bytes_per_param(path))
