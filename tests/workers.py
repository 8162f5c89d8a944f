"""Real processes for the Celery task tests: a private redis-server, a fresh PostgreSQL schema, and
``celery worker`` processes started, inspected (pool child, stopped state, log) and stopped by their own
pids, plus the polling helper every wait in those tests goes through.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

import redis
import sqlalchemy as sa
from celery import Celery

from fencing.sql import make_engine
from reservations import schema
from tasks import ReservationClient, Settings, create_app
from tests.conftest import POSTGRES_URL

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
CELERY = ROOT / ".venv" / "bin" / "celery"
START_TIMEOUT = 30.0  # a worker imports celery, sqlalchemy and the app: seconds on a busy 2-CPU box
STOP_TIMEOUT = 10.0
POLL = 0.02

# Both one-shot failpoints are configured on every worker but start disarmed (marker present): a test
# arms one by deleting its marker, and whichever worker process reaches the point first fires it.
FAILPOINTS = "before_write=stop,once;after_write=kill,once"


def wait_until(check: Callable[[], T | None], *, timeout: float, what: str, interval: float = POLL) -> T:
    """Poll ``check`` until it returns something truthy; TimeoutError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server of our own for broker, results and Redis leases: the shared one is never touched."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        process = self.process
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)

        def answers() -> bool:
            if process.poll() is not None:  # e.g. the port was taken between free_port() and bind
                raise RuntimeError(f"redis-server on port {self.port} exited with {process.returncode}")
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        try:
            wait_until(answers, timeout=10, what=f"redis-server on port {self.port} to answer PING")
        finally:
            client.close()

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    workdir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(workdir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@contextmanager
def pg_schema() -> Iterator[str]:
    """A migrated inventory database in a fresh PostgreSQL schema, dropped afterwards."""
    name = f"tasks_{uuid.uuid4().hex[:12]}"
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
    try:
        url = f"{POSTGRES_URL}?options=-csearch_path%3D{name}"
        schema.upgrade(url)
        yield url
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{name}" CASCADE'))
        admin.dispose()


def process_state(pid: int) -> str | None:
    """The one-letter state from /proc (R, S, T for stopped, Z...), None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rpartition(")")[2].split()[0]  # the command name may itself contain ") "


def children(pid: int) -> list[int]:
    found: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.extend(int(p) for p in path.read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return sorted(set(found))


@dataclass
class Worker:
    """One ``celery worker`` (prefork, one pool child) in its own session, logging to ``log_path``."""

    name: str
    env: Mapping[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                str(CELERY),
                "-A",
                "tasks",
                "worker",
                "--pool",
                "prefork",
                "-c",
                "1",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-n",
                f"{self.name}@%h",
                "--loglevel",
                "INFO",
            ],
            env=dict(self.env),
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: teardown signals reach the pool child too
        )

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return f"--- last lines of {self.name}'s log ---\n" + "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        ready = re.compile(rf"\b{re.escape(self.name)}@\S+ ready\.")

        def is_ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}\n{self.tail()}")
            return bool(ready.search(self.log()))

        try:
            wait_until(is_ready, timeout=timeout, what=f"worker {self.name} to log 'ready.'")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.tail()}") from None

    def pool_children(self) -> list[int]:
        """The pool processes that run the tasks (forked by the worker's main process)."""
        return children(self.pid)

    def pool_child(self, timeout: float = START_TIMEOUT) -> int:
        """The one live pool child; waits while the main process replaces a child that died."""

        def one() -> int | None:
            live = [pid for pid in self.pool_children() if process_state(pid) not in (None, "Z")]
            return live[0] if len(live) == 1 else None

        return wait_until(one, timeout=timeout, what=f"{self.name} to have one live pool child")

    def stopped_child(self) -> int | None:
        """The pool child that stopped itself (state T), if any."""
        return next((pid for pid in self.pool_children() if process_state(pid) == "T"), None)

    def signal_group(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_workers(workers: list[Worker], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM every worker's group at once (SIGCONT first: a stopped child cannot exit), then SIGKILL."""
    for worker in workers:
        worker.signal_group(signal.SIGCONT)
        worker.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for worker in workers:
        if worker.process is None:
            continue
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.signal_group(signal.SIGKILL)
            worker.process.wait()
        # The main process is gone; a pool child it left behind must not outlive the test either.
        with suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.close_log()


@dataclass(frozen=True)
class Cluster:
    """Workers sharing one broker, result backend, inventory database and lease backend."""

    settings: Mapping[str, str]  # the RESERVATIONS_* variables every worker got
    workers: list[Worker]
    failpoint_dir: Path

    @property
    def database_url(self) -> str:
        return self.settings["RESERVATIONS_DATABASE_URL"]

    @property
    def lease_url(self) -> str:
        return self.settings.get("RESERVATIONS_LEASE_URL") or self.database_url

    def app(self) -> Celery:
        """A producer app of our own built from the cluster's settings, independent of import order."""
        return create_app(Settings.from_env(self.settings))

    def client(self) -> ReservationClient:
        return ReservationClient(self.app())

    def arm(self, point: str) -> None:
        """Arm a one-shot failpoint: the next worker process to reach it fires it."""
        (self.failpoint_dir / point).unlink(missing_ok=True)

    def tails(self, lines: int = 30) -> str:
        return "\n".join(worker.tail(lines) for worker in self.workers)

    def worker_with_stopped_child(self) -> tuple[Worker, int] | None:
        for worker in self.workers:
            child = worker.stopped_child()
            if child is not None:
                return worker, child
        return None


def worker_env(settings: Mapping[str, str]) -> dict[str, str]:
    """The test process's environment minus any RESERVATIONS_* of its own, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESERVATIONS_")}
    env.update(settings)
    env["PYTHONUNBUFFERED"] = "1"
    return env


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
    full = {
        **settings,
        "RESERVATIONS_FAILPOINTS": failpoint_spec,
        "RESERVATIONS_FAILPOINT_DIR": str(failpoints),
    }
    env = worker_env(full)
    workers = [Worker(f"{prefix}{n}", env, workdir / f"{prefix}{n}.log") for n in range(1, count + 1)]
    try:
        for worker in workers:  # all start before any is waited for: the imports overlap
            worker.start()
        for worker in workers:
            worker.wait_ready()
        yield Cluster(settings=full, workers=workers, failpoint_dir=failpoints)
    finally:
        stop_workers(workers)
