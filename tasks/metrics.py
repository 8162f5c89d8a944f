"""What a worker tells operators: the log line of each request event (facts as fields) and Prometheus
metrics, off unless ``RESERVATIONS_METRICS_PORT`` is set: then the worker's main process serves the sum of
its pool children (prometheus_client's multiprocess mode).

No label names a SKU (per-SKU figures come from the database, ``reservations metrics``). Every label's
values are a small fixed set whose series exist at 0 from the worker's start: ``rate()`` and
``increase()`` need a sample before an event, so a series born at 1 would hide the first stale write or
dead letter after each start from the alerts.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Literal, get_args

from fencing import LostOwnership, StaleToken
from reservations.request_outcomes import RequestResult
from reservations.statuses import RequestStatus
from tasks.errors import TasksError
from tasks.messages import ENQUEUED_AT, SHAPES, Message

log = logging.getLogger("tasks.metrics")
events = logging.getLogger("tasks")

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"

# Enqueue to final outcome: a reservation takes milliseconds when the SKU is free, a ttl or more after a
# lost epoch or while a hot SKU's queue drains.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
EPOCH_BUCKETS = (0, 1, 2, 3, 5, 10)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)

# The label values of the counters.
LeaseResult = Literal["acquired", "busy", "lost"]
LEASE_RESULTS: tuple[LeaseResult, ...] = get_args(LeaseResult)
# The batch server's operation: its refused writes name no request.
SERVE_PENDING = "serve_pending"
OPERATIONS = (*sorted({shape.operation for shape in SHAPES.values()}), SERVE_PENDING)
BACKENDS = ("database", "redis")  # as fencing's BackendUnavailable names them
DropReason = Literal["undecodable", "malformed"]
DROP_REASONS: tuple[DropReason, ...] = get_args(DropReason)


class Off:
    """Metrics switched off: every call does nothing."""

    on = False

    def stale_refused(self, operation: str) -> None: ...
    def lease(self, result: LeaseResult, count: int = 1) -> None: ...
    def regression_repaired(self) -> None: ...
    def outcome(self, status: str, epochs: int, latency: float | None) -> None: ...
    def queued(self) -> None: ...
    def batch(self, size: int) -> None: ...
    def transient(self, backend: str) -> None: ...
    def dropped(self, reason: DropReason) -> None: ...


class On(Off):
    """The worker's metrics; built once per worker, in its main process before the pool forks."""

    on = True

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.stale = Counter(
            "reservations_stale_writes_refused",
            "writes the stock rows refused as stale (a newer epoch had written), by operation",
            ["operation"],
        )
        self.leases = Counter(
            "reservations_leases",
            "SKU leases taken by tasks: acquired, busy (held by another), lost (stale or run out)",
            ["result"],
        )
        self.repairs = Counter(
            "reservations_token_regressions_repaired",
            "lease counters raised past the database's highest token after the coordinator went backwards",
        )
        self.outcomes = Counter(
            "reservations_outcomes", "final outcomes given by this worker, by status", ["status"]
        )
        self.handoffs = Counter(
            "reservations_queued_requests", "reservations handed to their SKU's lease holder (hot SKU)"
        )
        self.epochs = Histogram(
            "reservations_request_epochs",
            "epochs a request lost before its final outcome (0: none)",
            buckets=EPOCH_BUCKETS,
        )
        self.batches = Histogram(
            "reservations_batch_size", "queued requests served per fenced batch", buckets=BATCH_BUCKETS
        )
        self.latency = Histogram(
            "reservations_request_latency_seconds",
            "enqueue to final outcome, for requests answered by their own task",
            buckets=LATENCY_BUCKETS,
        )
        self.transients = Counter(
            "reservations_transient_failures",
            "attempts retried because a backend was unreachable, by backend",
            ["backend"],
        )
        self.drops = Counter(
            "reservations_messages_dropped",
            "messages taken from the broker that no task could be made of, dropped by the worker's consumer: "
            "undecodable (no JSON), malformed (a body that does not decode, no properties, no task's body)",
            ["reason"],
        )
        for counter, values in (
            (self.stale, OPERATIONS),
            (self.leases, LEASE_RESULTS),
            (self.outcomes, tuple(RequestStatus)),
            (self.transients, BACKENDS),
            (self.drops, DROP_REASONS),
        ):
            for value in values:
                counter.labels(value)

    def stale_refused(self, operation: str) -> None:
        self.stale.labels(operation).inc()

    def lease(self, result: LeaseResult, count: int = 1) -> None:
        self.leases.labels(result).inc(count)

    def regression_repaired(self) -> None:
        self.repairs.inc()

    def outcome(self, status: str, epochs: int, latency: float | None) -> None:
        self.outcomes.labels(status).inc()
        self.epochs.observe(epochs)
        if latency is not None and latency >= 0:
            self.latency.observe(latency)

    def queued(self) -> None:
        self.handoffs.inc()

    def batch(self, size: int) -> None:
        self.batches.observe(size)

    def transient(self, backend: str) -> None:
        self.transients.labels(backend).inc()

    def dropped(self, reason: DropReason) -> None:
        self.drops.labels(reason).inc()


current: Off = Off()


