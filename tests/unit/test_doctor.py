"""`tokenfleet doctor`: the machine, each kernel's known-answer check, models, certificates, ports; exit 1 when a
kernel fails its check."""

from __future__ import annotations

import socket

import pytest
import structlog

from tokenfleet import cli
from tokenfleet.models import loader


@pytest.fixture(autouse=True)
def logging_restored():
    """cli.main points structlog at this test's captured stderr, which closes with the test: put it back after."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_doctor_reports_every_section_and_each_kernel_check(capsys, tmp_path, monkeypatch, default_model_dir):
    from tokenfleet.security import certs

    certs.ensure(tmp_path / "certs")
    monkeypatch.setenv("TOKENFLEET_CERTS", str(tmp_path / "certs"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = cli.main(["doctor", "--model", str(default_model_dir), "--no-checksums", "--port", str(port)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for section in ("machine:", "torch:", "dtype:", "kernels (bfloat16", "models:", "certificates:", "ports:"):
        assert section in out, section
    assert "paged_attention: native paged attention" in out and "layer_ops: native layer ops" in out
    assert "FAILED" not in out
    assert "gateway.pem: expires" in out and f"127.0.0.1:{port} (the gateway's): in use" in out


def test_doctor_exits_1_and_names_a_kernel_that_fails_its_check(capsys, monkeypatch, default_model_dir):
    from tests.unit.models.test_kernel_check import OneScoreOff

    monkeypatch.setattr(loader, "select_attention", lambda *a, **k: OneScoreOff())
    rc = cli.main(["doctor", "--model", str(default_model_dir), "--no-checksums", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "paged_attention: planted kernel (one score off): FAILED: context [100, 33]" in out
    assert "serving: torch reference" in out
