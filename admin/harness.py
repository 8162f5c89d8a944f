"""The process harness: private redis-servers, ``celery worker`` and ``celery beat`` processes, and the
polling every wait goes through. The demo, the fault-injection run, the benchmarks and the tests all start
their processes here, so a fix (ports, signals, readiness) is made once.

Every process runs in its own session: a Ctrl-C in the terminal reaches only us, and a signal to the
group reaches a worker's pool children too.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeVar

import redis
import sqlalchemy as sa

from fencing.sql import make_engine
from reservations import schema
from reservations.settings import PREFIX, Settings

if TYPE_CHECKING:
    from admin.netns import Host

T = TypeVar("T")

POLL = 0.02
START_TIMEOUT = 60.0  # a worker imports celery, sqlalchemy and the app: seconds on a busy 2-CPU box
STOP_TIMEOUT = 10.0


class HarnessError(RuntimeError):
    """A process of the harness did not start, or exited while it was being waited for."""


class HarnessTimeout(HarnessError, TimeoutError):
    """A wait of the harness passed its deadline."""


def wait_until(check: Callable[[], T | None], *, timeout: float, what: str, interval: float = POLL) -> T:
    """Poll ``check`` until it returns something truthy; :class:`HarnessTimeout` naming ``what`` at the
    deadline. ``check`` may raise to give up early (a process it waits for has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise HarnessTimeout(f"gave up after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    """A free TCP port on loopback below the ephemeral range.

    Not one the kernel hands out for outgoing connections: while a server is down (killed by a test, or
    not bound yet), a client's reconnect attempt to that port could be given it as its own source port and
    connect to itself, and the port would then stay taken (in TIME-WAIT) for a minute.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.Random()
    for _ in range(200):
        port = pick.randrange(max(1024, low - 12000), max(1025, low))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise HarnessError(f"no free port below the ephemeral range (from {low})")


def process_state(pid: int) -> str | None:
    """The one-letter state from /proc (R, S, T for stopped, Z...), None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]  # the command name may itself contain ") "


def children(pid: int) -> list[int]:
    """The direct children of ``pid``, from /proc."""
    found: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        with suppress(OSError):
            found.extend(int(p) for p in path.read_text().split())
    return sorted(set(found))


def _end(process: subprocess.Popen[bytes], deadline: float, *, group: bool) -> None:
    """Wait for ``process`` until ``deadline``, then SIGKILL it (and its group)."""
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    with suppress(ProcessLookupError, PermissionError):
        if group:  # the main process may be gone; a pool child it orphaned must not outlive us
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    process.wait()


class RedisServer:
    """A private redis-server without persistence: a restart loses everything, as a crash would. The
    shared Redis is never touched by a run's broker, results or leases. It listens on 127.0.0.1 and on
    ``binds`` (the service address of :class:`admin.netns.Hosts`, for processes on hosts of their own)."""

    def __init__(self, folder: Path, *, databases: int = 16, binds: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.databases = max(16, databases)
        self.binds = binds
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.version = ""

    def url(self, db: int | None = 0, host: str = "127.0.0.1") -> str:
        base = f"redis://{host}:{self.port}"
        return base if db is None else f"{base}/{db}"

    @property
    def log_path(self) -> Path:
        return self.folder / "redis-server.log"

    def start(self) -> None:
        """Start (or restart, on the same port) and wait until it answers PING."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1", *self.binds),
                    *("--save", "", "--appendonly", "no", "--dir", str(self.folder)),
                    *("--databases", str(self.databases)),
                    # Protected mode answers only loopback; the other address is the hosts' service
                    # address, which nothing but the run's own namespaces reaches.
                    *(("--protected-mode", "no") if self.binds else ()),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = self.process
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)

        def answers() -> bool:
            if process.poll() is not None:
                raise HarnessError(f"redis-server on port {self.port} exited: see {self.log_path}")
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        try:
            wait_until(answers, timeout=10, what=f"redis-server on port {self.port} to answer PING")
            self.version = str(client.info("server")["redis_version"])
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: the data is gone, as in a crash without persistence."""
        process, self.process = self.process, None
        if process is not None:
            _end(process, time.monotonic(), group=False)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            with suppress(ProcessLookupError):
                process.terminate()
            _end(process, time.monotonic() + STOP_TIMEOUT, group=False)


@contextmanager
def redis_server(folder: Path, *, databases: int = 16) -> Iterator[RedisServer]:
    server = RedisServer(folder, databases=databases)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@dataclass
class CeleryProcess:
    """One ``celery worker`` (or ``celery beat`` with ``kind="beat"``) in its own session, logging to
    ``log_path``; readiness is read from the log, after where it stood when the process was started.
    ``cwd`` matters only for an ``app`` that is not installed (``python -m celery`` imports it from there).
    With a ``host`` (:mod:`admin.netns`) it runs on that host: same process, its own network namespace."""

    name: str
    env: Mapping[str, str]
    log_path: Path
    kind: str = "worker"
    app: str = "tasks"
    pool: str = "prefork"
    concurrency: int = 1
    cwd: Path | None = None
    host: Host | None = None
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)
    _log_from: int = field(default=0, repr=False)

    def command(self) -> list[str]:
        return self.host.wrap(self._command()) if self.host is not None else self._command()

    def _command(self) -> list[str]:
        celery = [sys.executable, "-m", "celery", "-A", self.app]
        if self.kind == "beat":
            schedule = self.log_path.with_name(f"{self.name}-schedule")
            return [*celery, "beat", "-s", str(schedule), "--loglevel", "INFO"]
        return [
            *celery,
            *("worker", "--pool", self.pool, "-c", str(self.concurrency), "-n", f"{self.name}@%h"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"),
        ]

    def start(self) -> None:
        """Start (or start again after a kill), appending to the same log."""
        self.close_log()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log_from = self._log.tell()
        self.process = subprocess.Popen(
            self.command(),
            env={**self.env, "PYTHONUNBUFFERED": "1"},  # readiness is read from the log, not a buffer
            cwd=self.cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        if self.process is None:
            raise HarnessError(f"{self.name} was never started")
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        """This start's part of the log."""
        with self.log_path.open("rb") as log:
            log.seek(self._log_from)
            return log.read().decode(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return f"--- last lines of {self.name}'s log ---\n" + "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        if self.kind == "beat":
            ready = re.compile(r"beat: Starting")
        else:
            ready = re.compile(rf"\b{re.escape(self.name)}@\S+ ready\.")

        def is_ready() -> bool:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise HarnessError(f"{self.name} exited with {code}\n{self.tail()}")
            return bool(ready.search(self.log()))

        try:
            wait_until(is_ready, timeout=timeout, what=f"{self.name} to be ready")
        except HarnessTimeout as exc:
            raise HarnessTimeout(f"{exc}\n{self.tail()}") from None

    def pool_children(self) -> list[int]:
        """The pool processes that run the tasks (forked by the worker's main process)."""
        return [] if self.process is None else children(self.process.pid)

    def pool_child(self, timeout: float = START_TIMEOUT) -> int:
        """The one live pool child; waits while the main process replaces a child that died."""

        def one() -> int | None:
            live = [pid for pid in self.pool_children() if process_state(pid) not in (None, "Z")]
            return live[0] if len(live) == 1 else None

        return wait_until(one, timeout=timeout, what=f"{self.name} to have one live pool child")

    def stopped_child(self) -> int | None:
        """A pool child in the stopped state (T), if any."""
        return next((pid for pid in self.pool_children() if process_state(pid) == "T"), None)

    def signal_group(self, sig: signal.Signals) -> None:
        if self.process is not None:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP the whole group: a pause the process cannot notice until it is thawed."""
        self.signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal_group(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the group (the worker and its pool children), as a crash would."""
        self.signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()

    def terminate(self) -> None:
        """Ask for a warm shutdown; a stopped child cannot exit, so thaw first."""
        self.thaw()
        self.signal_group(signal.SIGTERM)

    def stop(self, deadline: float | None = None) -> None:
        """Wait for the process until ``deadline`` (monotonic), then SIGKILL whatever is left."""
        if self.process is not None:
            _end(self.process, time.monotonic() + STOP_TIMEOUT if deadline is None else deadline, group=True)
        self.close_log()

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_all(processes: Iterable[CeleryProcess], timeout: float = STOP_TIMEOUT) -> None:
    """Warm shutdown for all at once (each finishes the task it runs, in parallel), SIGKILL at the end."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.stop(deadline)


def start_all(processes: Iterable[CeleryProcess], timeout: float = START_TIMEOUT) -> None:
    """Start all before waiting for any: their imports overlap."""
    processes = list(processes)
    for process in processes:
        process.start()
    for process in processes:
        process.wait_ready(timeout)


def worker_env(
    settings: Settings | Mapping[str, str], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` (our environment by default) without any ``RESERVATIONS_*`` of its own, plus ``settings``:
    a :class:`Settings` (its ``to_env()``) or the variables themselves."""
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if not k.startswith(PREFIX)}
    env.update(settings.to_env() if isinstance(settings, Settings) else settings)
    return env


@contextmanager
def pg_schema(
    admin_url: str, *, prefix: str = "run", after_upgrade: Callable[[str], None] | None = None
) -> Iterator[str]:
    """A migrated inventory database in a fresh PostgreSQL schema (URL with its search_path), dropped on
    exit. ``after_upgrade(schema_name)`` may change it before it is handed out."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = make_engine(admin_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
        url = f"{admin_url}?options=-csearch_path%3D{name}"
        schema.upgrade(url)
        if after_upgrade is not None:
            after_upgrade(name)
        yield url
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        engine.dispose()
