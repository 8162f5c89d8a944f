"""A worker's process: what it makes sure of before it takes tasks (docs/operations.md, "Starting workers"),
the clients it builds, its signals.

Behind a transaction pooler the worker cannot bound its transactions per connection, so it refuses a
database or role that does not: a holder frozen in its transaction would keep its SKU's row locked as
long as it is frozen. Each process builds its own clients on first use and drops inherited ones: a prefork
child must not reuse the parent's sockets (two processes on one connection corrupt both).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import redis
import sqlalchemy as sa
from celery import bootsteps, current_app
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
from redis.backoff import NoBackoff
from redis.retry import Retry

from fencing import BackendUnavailable, LeaseManager, SchemaMissing
from fencing.engines import TransactionBounds, make_engine, transaction_bounds
from fencing.etcd_gateway import ETCD_SCHEMES
from fencing.sql import SyncSqlExecutor
from fencing.urls import mask_url
from reservations import Inventory, schema
from reservations.models import stock
from tasks import failpoints, metrics, otel, tracing
from tasks.answers import note_task_events
from tasks.errors import TasksError
from tasks.failpoints import failpoint
from tasks.logs import celery_says_json, say, use_json, warnings_as_json
from tasks.settings import Settings, SettingsError, json_logs, settings_of, unknown_name_warnings

log = logging.getLogger("tasks.worker")

T = TypeVar("T")

# A thread pool runs many tasks in one process on these clients: let the connection pool grow with it
# (connections open only when needed) instead of queueing tasks on five connections.
SQL_POOL: dict[str, Any] = {"pool_size": 5, "max_overflow": 64}


def client_options(url: str, lease_ttl: float, pooling: str = "session") -> dict[str, Any]:
    """The options a worker builds its client for ``url`` with (Redis, etcd or SQL); ``pooling``: the SQL
    engine's (``RESERVATIONS_DATABASE_POOLING``)."""
    # A lease call that has not answered within a third of the ttl is of no use (a renewal would come too
    # late): give up then, as unavailable, instead of waiting on TCP for minutes when the worker is cut off
    # from Redis or etcd. On etcd that third also covers asking the other members through an election.
    wait = max(0.5, min(5.0, lease_ttl / 3))
    if url.partition("://")[0].lower() in ETCD_SCHEMES:
        return {"timeout": wait, "retry_for": wait}
    if url.startswith(("redis", "rediss", "unix")):
        # One reconnect for a pooled connection the server closed, none with backoff: redis-py's default
        # retries a refused connection ten times with growing pauses, which a sentinel client pays per
        # sentinel, seconds in all, before the call says the primary is unreachable.
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        return {"socket_timeout": wait, "socket_connect_timeout": wait, "retry": retry}
    in_memory = url.startswith("sqlite") and (":memory:" in url or url.rstrip("/") == "sqlite:")
    return {} if in_memory else {**SQL_POOL, "pooling": pooling}


# -- before it takes tasks --------------------------------------------------------------------------------

SAY_EVERY = 10.0
# The scope the lease backend is asked about: a read, which takes no lease and writes nothing.
_PROBE_SCOPE = "readiness:probe"
# What "does not answer" looks like from each client; anything else is a bug or misconfiguration.
_UNANSWERED = (BackendUnavailable, sa.exc.OperationalError, sa.exc.InterfaceError, redis.RedisError, OSError)


def refuse(problem: str) -> NoReturn:
    """One line naming the problem, then exit 2: the code the command line gives a bad setting."""
    say(f"reservations: {problem}", level=logging.ERROR, event="worker_refused")
    raise SystemExit(2)


def wait_for(what: str, where: str, probe: Callable[[], T]) -> T:
    """``probe()``'s answer, once the backend answers (a missing schema is an answer); until then a line
    every :data:`SAY_EVERY` seconds."""
    said: float | None = None
    delay = 0.25
    while True:
        try:
            return probe()
        except SchemaMissing:
            raise
        except _UNANSWERED as exc:
            now = time.monotonic()
            if said is None or now - said >= SAY_EVERY:
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                say(
                    f"reservations worker waiting for its {what} at {where}: {reason}",
                    level=logging.WARNING,
                    event="waiting_for_backend",
                    backend=what,
                )
                said = now
        time.sleep(delay)
        delay = min(5.0, delay * 2)


