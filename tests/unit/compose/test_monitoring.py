"""Prometheus scrapes ports the services expose; Grafana is provisioned and its dashboard queries only
metrics tokenfleet exports."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from typing import Any

import yaml

from tests.unit.compose.files import (
    COMPOSE_DIR,
    GRAFANA_DIR,
    PROMETHEUS_FILE,
    WORKER_ROLES,
    _words,
    exposed_ports,
    flag,
    mounts,
    replicas,
    server_argv,
    services,
    split_address,
    tokenfleet_services,
    worker_role,
)

# ---------------------------------------------------------------------------------------------------------------------
# (c) Prometheus and Grafana


def relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str]:
    """Prometheus' `replace` relabeling (its default action; the only one prometheus.yml may use here)."""
    out = dict(labels)
    for rule in rules:
        assert rule.get("action", "replace") == "replace", f"unsupported relabel action in {rule}"
        value = rule.get("separator", ";").join(out.get(name, "") for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match:
            out[rule["target_label"]] = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
    return out


def prometheus_targets() -> dict[str, dict[str, str]]:
    """target -> its labels (job, static labels, relabeling). A DNS-discovered name stands for every address it
    resolves to: `dns:NAME:PORT`."""
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    targets: dict[str, dict[str, str]] = {}
    for job in config["scrape_configs"]:
        found = [(target, static.get("labels", {})) for static in job.get("static_configs", [])
                 for target in static["targets"]]
        for dns in job.get("dns_sd_configs", []):
            assert dns["type"] == "A", f"{dns['names']}: Docker's DNS answers a service name with A records"
            found += [(f"dns:{name}:{dns['port']}", {"__meta_dns_name": name}) for name in dns["names"]]
        for target, labels in found:
            assert target not in targets, f"{target} scraped twice"
            kept = relabel({"job": job["job_name"], **labels}, job.get("relabel_configs", []))
            targets[target] = {k: v for k, v in kept.items() if not k.startswith("__")}
    return targets


def test_relabel() -> None:
    rules = [{"source_labels": ["__meta_dns_name"], "regex": "decode", "target_label": "role", "replacement": "decode"},
             {"source_labels": ["job", "role"], "regex": "(.*);(.*)", "target_label": "both", "replacement": "$2-$1"}]
    assert relabel({"job": "w", "__meta_dns_name": "decode"}, rules)["both"] == "decode-w"
    assert "role" not in relabel({"job": "w", "__meta_dns_name": "decoder"}, rules)


def test_prometheus_config_is_mounted() -> None:
    prometheus = services()["prometheus"]
    mounted = {target: source for source, target in mounts(prometheus)}
    config_flag = flag(_words(prometheus["command"]), "--config.file")
    assert (COMPOSE_DIR / mounted[config_flag]).resolve() == PROMETHEUS_FILE


def test_prometheus_scrapes_ports_services_expose() -> None:
    """Static targets name one-container services; a scaled service is found through DNS (a static target would
    reach one replica of it, a different one each time)."""
    targets = prometheus_targets()
    for target in targets:
        host, port = split_address(target.removeprefix("dns:"))
        assert host in services(), f"scrape target {target}: no service {host}"
        assert port in exposed_ports(services()[host]), f"scrape target {target}: {host} does not expose {port}"
        if not target.startswith("dns:"):
            assert replicas(services()[host]) == 1, f"scrape target {target}: {host} has replicas; discover them by DNS"
    gateway = server_argv("gateway")
    assert gateway is not None
    assert f"gateway:{flag(gateway, '--metrics-port')}" in targets, "the gateway's metrics port is not scraped"
    for name in tokenfleet_services():
        argv = server_argv(name)
        if argv is None or argv[1] not in WORKER_ROLES:
            continue
        metrics_port = flag(argv, "--metrics-port")
        assert metrics_port is not None, f"{name} serves no metrics"
        role = worker_role(argv)
        target = f"dns:{name}:{metrics_port}" if replicas(services()[name]) > 1 else f"{name}:{metrics_port}"
        assert targets.get(target, {}).get("role") == role, f"{name}'s metrics are not scraped as {role} ({target})"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    grafana = services()["grafana"]
    mounted = {target: (COMPOSE_DIR / source).resolve() for source, target in mounts(grafana) if source.startswith(".")}
    assert mounted.get("/etc/grafana/provisioning") == GRAFANA_DIR / "provisioning"
    datasource_files = sorted((GRAFANA_DIR / "provisioning" / "datasources").glob("*.yml"))
    datasources = [d for path in datasource_files for d in yaml.safe_load(path.read_text())["datasources"]]
    assert [d["type"] for d in datasources] == ["prometheus"]
    host, port = split_address(datasources[0]["url"].removeprefix("http://"))
    assert host in services() and port in exposed_ports(services()[host])
    provider_files = sorted((GRAFANA_DIR / "provisioning" / "dashboards").glob("*.yml"))
    providers = [p for path in provider_files for p in yaml.safe_load(path.read_text())["providers"]]
    assert providers and all(mounted.get(p["options"]["path"]) == GRAFANA_DIR / "dashboards" for p in providers)
    for dashboard in dashboards():
        for panel in panels(dashboard):
            if panel.get("datasource"):
                assert panel["datasource"]["uid"] == datasources[0]["uid"], panel["title"]


class _AnyReport:
    """A worker load report whose every field reads 1 (one kernel check, its fields 1 too; one tenant retaining 1 byte)."""

    def __getattr__(self, name: str) -> object:
        if name == "retained_bytes_per_tenant":
            return {"acme": 1}
        return [_AnyReport()] if name == "kernel_checks" else 1


@functools.cache
def exported_metrics() -> tuple[frozenset[str], frozenset[str]]:
    """(sample names, label names) that tokenfleet/telemetry/metrics.py exports, read from real registries."""
    from prometheus_client import CollectorRegistry

    from tokenfleet.telemetry.metrics import BatchMetrics, GatewayMetrics, RequestTimer, RouterMetrics, WorkerCollector
    from tokenfleet.tenancy.pricing import Pricing

    gateway = GatewayMetrics(pricing=Pricing())
    gateway.charge("acme", "smol", 10, 4, 5)
    timer = RequestTimer(gateway)
    timer.on_chunk(1)
    timer.on_chunk(1)
    timer.finish(prompt=3, cached=1, completion=2)
    gateway.requests.labels("/v1/chat/completions", "200").inc()
    batch = BatchMetrics(gateway.registry)
    batch.lines.labels("ok").inc()
    batch.retries.labels("no_spare_capacity").inc()
    router = RouterMetrics(lambda: [("smol", "w0", "serving", 1)])
    router.picks.labels("smol", "ok").inc()
    worker = CollectorRegistry()
    worker.register(WorkerCollector(_AnyReport))
    names: set[str] = set()
    labels: set[str] = set()
    for registry in (gateway.registry, worker, router.registry):
        for family in registry.collect():
            for sample in family.samples:
                names.add(sample.name)
                labels.update(sample.labels)
    return frozenset(names), frozenset(labels)


_GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless"}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression refers to."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels: set[str] = set()
    for selector in re.findall(r"\{([^}]*)\}", text):
        labels.update(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", selector))
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)  # label matchers, range selectors
    for grouping in re.findall(_GROUPING, text):
        labels.update(label.strip() for label in grouping.split(",") if label.strip())
    text = re.sub(_GROUPING, " ", text)
    metrics = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        is_function = text[match.end():].lstrip().startswith("(")
        if not is_function and match[0] not in _KEYWORDS:
            metrics.add(match[0])
    return metrics, labels


def test_promql_names() -> None:
    assert promql_names('histogram_quantile(0.9, sum by (le) (rate(a_bucket{x="b}"}[$__rate_interval])))') == (
        {"a_bucket"}, {"le", "x"})
    assert promql_names("sum(rate(a_total[5m])) by (status) / ignoring(z) b_total > bool 0") == (
        {"a_total", "b_total"}, {"status", "z"})


def dashboards() -> list[dict[str, Any]]:
    files = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))
    assert files, "no dashboard JSON"
    return [json.loads(path.read_text()) for path in files]


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_dashboard_queries_exported_metrics() -> None:
    metric_names, metric_labels = exported_metrics()
    scrape_labels = {label for labels in prometheus_targets().values() for label in labels}
    known_labels = metric_labels | scrape_labels | {"instance", "job"}
    queried: set[str] = set()
    quantiles: set[str] = set()
    for dashboard in dashboards():
        assert dashboard["uid"] and dashboard["title"]
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                where = f"{panel['title']!r} {target['refId']}"
                metrics, labels = promql_names(target["expr"])
                assert metrics, f"{where}: queries no metric"
                assert metrics <= metric_names, f"{where}: tokenfleet exports no {sorted(metrics - metric_names)}"
                assert labels <= known_labels, f"{where}: no label {sorted(labels - known_labels)}"
                legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
                assert legend_labels <= known_labels, f"{where}: legend uses {sorted(legend_labels - known_labels)}"
                queried |= metrics
                if "histogram_quantile(" in target["expr"]:
                    quantiles |= metrics
    for name in ("ttft", "tpot", "itl"):
        assert f"tokenfleet_gateway_{name}_seconds_bucket" in quantiles, f"no {name.upper()} quantiles"
    wanted = {"tokenfleet_gateway_prompt_tokens_total", "tokenfleet_gateway_completion_tokens_total",
              "tokenfleet_gateway_requests_total", "tokenfleet_worker_waiting", "tokenfleet_worker_running",
              "tokenfleet_worker_kv_usage", "tokenfleet_gateway_tenant_cost_usd_total",
              "tokenfleet_gateway_tenant_tokens_total", "tokenfleet_worker_busy_seconds_total",
              "tokenfleet_worker_model_flops_total", "tokenfleet_worker_peak_flops", "tokenfleet_worker_model_bytes_total",
              "tokenfleet_worker_peak_bytes_per_second"}
    assert wanted <= queried, f"the dashboard does not show {sorted(wanted - queried)}"



# ---------------------------------------------------------------------------------------------------------------------
# (d) Traces: every tokenfleet service -> the OTLP collector -> Jaeger


def test_every_service_exports_traces_to_the_collector_which_feeds_jaeger() -> None:
    collector = services()["otel-collector"]
    for name in tokenfleet_services():
        env = services()[name].get("environment", {})
        assert env.get("TOKENFLEET_TRACING", "").startswith("${TOKENFLEET_TRACING:-"), name  # off unless asked
        host, port = split_address(env["OTEL_EXPORTER_OTLP_ENDPOINT"].removeprefix("http://"))
        assert host == "otel-collector" and port in exposed_ports(collector), name
    mounted = {target: source for source, target in mounts(collector)}
    config_path = flag(_words(collector["command"]), "--config")
    config = yaml.safe_load((COMPOSE_DIR / mounted[config_path]).read_text())
    http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert split_address(http)[1] == 4318
    (exporter,) = config["service"]["pipelines"]["traces"]["exporters"]
    host, port = split_address(config["exporters"][exporter]["endpoint"])
    assert host == "jaeger" and port in exposed_ports(services()["jaeger"])
    assert services()["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert 16686 in exposed_ports(services()["jaeger"])  # the UI
