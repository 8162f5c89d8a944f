"""``reservations metrics``: a Prometheus exporter of what lives in the database, read at each scrape: stale
writes refused per SKU (the stock rows' history), request outcomes by status, requests queued for their
SKU's lease holder, recorded requests still without an outcome (how many, the oldest's age), rows in the
history's DEFAULT partitions; and whether the lease backend and the broker answer, asked the way the
workers ask them. Per-SKU labels belong here, not on the workers: they are bounded by the catalogue.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import sqlalchemy as sa
import typer
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from admin.cli import context
from admin.cli.failures import EXIT_FAILED, EXIT_UNREACHABLE, fail
from fencing import LeaseManager
from fencing.urls import mask_url
from reservations.archive import default_rows
from reservations.inventory import Inventory
from reservations.models import request_outcomes
from reservations.statuses import RequestStatus
from tasks.logs import say
from tasks.settings import Settings

if TYPE_CHECKING:
    from tasks.producer import Producer

DEFAULT_PORT = 9809
# A scope no lease is taken of: reading it asks the lease backend without touching any SKU's lease.
PROBE_SCOPE = "reservations:metrics-probe"
PROBE_TIMEOUT = 2.0
# The backends the exporter asks at each scrape: each gauge, and its help. A probe is the call that
# raises when its backend does not answer.
PROBES = {
    "reservations_db_lease_backend_up": "1 if the lease backend answered a read",
    "reservations_db_broker_up": "1 if the broker took a connection",
}
Probe = Callable[[], object]
# The workers' default (RESERVATIONS_METRICS_HOST): nothing is exposed beyond this host unless asked.
DEFAULT_HOST = Settings.metrics_host


def outcome_counts(inventory: Inventory) -> dict[str, int]:
    """Request outcomes still kept (see their retention), by status."""
    query = sa.select(request_outcomes.c.status, sa.func.count()).group_by(request_outcomes.c.status)
    with inventory.executor.engine.connect() as conn:
        return {str(status): int(count) for status, count in conn.execute(query)}


class DatabaseCollector(Collector):
    """Reads the database at every scrape; a database that does not answer makes ``up`` 0, not an error.
    With ``probes`` (a gauge of PROBES -> the call that raises when its backend does not answer) each
    gives its gauge, 1 or 0."""

    def __init__(self, inventory: Inventory, probes: dict[str, Probe] | None = None) -> None:
        self.inventory = inventory
        self.probes = probes or {}

    def collect(self) -> Iterator[Any]:
        yield from self._probed()
        up = GaugeMetricFamily("reservations_db_up", "1 if this scrape could read the inventory database")
        try:
            rejected = self.inventory.rejection_counts()
            outcomes = outcome_counts(self.inventory)
            waiting = self.inventory.waiting_by_sku()
            open_count, oldest = self.inventory.unfinished()
            in_default = default_rows(self.inventory.executor.engine)
        except Exception:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        stuck = GaugeMetricFamily(
            "reservations_db_unfinished_requests", "recorded requests without an outcome yet"
        )
        stuck.add_metric([], open_count)
        yield stuck
        age = GaugeMetricFamily(
            "reservations_db_oldest_unfinished_request_age_seconds",
            "age of the oldest recorded request without an outcome (0: none)",
        )
        age.add_metric([], oldest or 0.0)
        yield age
        default = GaugeMetricFamily(
            "reservations_db_default_partition_rows",
            "history rows in a DEFAULT partition, which no archive run takes (PostgreSQL)",
            labels=["table"],
        )
        for table, count in sorted(in_default.items()):
            default.add_metric([table], count)
        yield default
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

    def _probed(self) -> Iterator[Any]:
        for name, probe in self.probes.items():
            gauge = GaugeMetricFamily(name, PROBES[name])
            try:
                probe()
            except Exception:
                gauge.add_metric([], 0)
            else:
                gauge.add_metric([], 1)
            yield gauge


def _probes(leases: LeaseManager, producer: Producer) -> dict[str, Probe]:
    """Whether the lease backend and the broker answer: a read of a scope nobody holds, and a connection
    to the broker opened and closed (with the workers' transport options: a Sentinel's service)."""

    def broker() -> None:
        with producer.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=PROBE_TIMEOUT)

    return {
        "reservations_db_lease_backend_up": lambda: leases.current(PROBE_SCOPE),
        "reservations_db_broker_up": broker,
    }


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
    from tasks.producer import Producer  # here: Celery's app would cost every other command its start

    inventory, leases = context.inventory(), context.leases()
    producer = Producer.configured(context.config.settings)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(inventory, _probes(leases, producer)))
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
        say(f"serving database metrics on {host} port {port}", logger="reservations.metrics")
        try:
            signal.pause()  # until Ctrl-C; SIGTERM ends the process as usual
        except KeyboardInterrupt:
            pass
        finally:
            server.shutdown()
    finally:
        producer.close()
        leases.close()
        inventory.close()
