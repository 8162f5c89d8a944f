"""Clusters of real ``celery worker`` processes for the Celery task tests, built on
:mod:`testing.celery_processes`: workers sharing one broker, inventory database and lease backend, with
one-shot failpoints configured and disarmed, the test PostgreSQL's fresh schemas they write to, and
RabbitMQ virtual hosts of their own.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from celery import Celery

from fencing import LeaseManager
from reservations import Inventory
from reservations.request_outcomes import RequestResult
from tasks import OutcomeTimeout, ReservationClient, ReservationHandle, Settings, create_app
from testing.celery_processes import CeleryProcess, start_all, stop_all, worker_env
from testing.harness import wait_until
from testing.redis_servers import RedisServer
from testing.stores import own_pg_schema

# A cluster's worker is the harness's default one: ``celery -A tasks worker``, prefork, one pool child.
Worker = CeleryProcess

# Both one-shot failpoints are configured on every worker but start disarmed (marker present): a test
# arms one by deleting its marker, and whichever worker process reaches the point first fires it.
FAILPOINTS = "before_write=stop,once;after_write=kill,once"


# The brokers the end-to-end task tests run on: a private redis-server, and the local RabbitMQ (a vhost
# per cluster, so no test sees another's queues). The result backend is Redis either way.
BROKERS = ("redis", "rabbitmq")
RABBITMQ_URL = os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672")
RABBITMQ_USER = "guest"


def _rabbitmqctl(*args: str) -> None:
    done = subprocess.run(
        ["rabbitmqctl", "--quiet", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr or done.stdout}")


@contextmanager
def rabbitmq_vhost(prefix: str = "tasks") -> Iterator[str]:
    """The broker URL of a new virtual host on the local RabbitMQ, deleted (with its queues) afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _rabbitmqctl("add_vhost", name)
    try:
        _rabbitmqctl("set_permissions", "-p", name, RABBITMQ_USER, ".*", ".*", ".*")
        yield f"{RABBITMQ_URL}/{name}"
    finally:
        _rabbitmqctl("delete_vhost", name)


def pg_schema() -> AbstractContextManager[str]:
    """A migrated inventory database in a fresh schema of the test PostgreSQL, dropped afterwards (migrated
    by replaying the run's one real migration, testing.stores.migrate_pg_schema)."""
    return own_pg_schema(migrated=True, prefix="tasks_")


@contextmanager
def migrated_database(kind: str, folder: Path, migrated_sqlite: Path) -> Iterator[str]:
    """The URL of a migrated inventory database of ``kind`` for workers: a fresh PostgreSQL schema
    (dropped afterwards), or a copy of the run's migrated SQLite file in ``folder``."""
    if kind == "postgresql":
        with pg_schema() as url:
            yield url
        return
    path = folder / "inventory.sqlite3"
    shutil.copyfile(migrated_sqlite, path)
    yield f"sqlite:///{path}"