class _Repairs(logging.Handler):
    """Counts the regression repairs the fencing package logs: it knows nothing of metrics."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == "token_regression_repaired":
            current.regression_repaired()


class MetricsUnusable(TasksError):
    """Metrics were asked for and cannot work here. A worker refuses to start on it, as on a bad setting:
    one serving no metrics looks like one that sees no stale writes."""


def switch_on() -> None:
    """Metrics on for this worker (main process, before the pool forks), in a clean multiprocess directory:
    PROMETHEUS_MULTIPROC_DIR's, without an earlier run's values (they would be summed in), or a new one."""
    global current
    if isinstance(current, On):
        return
    folder = os.environ.get(MULTIPROC_DIR)
    if not folder:
        os.environ[MULTIPROC_DIR] = folder = tempfile.mkdtemp(prefix="reservations-metrics-")
    elif Path(folder).exists() and not Path(folder).is_dir():
        raise MetricsUnusable(
            f"{MULTIPROC_DIR}={folder} is not a directory (it names where the worker's processes keep "
            "their metrics)"
        )
    else:
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            for stale in Path(folder).glob("*.db"):
                stale.unlink()
        except OSError as exc:
            raise MetricsUnusable(f"{MULTIPROC_DIR}={folder} cannot be used: {exc.strerror or exc}") from exc
    # prometheus_client picks where its values live (this process, or the directory) when it is first
    # imported, and Celery may have imported it before the directory was set: Flower's `celery flower`
    # command, found through its entry point whenever the celery command starts, imports it. So the
    # choice is made again now, before any of the metrics is made.
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    try:
        current = On()
    except OSError as exc:
        raise MetricsUnusable(f"{MULTIPROC_DIR}={folder} cannot be written: {exc.strerror or exc}") from exc
    logging.getLogger("fencing").addHandler(_Repairs())


def serve(port: int, host: str) -> None:
    """Serve the sum of this worker's processes on ``host:port``."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.environ[MULTIPROC_DIR])  # type: ignore[no-untyped-call]
    start_http_server(port, addr=host, registry=registry)


# -- the events of a request task ------------------------------------------------------------------------

# The facts of a fencing event, on each of its records (None where they do not apply).
FENCING_FIELDS = ("scope", "sku", "token", "highest", "holder", "lease_id", "task_id", "epoch")


def fencing_fields(**known: Any) -> dict[str, Any]:
    """The fencing event fields with ``known`` filled in; the SKU read from a ``sku:`` scope."""
    fields: dict[str, Any] = dict.fromkeys(FENCING_FIELDS)
    fields.update(known)
    scope = fields.get("scope")
    if fields["sku"] is None and isinstance(scope, str) and scope.startswith("sku:"):
        fields["sku"] = scope.removeprefix("sku:")
    return fields


def lost_ownership(
    lost: LostOwnership, lease_token: int | None, message: Message | None, doing: str = "", **who: Any
) -> dict[str, Any]:
    """Log an attempt (or a batch server, without ``message``, ``doing`` what) that lost its lease, and
    return the fields, which tell one lost epoch from another; ``who``: task_id, worker (key, operation).
    The line starts "lost ownership of <scope>", which the chaos run counts."""
    request = {"key": message.key, "operation": message.operation} if message is not None else {}
    fields = {
        **fencing_fields(
            scope=lost.scope,
            token=lost.token or lease_token,
            highest=lost.highest if isinstance(lost, StaleToken) else None,
            holder=f"{who.get('worker')}:{who.get('task_id')}",
            lease_id=lost.lease_id,
            task_id=who.get("task_id"),
            epoch=message.counts["epoch"] if message is not None else None,
        ),
        "lost_by": type(lost).__name__,
        **who,
        **request,
    }
    current.lease("lost")
    if isinstance(lost, StaleToken):
        current.stale_refused(message.operation if message is not None else SERVE_PENDING)
    events.warning(
        "lost ownership of %s%s (token %s, highest accepted %s) in task %s on %s: %s",
        lost.scope,
        f" while {doing}" if doing else "",
        fields["token"],
        fields["highest"],
        fields["task_id"],
        who.get("worker"),
        lost,
        extra={"event": "lost_ownership", **fields},
    )
    return fields


def dead_lettered(message: Message, reason: str, who: dict[str, Any], **facts: Any) -> None:
    """Log a request dead-lettered for ``reason``; ``facts``: the fencing fields known."""
    # The SKU a single-SKU request names, where no lease's scope says it (the backend stayed down, the
    # lease client could not be built); an order's SKUs are its lines'.
    sku = message.args.get("sku") if "sku" not in facts and "scope" not in facts else None
    fields = fencing_fields(
        task_id=who.get("task_id"), epoch=message.counts["epoch"], **({"sku": sku} if sku else {}), **facts
    )
    events.warning(
        "request %s (%s) dead-lettered in task %s: %s",
        message.key,
        message.operation,
        who.get("task_id"),
        reason,
        extra={
            "event": "dead_lettered",
            **fields,
            "key": message.key,
            "operation": message.operation,
            "reason": reason,
            "worker": who.get("worker"),
        },
    )


def finished(request: Any, result: dict[str, Any]) -> None:
    """Count a request task's answer: its outcome, epochs and latency, or a hand-off to its SKU's holder."""
    if not current.on:
        return
    if result.get("status") == "queued":
        current.queued()
        return
    enqueued = getattr(request, ENQUEUED_AT, None)
    latency = time.time() - enqueued if isinstance(enqueued, int | float) else None
    current.outcome(str(result.get("status")), int(result.get("epochs") or 0), latency)


def served(outcomes: list[RequestResult]) -> None:
    """Count a batch served: its size and outcomes (their enqueue times travel in their own messages)."""
    if current.on and outcomes:
        current.batch(len(outcomes))
        for outcome in outcomes:
            current.outcome(outcome.status, outcome.epochs, None)
