"""Per-process clients for Celery workers: created after fork, closed at shutdown, never shared.

A prefork child must not reuse the parent's sockets (two processes on one connection corrupt both), so
each process builds its own lease manager and database pool on first use and drops inherited ones.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from celery import current_app
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    celeryd_after_setup,
    celeryd_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from celery.utils.log import get_multiprocessing_logger

from fencing import LeaseManager
from fencing.sql_executor import SyncSqlExecutor
from fencing.urls import mask_url
from reservations import Inventory
from tasks import metrics
from tasks.answers import note_task_events
from tasks.connections import client_options
from tasks.errors import TasksError
from tasks.failpoints import failpoint
from tasks.logs import say, use_json
from tasks.readiness import refuse, wait_until_usable
from tasks.settings import Settings, json_logs, settings_of, unknown_name_warnings

log = logging.getLogger("tasks.worker")


class Unbuildable(TasksError):
    """A client this process could not build from settings that passed the checks at start: a failed
    import, no file descriptors left, an injected fault. ``backend`` names which."""

    def __init__(self, backend: str, error: BaseException) -> None:
        self.backend = backend
        self.error = error
        super().__init__(f"the {backend} client cannot be built: {type(error).__name__}: {error}")


@dataclass
class Resources:
    """This process's clients. The lease manager may be missing (its construction failed): a request
    then ends ``dead_lettered`` with the reason, recorded through the inventory, instead of failing
    without an outcome; the next use tries to build it again."""

    settings: Settings
    inventory: Inventory
    pid: int
    lease_manager: LeaseManager | None = None
    lease_error: Unbuildable | None = None

    @property
    def leases(self) -> LeaseManager:
        if self.lease_manager is None:
            raise self.lease_error or Unbuildable("lease backend", RuntimeError("not built"))
        return self.lease_manager

    def close(self) -> None:
        self.inventory.close()
        if self.lease_manager is not None:
            self.lease_manager.close()


_lock = threading.Lock()
_resources: Resources | None = None

_identity: tuple[int, str] | None = None


def worker_identity() -> str:
    """``host:pid`` of this process, as every record of its attempts names it. Kept per process: asking
    the kernel for the host name is a system call, and a request task names its worker several times."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:
        _identity = (pid, f"{socket.gethostname()}:{pid}")
    return _identity[1]


def _build_inventory(settings: Settings) -> Inventory:
    try:
        failpoint("build_inventory")
        return Inventory.from_url(
            settings.database_url,
            enforce_fence=settings.enforce_fence,
            before_statement=lambda lease: failpoint("in_write"),
            # Behind a transaction pooler a per-connection setting is lost: the database or role bounds
            # transactions there instead, as the checks at start made sure (tasks.readiness).
            transaction_timeout=None if settings.database_pooling == "transaction" else settings.lease_ttl,
            **client_options(settings.database_url, settings.lease_ttl, settings.database_pooling),
        )
    except Exception as exc:
        raise Unbuildable("database", exc) from exc


def _build_leases(resources: Resources) -> None:
    settings = resources.settings
    try:
        failpoint("build_leases")
        resources.lease_manager = LeaseManager.from_url(
            settings.lease_url,
            prefix=settings.lease_prefix,
            **client_options(settings.lease_url, settings.lease_ttl, settings.database_pooling),
        )
        resources.lease_error = None
    except Exception as exc:
        resources.lease_error = Unbuildable("lease backend", exc)
        log.error("%s", resources.lease_error, extra={"event": "client_unbuildable", "backend": "leases"})


def resources(settings: Settings) -> Resources:
    """This process's clients, created on first use (and again in a forked child). Unbuildable when the
    inventory's cannot be built: then no outcome can be recorded either."""
    global _resources
    with _lock:
        if _resources is None or _resources.pid != os.getpid():
            if _resources is not None:
                # Inherited from the parent: drop the pool without closing the parent's connections.
                _resources.inventory.executor.engine.dispose(close=False)
                if _resources.lease_manager is not None and isinstance(
                    _resources.lease_manager.executor, SyncSqlExecutor
                ):
                    _resources.lease_manager.executor.engine.dispose(close=False)
                _resources = None
            _resources = Resources(settings=settings, inventory=_build_inventory(settings), pid=os.getpid())
        if _resources.lease_manager is None:
            _build_leases(_resources)
        return _resources


