"""Prometheus metrics of the server: what an operator watches on a dashboard.

Latencies are histograms (a scraper computes any percentile over any window from the
buckets), counts are counters, and the engine's state (running and waiting requests, KV
blocks in use, prefix-cache hit rate) is read at scrape time. Names follow Prometheus
conventions: base units (seconds), ``_total`` for counters, a ``tinyserve_`` prefix.
Each app gets its own registry, so two servers in one process (tests) never mix figures.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..metrics import RequestTrace

# Buckets from 1 ms to a minute: CPU decode steps sit at a few ms, queueing at seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tinyserve_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("tinyserve_prompt_tokens", "prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("tinyserve_generation_tokens", "tokens generated",
                                         registry=r)
        self.ttft = Histogram("tinyserve_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tinyserve_inter_token_latency_seconds", "gap between two tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("tinyserve_queue_time_seconds", "arrival to admission",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tinyserve_e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        gauges = {
            "running": ("tinyserve_num_requests_running", "requests in the running batch"),
            "waiting": ("tinyserve_num_requests_waiting", "requests queued for admission"),
            "kv_blocks_used": ("tinyserve_kv_blocks_used", "KV blocks held by requests"),
            "kv_blocks_total": ("tinyserve_kv_blocks_total", "KV blocks in the pool"),
            "prefix_cache_hit_rate": ("tinyserve_prefix_cache_hit_rate",
                                      "prompt tokens served from the prefix cache / looked up"),
        }
        for key, (name, doc) in gauges.items():
            g = Gauge(name, doc, registry=r)
            g.set_function(lambda key=key: float(stats()[key]))

    def observe(self, trace: RequestTrace | None) -> None:
        """Record a finished (or cancelled) request's timeline."""
        if trace is None:
            return
        self.prompt_tokens.inc(trace.prompt_tokens)
        self.generation_tokens.inc(len(trace.token_times))
        if trace.admitted is not None:
            self.queue.observe(trace.admitted - trace.arrival)
        if trace.token_times:
            self.ttft.observe(trace.token_times[0] - trace.arrival)
            for a, b in zip(trace.token_times, trace.token_times[1:]):
                self.itl.observe(b - a)
            if trace.finish is not None:
                self.e2e.observe(trace.finish - trace.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
