"""``reservations metrics``: a Prometheus exporter of what lives in the database, read at each scrape: stale
writes refused per SKU (the stock rows' history), request outcomes by status, requests queued for their
SKU's lease holder. Per-SKU labels belong here, not on the workers: they are bounded by the catalogue.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Annotated, Any

import sqlalchemy as sa
import typer
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from admin.cli import context
from admin.cli.failures import EXIT_FAILED, EXIT_UNREACHABLE, fail
from fencing.urls import mask_url
from reservations.inventory import Inventory
from reservations.models import request_outcomes
from reservations.statuses import RequestStatus
from tasks.settings import Settings

DEFAULT_PORT = 9809
# The workers' default (RESERVATIONS_METRICS_HOST): nothing is exposed beyond this host unless asked.
DEFAULT_HOST = Settings.metrics_host


def outcome_counts(inventory: Inventory) -> dict[str, int]:
    """Request outcomes still kept (see their retention), by status."""
    query = sa.select(request_outcomes.c.status, sa.func.count()).group_by(request_outcomes.c.status)
    with inventory.executor.engine.connect() as conn:
        return {str(status): int(count) for status, count in conn.execute(query)}


class DatabaseCollector(Collector):
    """Reads the database at every scrape; a database that does not answer makes ``up`` 0, not an error."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("reservations_db_up", "1 if this scrape could read the inventory database")
        try:
            rejected = self.inventory.rejection_counts()
            outcomes = outcome_counts(self.inventory)
            waiting = self.inventory.waiting_by_sku()
        except Exception:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        refused = CounterMetricFamily(
            "reservations_db_stale_writes_refused",
            "stale writes the SKU's stock row refused, from its history",
            labels=["sku"],
        )
        for sku, count in rejected.items():
            refused.add_metric([sku], count)
        yield refused
        by_status = GaugeMetricFamily(
            "reservations_db_outcomes", "request outcomes kept in the database, by status", labels=["status"]
        )
        # Every status, 0 where none is kept: a series that appears only with its first outcome hides that
        # outcome from increase() and delta(). SKUs are not filled in: their number is the catalogue's.
        for status in sorted({*RequestStatus, *outcomes}):
            by_status.add_metric([status], outcomes.get(status, 0))
        yield by_status
        queued = GaugeMetricFamily(
            "reservations_db_waiting_requests",
            "reservations queued for their SKU's lease holder, by SKU",
            labels=["sku"],
        )
        for sku, count in sorted(waiting.items()):
            queued.add_metric([sku], count)
        yield queued
        total = GaugeMetricFamily(
            "reservations_db_waiting_requests_all", "reservations queued for a lease holder, all SKUs"
        )
        total.add_metric([], sum(waiting.values()))
        yield total


def metrics_command(
    port: Annotated[int, typer.Option(help="Serve /metrics on this port.", min=1, max=65535)] = DEFAULT_PORT,
    host: Annotated[
        str,
        typer.Option(
            help="The address to listen on: this host only by default; 0.0.0.0 (every interface) where "
            "Prometheus runs on another host or container."
        ),
    ] = DEFAULT_HOST,
    once: Annotated[bool, typer.Option("--once", help="Print the metrics once and exit.")] = False,
) -> None:
    """Export what the database holds as Prometheus metrics: refused stale writes per SKU, outcomes by
    status, queued requests. The workers' own metrics are served by each worker
    (RESERVATIONS_METRICS_PORT). Exit 1 when it cannot listen there (the port is taken), 4 when the
    database does not answer (--once)."""
    inventory = context.inventory()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(inventory))
    try:
        if once:
            exposition = generate_latest(registry).decode()
            if "reservations_db_up 1.0" not in exposition:
                fail(EXIT_UNREACHABLE, f"cannot read the database {mask_url(context.config.database_url)}")
            typer.echo(exposition, nl=False)
            return
        try:
            server, _thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:  # the port is taken, or the address is not this host's
            fail(EXIT_FAILED, f"cannot serve metrics on {host} port {port}: {exc.strerror or exc}")
        typer.echo(f"serving database metrics on {host} port {port}", err=True)
        try:
            signal.pause()  # until Ctrl-C; SIGTERM ends the process as usual
        except KeyboardInterrupt:
            pass
        finally:
            server.shutdown()
    finally:
        inventory.close()
