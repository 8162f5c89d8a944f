"""Prometheus metrics of the HTTP service, on the workers' conventions (tasks.metrics): no label names a
SKU or a key, every label value is from a small fixed set, and each series exists at 0 from the start so
``rate()`` sees the first event. Served at ``GET /metrics`` from the app's own registry (one per app, so
an app built twice in a process counts apart); under ``uvicorn --workers N`` with
``PROMETHEUS_MULTIPROC_DIR`` set, the processes' values are summed, as the workers' are."""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

# A request answered from the outcome table takes milliseconds; one that waits for a worker, up to its wait.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class HttpMetrics:
    def __init__(self, routes: Iterable[tuple[str, str, Iterable[int]]]) -> None:
        multiproc = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # In multiprocess mode the values go to files and are collected from there on a scrape.
        self.registry = CollectorRegistry(auto_describe=True)
        own = None if multiproc else self.registry
        self.requests = Counter(
            "reservations_http_requests",
            "HTTP requests answered, by route template, method and status code",
            ["route", "method", "code"],
            registry=own,
        )
        self.latency = Histogram(
            "reservations_http_request_seconds",
            "time from a request's arrival to its answer, by route template and method",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self.in_flight = Gauge(
            "reservations_http_in_flight",
            "HTTP requests being answered",
            registry=own,
            multiprocess_mode="livesum",
        )
        self.backlog = Gauge(
            "reservations_http_queue_depth",
            "requests waiting in the broker's queue, as the service last sampled it",
            registry=own,
            multiprocess_mode="max",
        )
        self.refused = Counter(
            "reservations_http_overloaded",
            "requests refused with 503 because the queue was deeper than its bound",
            registry=own,
        )
        if multiproc:
            MultiProcessCollector(self.registry)  # type: ignore[no-untyped-call]
        for route, method, codes in routes:
            self.latency.labels(route, method)
            for code in codes:
                self.requests.labels(route, method, str(code))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