def close_resources(**_: Any) -> None:
    global _resources
    with _lock:
        if _resources is not None and _resources.pid == os.getpid():
            _resources.close()
        _resources = None


@worker_process_init.connect
def _init_process(**_: Any) -> None:
    # A pool child is sent no app: the worker made its own the current one before forking it.
    try:
        resources(settings_of(current_app))
    except Unbuildable as exc:  # each task tries again, and keeps its request until one can record it
        log.error("%s", exc, extra={"event": "client_unbuildable", "backend": exc.backend})


@celeryd_init.connect
def _make_sure_it_can_work(instance: Any = None, **_: Any) -> None:
    """Before the pool forks and the worker consumes: the backends answer (waited for) and the schema
    fits this code (exit 2 otherwise). With JSON logs, Celery's banner is left out of the stream."""
    if json_logs() and instance is not None:
        instance.quiet = True
    wait_until_usable(settings_of(instance.app if instance is not None else current_app))


worker_process_shutdown.connect(close_resources)
worker_shutdown.connect(close_resources)
celeryd_after_setup.connect(note_task_events)


@celeryd_after_setup.connect
def _warn_unknown_names(**_: Any) -> None:
    """A RESERVATIONS_* name that is no setting (a typo) would otherwise be ignored without a word."""
    for line in unknown_name_warnings():
        log.warning(line)


@worker_ready.connect
def _say_ready(sender: Any = None, **_: Any) -> None:
    """One line when the worker takes tasks, whatever the log level (Celery's own is INFO): where it
    reads and writes, passwords masked. Written to the real stderr, past Celery's stdout redirection."""
    settings = settings_of(sender.app if sender is not None else current_app)
    name = getattr(sender, "hostname", None) or worker_identity()
    say(
        f"reservations worker {name} ready: database {mask_url(settings.database_url)}, "
        f"leases {mask_url(settings.lease_url or settings.database_url)}, "
        f"broker {mask_url(settings.broker_url)}, lease ttl {settings.lease_ttl:g}s",
        event="worker_ready",
    )


# -- logs and metrics of a worker (and beat) --------------------------------------------------------------


@after_setup_logger.connect
@after_setup_task_logger.connect
def _log_format(logger: logging.Logger | None = None, **_: Any) -> None:
    """Celery has set up a worker's or beat's log handlers: with RESERVATIONS_LOG_FORMAT=json they write
    one JSON object per line, with each record's fields (:mod:`tasks.logs`)."""
    if logger is not None and settings_of(current_app).log_format == "json":
        # The pool's logger (billiard's: a child that exited, was lost) has handlers of its own.
        use_json([*logger.handlers, *get_multiprocessing_logger().handlers])


@celeryd_after_setup.connect
def _metrics_on(instance: Any = None, **_: Any) -> None:
    """With RESERVATIONS_METRICS_PORT set, a worker's metrics are switched on before its pool forks; metrics
    that cannot work stop it at start with one line, as a bad setting does."""
    if not settings_of(instance.app if instance is not None else current_app).metrics_port:
        return
    try:
        metrics.switch_on()
    except metrics.MetricsUnusable as exc:
        # SystemExit passes through Celery's signal dispatch, which logs and swallows only Exception: the
        # worker exits here, before its pool forks or its consumer connects.
        refuse(str(exc))


@worker_ready.connect
def _serve_metrics(sender: Any = None, **_: Any) -> None:
    settings = settings_of(sender.app if sender is not None else current_app)
    port, host = settings.metrics_port, settings.metrics_host
    if not port:
        return
    try:
        metrics.serve(port, host)
    except OSError as exc:  # the worker still works; its metrics are missing, and the log says why
        log.error("cannot serve metrics on %s port %d: %s", host, port, exc)
    else:
        log.info("metrics on %s port %d", host, port)