def _highest_token(url: str) -> int:
    """The highest token any stock row has accepted (0 with none)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(sa.select(sa.func.coalesce(sa.func.max(stock.c.fence_token), 0))).scalar_one()
            )
    finally:
        engine.dispose()


def _bounds(url: str) -> TransactionBounds:
    engine = make_engine(url, pooling="transaction")
    try:
        return transaction_bounds(engine)
    finally:
        engine.dispose()


def wait_until_usable(settings: Settings) -> None:
    """Return once the backends answer and the schema fits this code; exit 2 when it does not."""
    where = mask_url(settings.database_url)
    fit = wait_for("database", where, lambda: schema.fit(settings.database_url))
    if not fit.ok:
        refuse(fit.message)
    if fit.found != fit.needed:
        say(f"reservations worker: {fit.message}", level=logging.WARNING, event="schema_ahead")
    if settings.database_pooling == "transaction":
        bounds = wait_for("database", where, lambda: _bounds(settings.database_url))
        beyond = bounds.beyond(settings.lease_ttl)
        if beyond:
            refuse(
                f"the database at {where} is behind a transaction pooler (RESERVATIONS_DATABASE_POOLING="
                f"transaction) and bounds transactions by more than the lease ttl ({settings.lease_ttl:g}s): "
                f"{', '.join(beyond)}; set both to at most the ttl on the database or role (ALTER ROLE ... "
                "SET ...); the pooler's open server sessions keep the old values until RECONNECT on its "
                "admin console (or server_lifetime): see PgBouncer in docs/operations.md"
            )
    leases = _lease_manager(settings)
    try:
        wait_for("lease backend", leases.url, lambda: leases.current(_PROBE_SCOPE))
        if leases.backend == "etcd":
            # An etcd token is the store's base plus a revision: a store first used by a deployment whose
            # stock rows hold tokens from another store, or restored from a snapshot, is raised above them
            # before this worker takes a lease, so its first write is not refused as stale.
            highest = wait_for("database", where, lambda: _highest_token(settings.database_url))
            if highest:
                wait_for("lease backend", leases.url, lambda: leases.raise_base(highest))
    except SchemaMissing as exc:
        upgrade = "run `reservations db upgrade` on it"
        refuse(f"the lease backend at {leases.url} has no schema ({exc.reason}): {upgrade}")
    finally:
        leases.close()


def loaded_by_celery_command() -> bool:
    """Whether the ``celery`` command line is importing the app (``celery -A tasks worker``)."""
    context = click.get_current_context(silent=True)
    return context is not None and context.find_root().command.name == "celery"


def refuse_bad_settings() -> None:
    """A worker or beat with a bad setting says so in one line and exits 2, rather than a traceback from
    wherever Celery first reads its configuration."""
    if json_logs():  # from the first line on, before Celery sets up its logging
        warnings_as_json()
        celery_says_json()
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        refuse(str(exc))
    problem = failpoints.check(settings.failpoints, settings.failpoint_dir)
    if problem:
        refuse(problem)


# -- this process's clients -------------------------------------------------------------------------------


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
        inventory = Inventory.from_url(
            settings.database_url,
            enforce_fence=settings.enforce_fence,
            before_statement=lambda lease: failpoint("in_write"),
            # Behind a transaction pooler a per-connection setting is lost: the database or role bounds
            # transactions there instead, as the checks at start made sure.
            transaction_timeout=None if settings.database_pooling == "transaction" else settings.lease_ttl,
            **client_options(settings.database_url, settings.lease_ttl, settings.database_pooling),
        )
    except Exception as exc:
        raise Unbuildable("database", exc) from exc
    _commented(settings, inventory.executor)
    return inventory


def _commented(settings: Settings, executor: object) -> None:
    """With ``RESERVATIONS_TRACING=sql``, the statements of a SQL client carry the request's trace."""
    if tracing.SQL in settings.tracing_modes and isinstance(executor, SyncSqlExecutor):
        tracing.comment_statements(executor.engine)


def _lease_manager(settings: Settings) -> LeaseManager:
    options = client_options(settings.lease_url, settings.lease_ttl, settings.database_pooling)
    return LeaseManager.from_url(settings.lease_url, prefix=settings.lease_prefix, **options)


def _build_leases(resources: Resources) -> None:
    try:
        failpoint("build_leases")
        resources.lease_manager = _lease_manager(resources.settings)
        resources.lease_error = None
        _commented(resources.settings, resources.lease_manager.executor)
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


# -- signals and steps ------------------------------------------------------------------------------------


def _settings(sender: Any) -> Settings:
    # A pool child is sent no app: the worker made its own the current one before forking it.
    return settings_of(sender.app if sender is not None else current_app)


@worker_process_init.connect
def _init_process(**_: Any) -> None:
    try:
        resources(_settings(None))
    except Unbuildable as exc:  # each task tries again, and keeps its request until one can record it
        log.error("%s", exc, extra={"event": "client_unbuildable", "backend": exc.backend})
    leave_start_out_of_collections(collect=False)


