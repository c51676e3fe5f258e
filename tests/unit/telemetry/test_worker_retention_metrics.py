"""A worker's retention figures reach /metrics from its load report: retained bytes per tenant (the tenant label
only), the retained-block gauge and the retention counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tokenfleet.telemetry.metrics import WorkerCollector
from tokenfleet.v1 import engine_pb2


def test_retention_gauges_and_counters_are_exported_per_tenant():
    report = engine_pb2.LoadReport(num_retained_blocks=12, retained_bytes_per_tenant={"acme": 4096, "beta": 1024},
                                   num_retained_demoted_blocks=3, num_prefetched_blocks=5, num_prefetch_hit_blocks=4,
                                   num_retention_releases=2, num_retention_expiries=1)
    registry = CollectorRegistry()
    registry.register(WorkerCollector(lambda: report))
    value = registry.get_sample_value
    assert value("tokenfleet_worker_retained_bytes", {"tenant": "acme"}) == 4096
    assert value("tokenfleet_worker_retained_bytes", {"tenant": "beta"}) == 1024
    assert value("tokenfleet_worker_retained_blocks") == 12
    assert value("tokenfleet_worker_retained_demoted_blocks_total") == 3
    assert value("tokenfleet_worker_prefetched_blocks_total") == 5
    assert value("tokenfleet_worker_prefetch_hit_blocks_total") == 4
    assert value("tokenfleet_worker_retention_releases_total") == 2
    assert value("tokenfleet_worker_retention_expiries_total") == 1
    labels = {tuple(s.labels) for f in registry.collect() if f.name == "tokenfleet_worker_retained_bytes"
              for s in f.samples}
    assert labels == {("tenant",)}
