"""Private redis-servers without persistence: one standalone server, or the nodes and sentinels the
topologies of :mod:`testing.redis_topologies` are made of."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from testing.harness import STOP_TIMEOUT, end_process, free_port, spawn, wait_answering


class _RedisProcess:
    """What every redis-server the harness starts can be asked: to die as in a crash, or to stop."""

    process: subprocess.Popen[bytes] | None

    def kill(self) -> None:
        """SIGKILL: the data is gone, as in a crash without persistence."""
        process, self.process = self.process, None
        if process is not None:
            end_process(process, time.monotonic(), group=False)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            with suppress(ProcessLookupError):
                process.terminate()
            end_process(process, time.monotonic() + STOP_TIMEOUT, group=False)


class RedisServer(_RedisProcess):
    """A private redis-server without persistence: a restart loses everything, as a crash would. The
    shared Redis is never touched by a run's broker, results or leases. It listens on 127.0.0.1 and on
    ``binds`` (the service address of :class:`testing.netns.Hosts`, for processes on hosts of their own)."""

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
        self.process = spawn(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1", *self.binds),
                *("--save", "", "--appendonly", "no", "--dir", str(self.folder)),
                *("--databases", str(self.databases)),
                # Protected mode answers only loopback; the other address is the hosts' service
                # address, which nothing but the run's own namespaces reaches.
                *(("--protected-mode", "no") if self.binds else ()),
            ],
            self.log_path,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        try:
            name = f"redis-server on port {self.port}"
            wait_answering(self.process, answers, name=name, log=self.log_path, timeout=10)
            self.version = str(client.info("server")["redis_version"])
        finally:
            client.close()


@contextmanager
def redis_server(folder: Path, *, databases: int = 16) -> Iterator[RedisServer]:
    server = RedisServer(folder, databases=databases)
    try:
        server.start()
        yield server
    finally:
        server.stop()


class RedisNode(_RedisProcess):
    """One redis-server of the topologies below: a data node, a cluster node, or a sentinel
    (``sentinel=True``), run from a config file of its own in ``folder``. The file is written at the first
    start only: sentinels and cluster nodes rewrite theirs (who is primary, the cluster's node table), so a
    node started again comes back with what it had learned, as in production. Data is never persisted: a
    kill loses it. ``password`` is the node's requirepass, which every client made here sends."""

    def __init__(
        self, folder: Path, settings: Iterable[str], *, sentinel: bool = False, password: str | None = None
    ) -> None:
        self.folder = folder
        self.port = free_port()
        self.sentinel = sentinel
        self.password = password
        auth = [f"requirepass {password}"] if password else []
        self._settings = [f"port {self.port}", "bind 127.0.0.1", f'dir "{folder}"', *auth, *settings]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.folder / "redis.conf"

    @property
    def log_path(self) -> Path:
        return self.folder / "redis.log"

    def client(self, timeout: float = 1.0, db: int = 0) -> redis.Redis:
        """A client of this node alone. It never retries by itself: every wait here polls with a deadline
        of its own, and a test that asks a node something wants that node's answer, not a later one."""
        return redis.Redis(
            port=self.port,
            db=db,
            password=self.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            decode_responses=True,
            retry=Retry(NoBackoff(), 0),
        )

    def ask(self, *args: str | int) -> Any:
        """One command on this node."""
        with self.client() as client:
            return client.execute_command(*args)

    def info(self, section: str) -> dict[str, Any]:
        with self.client() as client:
            return dict(client.info(section))

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, *options: str) -> None:
        """Start (or start again, on the same port and file) and wait until it answers PING. ``options``
        hold for this start only (``--replicaof 127.0.0.1 6380``), after what the file says."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self.config_path.exists():
            self.config_path.write_text("\n".join(self._settings) + "\n")
        mode = ["--sentinel"] if self.sentinel else []
        self.process = spawn(["redis-server", str(self.config_path), *mode, *options], self.log_path)

        def answers() -> bool:
            try:
                return bool(self.ask("PING"))
            except redis.RedisError:
                return False

        name = f"redis-server on port {self.port}"
        wait_answering(self.process, answers, name=name, log=self.log_path, timeout=10)