def leave_start_out_of_collections(*, collect: bool = True) -> None:
    """A full collection of the cyclic garbage collector walks every object the process tracks: a few
    hundred milliseconds once Celery, kombu, SQLAlchemy and the clients are loaded, which a task waits out
    (or, in the HTTP service, every request in flight and every health check, the event loop stopped
    meanwhile). What the process made until it serves lives as long as it does: collections leave it out
    and walk only what requests make. What of it is garbage already is collected first, or it would stay
    for good; not in a pool child, where a collection writes to every object it inherited and so copies
    every page it shares with its parent: what it inherited as garbage, left over from the parent's start,
    is kept, a fixed amount."""
    if collect:
        gc.collect()
    gc.freeze()


@celeryd_init.connect
def _make_sure_it_can_work(instance: Any = None, **_: Any) -> None:
    """Before the pool forks and the worker consumes: the backends answer and the schema fits. With JSON
    logs, Celery's banner is left out of the stream."""
    if json_logs() and instance is not None:
        instance.quiet = True
    wait_until_usable(_settings(instance))


worker_process_shutdown.connect(close_resources)
worker_shutdown.connect(close_resources)
celeryd_after_setup.connect(note_task_events)


@worker_process_shutdown.connect
def _flush_spans(**_: Any) -> None:
    otel.flush()  # a pool child's spans made since the last batch went out


@celeryd_after_setup.connect
def _after_setup(instance: Any = None, **_: Any) -> None:
    """Warn of each RESERVATIONS_* name that is no setting (a typo, otherwise ignored without a word), then
    switch OpenTelemetry spans (RESERVATIONS_TRACING=otel) and metrics (RESERVATIONS_METRICS_PORT) on
    before the pool forks: either that cannot work stops the worker at start with one line, as a bad
    setting does."""
    for line in unknown_name_warnings():
        log.warning(line)
    settings = _settings(instance)
    if tracing.OTEL in settings.tracing_modes:
        try:
            otel.switch_on()
        except otel.TracingUnavailable as exc:
            refuse(str(exc))
    if not settings.metrics_port:
        return
    try:
        metrics.switch_on()
    except metrics.MetricsUnusable as exc:
        # SystemExit passes through Celery's signal dispatch, which logs and swallows only Exception: the
        # worker exits here, before its pool forks or its consumer connects.
        refuse(str(exc))


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    """One line when the worker takes tasks, whatever the log level: where it reads and writes, passwords
    masked, on the real stderr past Celery's stdout redirection. Then its metrics are served."""
    settings = _settings(sender)
    name = getattr(sender, "hostname", None) or worker_identity()
    say(
        f"reservations worker {name} ready: database {mask_url(settings.database_url)}, "
        f"leases {mask_url(settings.lease_url or settings.database_url)}, "
        f"broker {mask_url(settings.broker_url)}, lease ttl {settings.lease_ttl:g}s",
        event="worker_ready",
    )
    # The consumer's process, and the one that runs tasks without a prefork pool.
    leave_start_out_of_collections()
    port, host = settings.metrics_port, settings.metrics_host
    if not port:
        return
    try:
        metrics.serve(port, host)
    except OSError as exc:  # the worker still works; its metrics are missing, and the log says why
        log.error("cannot serve metrics on %s port %d: %s", host, port, exc)
    else:
        log.info("metrics on %s port %d", host, port)


@after_setup_logger.connect
@after_setup_task_logger.connect
def _log_format(logger: logging.Logger | None = None, **_: Any) -> None:
    """Celery has set up a worker's or beat's log handlers: with RESERVATIONS_LOG_FORMAT=json they write
    one JSON object per line."""
    if logger is not None and _settings(None).log_format == "json":
        # The pool's logger (billiard's: a child that exited, was lost) has handlers of its own.
        use_json([*logger.handlers, *get_multiprocessing_logger().handlers])


# A worker's liveness as a file (RESERVATIONS_HEARTBEAT_FILE): its consumer touches it every few seconds
# from its own event loop, so a health check reads the file's age instead of starting a Celery client.
# A check may call the worker dead once the file is several intervals old (compose.yaml allows 60 s).
INTERVAL = 5.0


class HeartbeatFile(bootsteps.StartStopStep):  # type: ignore[misc]
    """Touches the file while the consumer runs: a blocked event loop, or a consumer restarting after
    losing its broker, stops the touches."""

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        path = settings_of(consumer.app).heartbeat_file
        self.path = Path(path or ".")
        self.enabled = bool(path)  # unset: the step is left out of the worker
        self.timer_entry: Any = None
        super().__init__(consumer, **kwargs)

    def start(self, consumer: Any) -> None:
        self.touch()
        self.timer_entry = consumer.timer.call_repeatedly(INTERVAL, self.touch)

    def touch(self) -> None:
        with suppress(OSError):  # a full or read-only disk must not stop the consumer
            self.path.touch()

    def stop(self, consumer: Any) -> None:
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None

    shutdown = stop
