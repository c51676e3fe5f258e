"""Prometheus metrics. Each service owns a CollectorRegistry (no process-global state)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    """``pricing`` (tenancy.pricing.Pricing): what each settled request's tokens cost, charged per tenant and model."""

    def __init__(self, registry: CollectorRegistry | None = None, pricing: Any = None):
        self.registry = registry or CollectorRegistry()
        self.pricing = pricing
        r = self.registry
        self.ttft = Histogram("tokenfleet_gateway_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tokenfleet_gateway_tpot_seconds", "Mean time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tokenfleet_gateway_itl_seconds", "Gap between streamed chunks", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("tokenfleet_gateway_e2e_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tokenfleet_gateway_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("tokenfleet_gateway_cached_prompt_tokens", "Prompt tokens from the prefix cache",
                                     registry=r)
        self.completion_tokens = Counter("tokenfleet_gateway_completion_tokens", "Generated tokens", registry=r)
        self.requests = Counter("tokenfleet_gateway_requests", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.resumes = Counter("tokenfleet_gateway_resumes", "Streams continued on another replica after theirs was "
                               "lost (ok), or given up after --max-resumes (exhausted)", ["result"], registry=r)
        self.stalls = Counter("tokenfleet_gateway_stalls", "Streams given up on a worker that sent nothing, not even "
                              "a heartbeat, for --stall-timeout (then placed again or resumed elsewhere)", registry=r)
        # The model router (routing aliases such as "auto"): which model each request went to.
        self.routed = Counter("tokenfleet_gateway_routed", "Requests a routing alias sent to one of its models",
                              ["alias", "model"], registry=r)
        # Per model version (name@version: what a canary rollout compares): outcomes and latencies.
        self.version_requests = Counter("tokenfleet_gateway_version_requests", "Settled requests by model version and "
                                        "outcome (ok, failed, rejected, cancelled)", ["ref", "status"], registry=r)
        self.version_ttft = Histogram("tokenfleet_gateway_version_ttft_seconds", "Time to first token by model version",
                                      ["ref"], buckets=LATENCY_BUCKETS, registry=r)
        self.version_tpot = Histogram("tokenfleet_gateway_version_tpot_seconds", "Mean time per output token by model "
                                      "version", ["ref"], buckets=LATENCY_BUCKETS, registry=r)

        # Cost and usage per tenant and model (tokenfleet.tenancy.pricing: GPU time at a price per GPU-hour)
        self.tenant_tokens = Counter("tokenfleet_gateway_tenant_tokens", "Tokens by tenant, model and kind (input: "
                                     "prompt tokens, cached: of those from the prefix cache, output)",
                                     ["tenant", "model", "kind"], registry=r)
        self.tenant_cost = Counter("tokenfleet_gateway_tenant_cost_usd", "What the tenant's tokens cost: GPU time at "
                                   "the model's configured throughput and the price per GPU-hour", ["tenant", "model"],
                                   registry=r)
        self.tenant_gpu_seconds = Counter("tokenfleet_gateway_tenant_gpu_seconds", "GPU time the tenant's tokens "
                                          "take at the model's configured throughput", ["tenant", "model"], registry=r)

    def charge(self, tenant: str, model: str, prompt: int, cached: int, output: int) -> None:
        """One settled request's tokens, and (with pricing) their GPU time and cost."""
        self.tenant_tokens.labels(tenant, model, "input").inc(prompt)
        self.tenant_tokens.labels(tenant, model, "cached").inc(cached)
        self.tenant_tokens.labels(tenant, model, "output").inc(output)
        if self.pricing is not None:
            self.tenant_gpu_seconds.labels(tenant, model).inc(self.pricing.gpu_seconds(model, prompt, cached, output))
            self.tenant_cost.labels(tenant, model).inc(self.pricing.cost(model, prompt, cached, output))

    def settled(self, ref: str, status: str, ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        """One request to model version ``ref`` ended with ``status``."""
        self.version_requests.labels(ref, status).inc()
        if ttft_s is not None:
            self.version_ttft.labels(ref).observe(ttft_s)
        if tpot_s is not None:
            self.version_tpot.labels(ref).observe(tpot_s)


class RequestTimer:
    """Latency bookkeeping for one request; call ``on_chunk`` per streamed chunk with tokens."""

    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0

    def on_chunk(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        elif self.last is not None:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_tokens += num_tokens

    def finish(self, prompt: int = 0, cached: int = 0, completion: int = 0) -> None:
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.start)
        m.prompt_tokens.inc(prompt)
        m.cached_tokens.inc(cached)
        m.completion_tokens.inc(completion)
        if self.tpot_s is not None:
            m.tpot.observe(self.tpot_s)

    @property
    def ttft_s(self) -> float | None:
        return self.first - self.start if self.first is not None else None

    @property
    def tpot_s(self) -> float | None:
        if self.first is not None and self.last is not None and self.num_tokens > 1:
            return (self.last - self.first) / (self.num_tokens - 1)
        return None


class WorkerCollector(Collector):
    """Reads the worker's load report at scrape time: no second copy of the numbers to keep in sync."""

    def __init__(self, report: Callable[[], object]):
        self.report = report

    def collect(self) -> Iterator[Metric]:
        r = self.report()
        gauges = {"running": "num_running", "waiting": "num_waiting", "kv_blocks_used": "num_blocks_used",
                  "kv_blocks_free": "num_blocks_free", "in_flight": "num_in_flight"}
        for name, field in gauges.items():
            yield GaugeMetricFamily(f"tokenfleet_worker_{name}", f"Worker {name.replace('_', ' ')}",
                                    value=getattr(r, field))
        used, free = r.num_blocks_used, r.num_blocks_free  # type: ignore[attr-defined]
        yield GaugeMetricFamily("tokenfleet_worker_kv_usage", "Fraction of KV blocks in use",
                                value=used / (used + free) if used + free else 0.0)
        for name, field, what in (("busy_seconds", "busy_seconds", "Seconds the engine loop spent in steps (its busy "
                                   "share is the rate)"),
                                  ("model_flops", "model_flops", "Model FLOPs of the steps (estimated from their shapes)"),
                                  ("model_bytes", "model_bytes", "Bytes the steps read: weights and KV (estimated)")):
            yield CounterMetricFamily(f"tokenfleet_worker_{name}", what, value=getattr(r, field))
        for name, field, what in (("peak_flops", "peak_flops", "The device's peak FLOP/s at the model's dtype (datasheet "
                                   "or measured at start): MFU = rate(model_flops) / this"),
                                  ("peak_bytes_per_second", "peak_bytes_per_s", "The device's peak memory bytes/s: "
                                   "MBU = rate(model_bytes) / this")):
            if getattr(r, field):
                yield GaugeMetricFamily(f"tokenfleet_worker_{name}", what, value=getattr(r, field))
        counters = {"prefix_hit_tokens": "num_prefix_hit_tokens", "preemptions": "num_preemptions",
                    "aborted_requests": "num_aborted", "steps": "num_steps",
                    "prompt_tokens_computed": "num_prompt_tokens_computed", "remote_prefills": "num_remote_prefills",
                    "kv_blocks_sent": "num_kv_blocks_sent", "kv_blocks_received": "num_kv_blocks_received",
                    "kv_bytes_received": "num_kv_bytes_received", "tier_hit_blocks": "num_tier_hit_blocks",
                    "tier_stored_blocks": "num_tier_stored_blocks", "tier_dropped_blocks": "num_tier_dropped_blocks",
                    "tier_corrupt_blocks": "num_tier_corrupt_blocks", "tier_bytes_written": "tier_bytes_written",
                    "tier_bytes_read": "tier_bytes_read", "tier_restore_seconds": "tier_restore_seconds",
                    "peer_blocks_received": "num_peer_blocks_received", "peer_blocks_served": "num_peer_blocks_served",
                    "peer_fetch_failures": "num_peer_fetch_failures",
                    "spec_proposed_tokens": "num_spec_proposed_tokens", "spec_accepted_tokens": "num_spec_accepted_tokens",
                    "spec_verifications": "num_spec_verifications", "spec_steps": "num_spec_steps",
                    "spec_step_seconds": "spec_step_seconds", "plain_decode_steps": "num_plain_decode_steps",
                    "plain_decode_step_seconds": "plain_decode_step_seconds",
                    "retention_releases": "num_retention_releases", "retention_expiries": "num_retention_expiries",
                    "retained_evicted_blocks": "num_retained_evicted_blocks",
                    "retained_demoted_blocks": "num_retained_demoted_blocks",
                    "prefetched_blocks": "num_prefetched_blocks", "prefetch_hit_blocks": "num_prefetch_hit_blocks"}
        for name, field in counters.items():
            yield CounterMetricFamily(f"tokenfleet_worker_{name}", f"Worker {name.replace('_', ' ')}",
                                      value=getattr(r, field))
        yield GaugeMetricFamily("tokenfleet_worker_tier_bytes_used", "Bytes held by the second KV tier",
                                value=r.tier_bytes_used)  # type: ignore[attr-defined]
        yield GaugeMetricFamily("tokenfleet_worker_retained_blocks", "Distinct KV blocks conversations retain "
                                "(pool or second tier)", value=r.num_retained_blocks)  # type: ignore[attr-defined]
        retained = GaugeMetricFamily("tokenfleet_worker_retained_bytes", "Bytes of the KV blocks a tenant's "
                                     "conversations retain above plain LRU", labels=["tenant"])
        for tenant, num_bytes in sorted(r.retained_bytes_per_tenant.items()):  # type: ignore[attr-defined]
            retained.add_metric([tenant], num_bytes)  # the tenant label only: bounded by the tenants retaining
        yield retained
        yield GaugeMetricFamily("tokenfleet_worker_step_seconds_mean", "Mean engine step time",
                                value=r.step_ms_mean / 1000)  # type: ignore[attr-defined]
        proposed, accepted, verifications = (r.num_spec_proposed_tokens, r.num_spec_accepted_tokens,  # type: ignore[attr-defined]
                                             r.num_spec_verifications)  # type: ignore[attr-defined]
        yield GaugeMetricFamily("tokenfleet_worker_spec_acceptance_rate", "Share of proposed tokens accepted",
                                value=accepted / proposed if proposed else 0.0)
        yield GaugeMetricFamily("tokenfleet_worker_spec_mean_accepted_length",
                                "Tokens a verification yields on average (accepted + the target's own)",
                                value=1 + accepted / verifications if verifications else 0.0)
        yield from _kernel_checks(r.kernel_checks)  # type: ignore[attr-defined]


def _kernel_checks(checks: Iterable[Any]) -> Iterator[Metric]:
    """1 per kernel that passed its known-answer check at load, 0 per kernel that failed it (the torch reference
    serves in its place: ``serving``), and what each check cost."""
    passed = GaugeMetricFamily("tokenfleet_worker_kernel_check",
                               "Kernel agreed with the torch reference at load (1) or failed and was replaced (0)",
                               labels=["kernel", "implementation", "serving"])
    seconds = GaugeMetricFamily("tokenfleet_worker_kernel_check_seconds", "What a kernel's check cost at load",
                                labels=["kernel", "implementation"])
    for c in checks:
        passed.add_metric([c.kernel, c.implementation, c.serving], 1.0 if c.passed else 0.0)
        seconds.add_metric([c.kernel, c.implementation], c.seconds)
    yield passed
    yield seconds


class BatchMetrics:
    """The batch tier's executor on a gateway (services/gateway/batch_runner.py)."""

    def __init__(self, registry: CollectorRegistry):
        self.lines = Counter("tokenfleet_batch_lines", "Batch lines finished on this gateway, by result", ["result"],
                             registry=registry)
        self.running = Gauge("tokenfleet_batch_lines_running", "Batch lines running on this gateway", registry=registry)
        self.owned = Gauge("tokenfleet_batch_batches_owned", "Batches this gateway runs", registry=registry)
        self.retries = Counter("tokenfleet_batch_retries", "Batch lines put back to try later, by reason", ["reason"],
                               registry=registry)


class RouterMetrics:
    """Placement decisions (counted at Pick) and the fleet as the router sees it (read at scrape time)."""

    def __init__(self, fleet_rows: Callable[[], list[tuple[str, str, str, int]]], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.picks = Counter("tokenfleet_router_picks", "Pick answers by model and result", ["model", "result"],
                             registry=self.registry)
        # outcome: followed (kept on the replica of its last turn), left_overloaded, left_unavailable (draining,
        # excluded or gone), new (no home known), ignored (a baseline policy)
        self.conversations = Counter("tokenfleet_router_conversation_picks", "Picks of requests continuing a "
                                     "conversation, by model and what placement did with its home",
                                     ["model", "outcome"], registry=self.registry)
        self.registry.register(_FleetCollector(fleet_rows))


class _FleetCollector(Collector):
    def __init__(self, rows: Callable[[], list[tuple[str, str, str, int]]]):
        self.rows = rows  # (model, replica, state, effective load)

    def collect(self) -> Iterator[Metric]:
        replicas = GaugeMetricFamily("tokenfleet_router_replicas", "Replicas by model and state", labels=["model", "state"])
        load = GaugeMetricFamily("tokenfleet_router_replica_load", "Queued + running + pending requests per replica",
                                 labels=["model", "replica"])
        counts: dict[tuple[str, str], int] = {}
        for model, replica, state, effective in self.rows():
            counts[(model, state)] = counts.get((model, state), 0) + 1
            load.add_metric([model, replica], effective)
        for (model, state), n in sorted(counts.items()):
            replicas.add_metric([model, state], n)
        yield replicas
        yield load


class RegistryCollector(Collector):
    """Registered versions by model and status, and aliases (read from the registry's view at scrape time)."""

    def __init__(self, rows: Callable[[], tuple[list[tuple[str, str]], int]]):
        self.rows = rows  # ([(model, status) per version], number of aliases)

    def collect(self) -> Iterator[Metric]:
        versions, aliases = self.rows()
        family = GaugeMetricFamily("tokenfleet_registry_versions", "Registered model versions", labels=["model", "status"])
        counts: dict[tuple[str, str], int] = {}
        for key in versions:
            counts[key] = counts.get(key, 0) + 1
        for (model, status), n in sorted(counts.items()):
            family.add_metric([model, status], n)
        yield family
        yield GaugeMetricFamily("tokenfleet_registry_aliases", "Registered aliases", value=aliases)
