"""The Grafana dashboard's queries against a real Prometheus scraping a running `tokenfleet up`.

Grafana cannot run here; Prometheus can (Debian's `prometheus`, which `scripts/install.sh --dev` installs as root).
The cluster serves a few chat requests; Prometheus scrapes every service through the configuration
`tokenfleet scrape-config` prints (the jobs and role labels of compose/prometheus/prometheus.yml); then every
panel's query, with Grafana's variables filled in as "All" would, must return at least one series."""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import start_up, wait_for

DASHBOARDS = Path(__file__).resolve().parents[2] / "compose" / "grafana" / "dashboards"
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$tenant": ".*", "$model": ".*", "$instance": ".*"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def panel_queries() -> list[tuple[str, str]]:
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for p in [panel, *panel.get("panels", [])]:
                for target in p.get("targets", []):
                    expr = target["expr"]
                    for variable, value in GRAFANA_VARIABLES.items():
                        expr = expr.replace(variable, value)
                    out.append((f"{p['title']} ({target['refId']})", expr))
    return out


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed "
                    "(scripts/install.sh --dev installs it when run as root)")
def test_every_dashboard_panel_returns_series_from_a_real_prometheus(default_model_dir, tmp_path):
    prometheus = None
    up = start_up(tmp_path, "--workers", "1", "--threads", "1", "--model", str(default_model_dir), "--model-name",
                  "smol")
    try:
        gateway = up.announced["gateway:"]
        config = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "scrape-config", "--interval", "1s"],
                                capture_output=True, text=True, env=up.env, check=True).stdout
        assert "job_name: worker" in config and "role: both" in config and "job_name: gateway" in config
        (tmp_path / "prometheus.yml").write_text(config)
        port = _free_port()
        prometheus = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                       f"--web.listen-address=127.0.0.1:{port}"],
                                      stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ready(url), "Prometheus ready", 60)
        try:  # scraped before the traffic: every counter's rate then sees it rise
            wait_for(lambda: len(query(url, 'up{job=~"gateway|worker|router|registry"} == 1')) == 4, "scrapes", 60)
        except AssertionError:
            targets = urllib.request.urlopen(f"{url}/api/v1/targets", timeout=10).read().decode()
            raise AssertionError(f"{targets[:3000]}\n{config}") from None
        client = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=120)
        for i in range(6):  # traffic for the rates, the histograms and the tenant's cost
            reply = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": f"Count to {i}"}],
                                                   max_tokens=8, stream=i % 2 == 0)
            if i % 2 == 0:
                assert sum(1 for _ in reply) > 0
        lines = "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": f"Say {i}"}]}}) + "\n"
            for i in range(2)).encode()
        batch = client.batches.create(input_file_id=client.files.create(file=("b.jsonl", io.BytesIO(lines)),
                                                                        purpose="batch").id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", "the batch panels' traffic", 120)
        wait_for(lambda: query(url, "sum(tokenfleet_gateway_completion_tokens_total) > 0"), "scraped traffic", 60)
        wait_for(lambda: query(url, "sum(tokenfleet_batch_lines_total) > 1"), "scraped batch lines", 60)
        time.sleep(3)  # a few more scrapes: every rate() has two points after the traffic
        empty = [name for name, expr in panel_queries() if not query(url, expr)]
        assert not empty, f"panels with no series: {empty}"
        assert len(panel_queries()) >= 30
        cost = query(url, "sum(tokenfleet_gateway_tenant_cost_usd_total)")
        assert float(cost[0]["value"][1]) > 0
        mfu = query(url, "max(rate(tokenfleet_worker_model_flops_total[30s]) / on (instance) "
                         "tokenfleet_worker_peak_flops)")
        assert 0 < float(mfu[0]["value"][1]) < 1  # a share of the measured peak: physics, not a constant
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        up.stop()


def _ready(url: str) -> bool:
    try:
        return urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200
    except OSError:
        return False
