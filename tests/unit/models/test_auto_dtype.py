"""``--dtype auto``: decided from the machine's flags, its kernels and (where those do not settle it) a short
measurement cached per machine and model; the reasons it gives."""

from __future__ import annotations

import json

import pytest
import torch

from tokenfleet.models import auto_dtype
from tokenfleet.models.auto_dtype import DtypeChoice, choose_dtype, cpu_model_and_flags

CPU = torch.device("cpu")
ZEN3 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma avx512f_absent\n"
ZEN4 = "model name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vnni\n"
SPR = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def rates(fp32: float, bf16: float, bf16_at_512: float | None = None) -> dict[str, float]:
    return {"fp32@64": fp32, "bf16@64": bf16, "fp32@512": fp32, "bf16@512": bf16 if bf16_at_512 is None else bf16_at_512}


class Measure:
    def __init__(self, result: dict[str, float]):
        self.result, self.calls = result, 0

    def __call__(self, hidden: int, intermediate: int) -> dict[str, float]:
        self.calls += 1
        return self.result


def test_cpuinfo_gives_the_model_name_and_flags():
    name, flags = cpu_model_and_flags(SPR + "\nmodel name\t: second core\nflags\t\t: other\n")
    assert name == "Intel(R) Xeon(R) Processor" and {"amx_bf16", "avx512_bf16"} <= flags and "other" not in flags
    assert cpu_model_and_flags("") == ("", frozenset())


def test_a_cpu_without_bf16_instructions_gets_float32_from_its_flags_alone(tmp_path):
    measure = Measure(rates(1.0, 100.0))
    choice = choose_dtype("auto", CPU, cache=tmp_path / "c.json", cpuinfo=ZEN3, measure=measure)
    assert (choice.dtype, choice.source, measure.calls) == ("float32", "flags", 0)
    assert "emulated" in choice.reason and choice.machine == "AMD EPYC 7B13"


@pytest.mark.parametrize("cpuinfo", [ZEN4, SPR])
def test_a_cpu_with_bf16_instructions_measures_once_then_reads_its_cache(tmp_path, cpuinfo):
    cache = tmp_path / "c.json"
    measure = Measure(rates(100.0, 400.0))
    first = choose_dtype("auto", CPU, cache=cache, cpuinfo=cpuinfo, measure=measure)
    assert (first.dtype, first.source) == ("bfloat16", "measured") and first.rates["bf16@512"] == 400.0
    assert "4.00x at 64 rows" in first.reason and "AVX512-BF16" in first.reason
    again = choose_dtype("auto", CPU, cache=cache, cpuinfo=cpuinfo, measure=measure)
    assert (again.dtype, again.source, again.rates, measure.calls) == ("bfloat16", "cached", first.rates, 1)
    other_model = choose_dtype("auto", CPU, hidden=2048, intermediate=8192, cache=cache, cpuinfo=cpuinfo,
                               measure=measure)
    assert other_model.source == "measured" and measure.calls == 2  # the cache is per model geometry


def test_bf16_must_be_faster_at_every_measured_size(tmp_path):
    slow_prefill = Measure(rates(100.0, 400.0, bf16_at_512=110.0))  # 1.1x at 512 rows: not enough
    choice = choose_dtype("auto", CPU, cache=tmp_path / "c.json", cpuinfo=ZEN4, measure=slow_prefill)
    assert (choice.dtype, choice.source) == ("float32", "measured") and "needs >= 1.25x" in choice.reason


def test_an_unwritable_cache_still_chooses(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    measure = Measure(rates(100.0, 400.0))
    for _ in range(2):
        assert choose_dtype("auto", CPU, cache=blocked / "c.json", cpuinfo=ZEN4, measure=measure).dtype == "bfloat16"
    assert measure.calls == 2


def test_a_corrupt_cache_is_measured_again(tmp_path):
    cache = tmp_path / "c.json"
    cache.write_text("{not json")
    assert choose_dtype("auto", CPU, cache=cache, cpuinfo=ZEN4, measure=Measure(rates(1.0, 9.0))).source == "measured"
    assert len(json.loads(cache.read_text())) == 1


@pytest.mark.parametrize("has_bf16", [True, False])
def test_quantized_records_follow_the_native_kernels_bf16_build(tmp_path, has_bf16):
    measure = Measure(rates(100.0, 1.0))
    for quantization in ("gguf", "int8"):
        choice = choose_dtype("auto", CPU, quantization, cache=tmp_path / "c.json", cpuinfo=ZEN4, measure=measure,
                              native_bf16=lambda: has_bf16)
        assert (choice.dtype, choice.source) == ("bfloat16" if has_bf16 else "float32", "kernel")
    assert choose_dtype("auto", CPU, "gguf", cpuinfo=ZEN3, native_bf16=lambda: True).dtype == "float32"
    assert measure.calls == 0


def test_gpus_fp8_weights_and_asked_dtypes():
    assert choose_dtype("auto", torch.device("cuda")).dtype == "bfloat16"
    assert choose_dtype("auto", CPU, "fp8", cpuinfo=ZEN3).dtype == "bfloat16"
    asked = choose_dtype("float32", torch.device("cuda"))
    assert (asked.dtype, asked.source) == ("float32", "asked")


def test_a_choice_round_trips_through_json_and_checks_its_source():
    choice = DtypeChoice("bfloat16", "why", "measured", {"fp32@64": 1.0}, "cpu")
    assert DtypeChoice.from_json(choice.to_json()) == choice
    assert DtypeChoice.from_json(json.dumps({**json.loads(choice.to_json()), "newer": 1})) == choice
    with pytest.raises(ValueError, match="source"):
        DtypeChoice("bfloat16", "why", "guessed")


def test_the_measurement_reports_both_dtypes_at_both_sizes():
    measured = auto_dtype.measure_rates(64, 128, seconds=0.001)
    assert set(measured) == {"fp32@64", "bf16@64", "fp32@512", "bf16@512"} and all(v > 0 for v in measured.values())
