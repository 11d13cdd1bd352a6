"""Prometheus metrics of a replica and of the router, each in its own CollectorRegistry
(one per app: two apps in one process never share or clash).

A replica also exports, beside its own `kvshare_` series, the `vllm:` series that vLLM
dashboards read (labelled `model_name` as vLLM labels them), with vLLM's meanings."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.registry import Collector

from kvshare.serve.engine_thread import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# Connector counter -> (metric name without _total, help).
POOL_COUNTERS: dict[str, tuple[str, str]] = {
    "hit_tokens": (
        "kvshare_kv_pool_hit_tokens",
        "Prompt tokens restored from the shared pool (verified restores)",
    ),
    "miss_tokens": (
        "kvshare_kv_pool_miss_tokens",
        "Prompt tokens looked up in the pool and not found",
    ),
    "loaded_bytes": ("kvshare_kv_pool_loaded_bytes", "Bytes restored from the pool"),
    "stored_bytes": ("kvshare_kv_pool_stored_bytes", "Bytes stored into the pool"),
    "checksum_failures": (
        "kvshare_kv_pool_checksum_failures",
        "Pool pages whose checksum did not match",
    ),
    "load_failures": ("kvshare_kv_pool_load_failures", "Pool loads that fell back to recompute"),
    "pool_errors": (
        "kvshare_kv_pool_errors",
        "Pool operations that failed (daemon down or broken link)",
    ),
}


class _EngineCollector(Collector):
    """Reads the engine thread's latest snapshot at scrape time (never blocks the engine)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from self._vllm(snap)
        yield GaugeMetricFamily(
            "kvshare_requests_running", "Requests admitted to the engine", value=snap.running
        )
        yield GaugeMetricFamily(
            "kvshare_requests_waiting", "Requests queued for admission", value=snap.waiting
        )
        yield GaugeMetricFamily(
            "kvshare_gpu_cache_usage_ratio",
            "Share of KV blocks held by requests",
            value=snap.gpu_cache_usage,
        )
        yield GaugeMetricFamily(
            "kvshare_kv_pool_enabled",
            "1 when pool lookups and stores are on",
            value=float(snap.pool_enabled),
        )
        if snap.kv_pool is None:
            return  # no pool configured: no pool series at all
        for key, (name, doc) in POOL_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=snap.kv_pool.get(key, 0))

    def _vllm(self, snap: EngineSnapshot) -> Iterator[Metric]:
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches",
                snap.running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed",
                snap.waiting,
            ),
            (
                "vllm:gpu_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage",
                snap.gpu_cache_usage,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage",
                snap.gpu_cache_usage,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self._model_name], value)
            yield gauge


class VllmMetrics:
    """The request-level `vllm:` series, children bound to this replica's model name."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            labels,
            buckets=TTFT_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds",
            labels,
            buckets=E2E_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed"
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens (GPU cache and shared pool)",
        )


def add_collector_series(registry: CollectorRegistry) -> None:
    """The Python collector's work: collections and objects per generation, how many
    objects it skips because the process froze them when it had started, and how many
    allocations it lets pass between young collections (`kvshare serve` and `kvshare
    router` set both: kvshare.serve.collector)."""
    GCCollector(registry=registry)
    frozen = Gauge(
        "kvshare_gc_frozen_objects",
        "Objects alive when the process finished starting, which collections skip",
        registry=registry,
    )
    frozen.set_function(gc.get_freeze_count)
    young = Gauge(
        "kvshare_gc_young_threshold",
        "Container allocations between two young collections",
        registry=registry,
    )
    young.set_function(lambda: gc.get_threshold()[0])


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "kvshare_time_to_first_token_seconds",
            "From request received to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvshare_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "kvshare_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "kvshare_requests_finished",
            "Generations by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvshare_prompt_tokens",
            "Prompt tokens by where their KV came from",
            ["source"],
            registry=r,
        )
        self.vllm = VllmMetrics(r, model_name)
        r.register(_EngineCollector(snapshot, model_name))
        add_collector_series(r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvshare_router_requests",
            "Proxied requests by replica and status",
            ["replica", "status"],
            registry=r,
        )
        self.retries = Counter(
            "kvshare_router_retries",
            "Requests sent to another replica after one failed before replying",
            registry=r,
        )
        self.failures = Counter(
            "kvshare_router_replica_failures",
            "Connection failures and broken streams by replica",
            ["replica"],
            registry=r,
        )
        self.decisions = Counter(
            "kvshare_router_routing_decisions",
            "Replicas chosen, by policy (pinned: the x-kvshare-replica header)",
            ["policy", "replica"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvshare_router_in_flight", "Requests in flight by replica", ["replica"], registry=r
        )
        self.cache_events = Counter(
            "kvshare_router_cache_events",
            "GPU prefix-cache blocks stored or evicted, as replicas reported them",
            ["replica"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvshare_router_replica_healthy",
            "1 when the replica is in rotation",
            ["replica"],
            registry=r,
        )
        self.bodies = Counter(
            "kvshare_router_bodies",
            "Request bodies sent to replicas: as received, packed (token ids read once), or "
            "packed with the ids the router made of a text prompt or chat",
            ["body"],
            registry=r,
        )
        self.kept_prefix_hits = Gauge(
            "kvshare_router_kept_prefix_hits",
            "Long texts the router encoded from a kept prefix (the next turn of a chat)",
            registry=r,
        )
        add_collector_series(r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