@dataclass(frozen=True)
class Cluster:
    """Workers sharing one broker, result backend, inventory database and lease backend."""

    settings: Mapping[str, str]  # the RESERVATIONS_* variables every worker got
    workers: list[Worker]
    failpoint_dir: Path

    @property
    def parsed(self) -> Settings:
        """The settings the workers built from those variables."""
        return Settings.from_env(self.settings)

    @property
    def database_url(self) -> str:
        return self.parsed.database_url

    @property
    def lease_url(self) -> str:
        return self.parsed.lease_url

    def app(self) -> Celery:
        """A producer app of our own built from the cluster's settings, independent of import order."""
        return create_app(self.parsed)

    def client(self) -> ReservationClient:
        return ReservationClient(self.app())

    def arm(self, point: str, *, settle: bool = True) -> None:
        """Arm a one-shot failpoint once no message is in flight: the next worker process to reach it fires
        it, for the next request enqueued. A message an earlier request left behind (a second enqueue under
        the same key, answered from the stored outcome before its message was consumed) would otherwise
        reach the point first, in a worker the test does not watch. ``settle=False``: arm at once, for a
        test whose own requests are in flight and meant to reach the point."""
        if settle:
            self.settle()
        (self.failpoint_dir / point).unlink(missing_ok=True)

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until a Redis broker holds no message, queued or delivered and unacknowledged (a RabbitMQ
        vhost is the cluster's own and not looked at)."""
        url = self.settings["RESERVATIONS_BROKER_URL"]
        if not url.startswith("redis"):
            return
        with redis.Redis.from_url(url) as broker:

            def idle() -> bool:
                return int(broker.llen("celery")) + int(broker.hlen("unacked")) == 0

            wait_until(idle, timeout=timeout, what="the broker to hold no message")

    def tails(self, lines: int = 30) -> str:
        return "\n".join(worker.tail(lines) for worker in self.workers)

    def worker_with_stopped_child(self) -> tuple[Worker, int] | None:
        for worker in self.workers:
            child = worker.stopped_child()
            if child is not None:
                return worker, child
        return None


@contextmanager
def cluster(
    workdir: Path,
    settings: Mapping[str, str],
    *,
    count: int = 2,
    prefix: str = "w",
    failpoint_spec: str = FAILPOINTS,
) -> Iterator[Cluster]:
    """``count`` workers with the given RESERVATIONS_* settings and the failpoints configured, disarmed."""
    failpoints = workdir / "failpoints"
    failpoints.mkdir(parents=True, exist_ok=True)
    for part in failpoint_spec.split(";"):
        (failpoints / part.partition("=")[0]).touch()
    full = {**settings, **Settings(failpoints=failpoint_spec, failpoint_dir=str(failpoints)).to_env()}
    env = worker_env(full)
    workers = [Worker(f"{prefix}{n}", env, workdir / f"{prefix}{n}.log") for n in range(1, count + 1)]
    try:
        start_all(workers)
        yield Cluster(settings=full, workers=workers, failpoint_dir=failpoints)
    finally:
        stop_all(workers)


@contextmanager
def one_worker(
    kind: str, workdir: Path, redis_url: Callable[[int], str], migrated_sqlite: Path, *, prefix: str
) -> Iterator[tuple[Cluster, str]]:
    """One worker of this code on a migrated inventory database of ``kind`` (its SQL leases there too),
    broker and results on databases of a private Redis (``redis_url(n)``), kept apart per kind; yields
    the cluster and the database's URL."""
    db = 0 if kind == "sqlite" else 2
    with migrated_database(kind, workdir, migrated_sqlite) as url:
        env = {
            "RESERVATIONS_BROKER_URL": redis_url(db),
            "RESERVATIONS_RESULT_BACKEND": redis_url(db + 1),
            "RESERVATIONS_DATABASE_URL": url,
        }
        with cluster(workdir, env, count=1, prefix=f"{prefix}{kind[:2]}") as started:
            yield started, url


OUTCOME_TIMEOUT = 30.0  # far below the broker's visibility timeout (3600 s): no redelivery comes from it


FAULT_TIMEOUT = 15.0


@dataclass(frozen=True)
class Stack:
    """A running cluster and this test process's own clients for it."""

    cluster: Cluster
    client: ReservationClient
    inventory: Inventory
    leases: LeaseManager

    def result(self, handle: ReservationHandle) -> RequestResult:
        try:
            return handle.result_sync(timeout=OUTCOME_TIMEOUT)
        except OutcomeTimeout as exc:
            raise AssertionError(f"{exc}\n{self.cluster.tails()}") from None

    def results(self, handles: list[ReservationHandle]) -> list[RequestResult]:
        return [self.result(handle) for handle in handles]

    def reservations_of(self, sku: str, key: str) -> list[str]:
        return [r.id for r in self.inventory.reservations(sku, limit=1000) if r.idempotency_key == key]

    def writes_of(self, sku: str, key: str) -> list[str]:
        history = self.inventory.history(sku)
        return [h.operation for h in history if h.kind == "write" and h.idempotency_key == key]


@contextmanager
def stack(
    name: str,
    workdir: Path,
    server: RedisServer,
    broker_db: int,
    *,
    broker: str | None = None,
    failpoint_spec: str = FAILPOINTS,
    **settings: str,
) -> Iterator[Stack]:
    """Workers ``<name>1`` and ``<name>2`` on their own schema and broker/result databases of ``server``;
    ``broker``: another broker's URL instead (the results stay on ``server``)."""
    with pg_schema() as db:
        env = {
            "RESERVATIONS_BROKER_URL": broker or server.url(broker_db),
            "RESERVATIONS_RESULT_BACKEND": server.url(broker_db + 1),
            "RESERVATIONS_DATABASE_URL": db,
            **settings,
        }
        with cluster(workdir, env, prefix=name, failpoint_spec=failpoint_spec) as running:
            for worker in running.workers:  # the banner names the transport a worker consumes from
                scheme = env["RESERVATIONS_BROKER_URL"].partition("://")[0]
                assert f"transport:   {scheme}://" in worker.log(), worker.tail()
            client = running.client()
            inventory = Inventory.from_url(db)
            leases = LeaseManager.from_url(running.lease_url)
            try:
                yield Stack(running, client, inventory, leases)
            finally:
                leases.close()
                inventory.close()
                client.close()
                client.app.close()


# The SQL-lease clusters keep each request's Celery result: their tests compare it with the outcome row.
# The Redis-lease cluster runs at the default, which stores none.
KEEP_RESULTS = {"RESERVATIONS_RESULT_EXPIRES": "600"}


def identity(pid: int) -> str:
    """How a worker process names itself in attempts, outcomes and lease holders."""
    return f"{socket.gethostname()}:{pid}"


def logged(stack: Stack, task_id: str, event: str) -> int:
    """How often any worker logged ``event`` (received, succeeded) for a reserve task."""
    marker = f"Task reservations.reserve[{task_id}] {event}"
    return sum(worker.log().count(marker) for worker in stack.cluster.workers)


def client_result(stack: Stack, task_id: str) -> dict[str, object]:
    """What the task returned to Celery's result backend."""
    result: dict[str, object] = stack.client.app.AsyncResult(task_id).get(timeout=OUTCOME_TIMEOUT)
    return result
