"""What tokens cost: GPU time at each model's throughput and the price per GPU-hour; the usage report's usd column."""

from __future__ import annotations

import pytest

from tokenfleet.tenancy.ledger import Ledger, UsageRecord, format_report, report
from tokenfleet.tenancy.pricing import ModelPrice, Pricing


def test_cost_is_gpu_time_of_the_uncached_prompt_and_the_output():
    pricing = Pricing(usd_per_gpu_hour=3.6, models={"big": ModelPrice(gpus=8, prefill_tokens_per_s=1000,
                                                                       decode_tokens_per_s=100)})
    # 1000 prompt tokens, 400 cached: 0.6 s of prefill; 50 output tokens: 0.5 s; x 8 GPUs = 8.8 GPU-seconds
    assert pricing.gpu_seconds("big", 1000, 400, 50) == pytest.approx(8.8)
    assert pricing.cost("big@3", 1000, 400, 50) == pytest.approx(8.8 * 3.6 / 3600)  # name@version: the name's price
    assert pricing.price("other") == pricing.default
    assert pricing.cost("big", 100, 100, 0) == 0.0  # a fully cached prompt and no output cost nothing


def test_pricing_files_are_checked(tmp_path):
    path = tmp_path / "pricing.yaml"
    path.write_text("usd_per_gpu_hour: 4\ndefault: {gpus: 2}\nmodels:\n  smol: {decode_tokens_per_s: 1000}\n")
    pricing = Pricing.load(path)
    assert pricing.usd_per_gpu_hour == 4 and pricing.price("smol") == ModelPrice(2, 2000, 1000)  # the default's rest
    for bad in ({"usd": 1}, {"default": {"gpus": 0}}, {"models": {"x": {"speed": 1}}}, {"usd_per_gpu_hour": -1}):
        with pytest.raises((ValueError, TypeError)):
            Pricing.from_dict(bad)
    assert Pricing.load(None) == Pricing()


def test_the_usage_report_prices_each_row(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path)
    for i, (model, prompt, cached, out) in enumerate([("smol", 100, 20, 10), ("smol", 50, 0, 5), ("big", 10, 0, 1)]):
        ledger.submit(UsageRecord(f"r{i}", "acme", model, "/v1/chat/completions", prompt_tokens=prompt,
                                  cached_tokens=cached, completion_tokens=out, started_at=1000.0 + i,
                                  finished_at=1001.0 + i)).result(timeout=10)
    ledger.close()
    pricing = Pricing(usd_per_gpu_hour=36.0)
    rows = {r["model"]: r for r in report(path, pricing=pricing)}
    assert rows["smol"]["usd"] == pytest.approx(pricing.cost("smol", 100, 20, 10) + pricing.cost("smol", 50, 0, 5))
    assert "usd" in format_report(list(rows.values())).splitlines()[0]
    assert "usd" not in report(path)[0]  # no pricing: no cost column
