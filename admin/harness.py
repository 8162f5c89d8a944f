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
from typing import IO, TYPE_CHECKING, Any, TypeVar

import redis
import sqlalchemy as sa
from redis.backoff import NoBackoff
from redis.retry import Retry

from fencing.engines import make_engine
from reservations import schema
from tasks.settings import Settings
from tasks.variables import PREFIX

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


class _RedisProcess:
    """What every redis-server the harness starts can be asked: to die as in a crash, or to stop."""

    process: subprocess.Popen[bytes] | None

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


class RedisServer(_RedisProcess):
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

    def client(self, timeout: float = 1.0) -> redis.Redis:
        """A client of this node alone. It never retries by itself: every wait here polls with a deadline
        of its own, and a test that asks a node something wants that node's answer, not a later one."""
        return redis.Redis(
            port=self.port,
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
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                ["redis-server", str(self.config_path), *mode, *options],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = self.process

        def answers() -> bool:
            if process.poll() is not None:
                raise HarnessError(f"redis-server on port {self.port} exited: see {self.log_path}")
            try:
                return bool(self.ask("PING"))
            except redis.RedisError:
                return False

        wait_until(answers, timeout=10, what=f"redis-server on port {self.port} to answer PING")



# Settings every data node of a topology runs with: no persistence (a kill loses the data, as with
# RedisServer), and a full resync (a replica joining, a demoted primary) started at once instead of after
# the 5 s Redis waits by default for more replicas to share the transfer.
_DATA_NODE = ('save ""', "appendonly no", "repl-diskless-sync yes", "repl-diskless-sync-delay 0")


class SentinelTopology:
    """A private Redis Sentinel deployment: a primary, a replica and three sentinels (quorum 2) that
    declare the primary down after ``down_after_ms`` of silence and then promote the replica.

    The data nodes and the sentinels share one password, as the lease URL's password is sent to both.
    The primary accepts writes without a replica confirming them (``min-replicas-to-write 0``, Redis's
    default, written out): replication is asynchronous, so a failover can lose the newest writes, which
    is what the fence and the counter repair are for. Which node is primary is whatever the sentinels
    say; a failover never changes the URL.
    """

    def __init__(
        self,
        folder: Path,
        *,
        service: str = "leases",
        password: str = "sentinel-secret",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 2000,
    ) -> None:
        self.service = service
        self.password = password
        data = [*_DATA_NODE, f"masterauth {password}", "min-replicas-to-write 0"]
        primary = RedisNode(folder / "data-0", data, password=password)
        replica = RedisNode(
            folder / "data-1", [*data, f"replicaof 127.0.0.1 {primary.port}"], password=password
        )
        self.data = [primary, replica]
        watch = [
            f"sentinel monitor {service} 127.0.0.1 {primary.port} 2",
            f"sentinel down-after-milliseconds {service} {down_after_ms}",
            f"sentinel failover-timeout {service} {failover_timeout_ms}",
            f"sentinel auth-pass {service} {password}",
        ]
        self.sentinels = [
            RedisNode(folder / f"sentinel-{i}", watch, sentinel=True, password=password) for i in range(3)
        ]

    def url(self, db: int = 0) -> str:
        hosts = ",".join(s.name for s in self.sentinels)
        return f"redis+sentinel://:{self.password}@{hosts}/{self.service}/{db}"

    def start(self, timeout: float = 30) -> None:
        for node in [*self.data, *self.sentinels]:
            node.start()
        self.wait_healthy(timeout)

    def stop(self) -> None:
        for node in [*self.sentinels, *self.data]:
            node.stop()

    def node(self, port: int) -> RedisNode:
        return next(node for node in self.data if node.port == port)

    def named_primary(self) -> int | None:
        """The primary's port as every live sentinel names it; None while they disagree or cannot say."""
        ports = set()
        for sentinel in self.sentinels:
            if not sentinel.alive():
                continue
            try:
                address = sentinel.ask("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
            except redis.RedisError:
                return None
            if not address:
                return None
            ports.add(int(address[1]))
        return ports.pop() if len(ports) == 1 else None

    def primary(self, timeout: float = 30) -> RedisNode:
        return self.node(wait_until(self.named_primary, timeout=timeout, what="the sentinels to agree"))

    def replica(self, timeout: float = 30) -> RedisNode:
        primary = self.primary(timeout)
        return next(node for node in self.data if node is not primary)

    def healthy(self) -> bool:
        """The sentinels agree on a primary that says it is one, with the other node replicating it, and
        every sentinel sees the other two and that replica, none of them down or failing over."""
        port = self.named_primary()
        if port is None or not all(node.alive() for node in self.data):
            return False
        replica = next(node for node in self.data if node.port != port)
        try:
            if self.node(port).info("replication")["role"] != "master":
                return False
            link = replica.info("replication")
            if link.get("master_port") != port or link.get("master_link_status") != "up":
                return False
            for sentinel in self.sentinels:
                master = _pairs(sentinel.ask("SENTINEL", "MASTER", self.service))
                if master["flags"] != "master" or master["num-other-sentinels"] != "2":
                    return False
                replicas = [_pairs(r) for r in sentinel.ask("SENTINEL", "REPLICAS", self.service)]
                seen = {int(r["port"]): r["flags"] for r in replicas}
                if seen.get(replica.port) != "slave":
                    return False
        except redis.RedisError:
            return False
        return True

    def wait_healthy(self, timeout: float = 30) -> None:
        wait_until(self.healthy, timeout=timeout, what="the sentinel topology to be healthy")

    def failover(self, timeout: float = 30) -> RedisNode:
        """``SENTINEL FAILOVER``: the replica is promoted while the primary still runs; the sentinels
        demote the old primary later. Returns the new primary once every sentinel names it."""
        old = self.primary()
        self.sentinels[0].ask("SENTINEL", "FAILOVER", self.service)
        return self.promoted(old, timeout)

    def kill_primary(self, timeout: float = 30) -> RedisNode:
        """SIGKILL the primary (its data is gone); returns the replica once every sentinel names it."""
        old = self.primary()
        old.kill()
        return self.promoted(old, timeout)

    def promoted(self, old: RedisNode, timeout: float = 30) -> RedisNode:
        """The primary that replaced ``old``, once every sentinel names it."""

        def moved() -> int | None:
            port = self.named_primary()
            return port if port not in (None, old.port) else None

        return self.node(wait_until(moved, timeout=timeout, what=f"a primary other than {old.name}"))

    def heal(self, timeout: float = 30) -> None:
        """Bring a killed data node back as a replica of the current primary, as an operator would (left
        to the sentinels, a node that comes back as an empty primary is demoted only after 8 s), and wait
        until the topology is healthy again."""
        primary = self.primary(timeout)
        for node in self.data:
            if not node.alive():
                node.start("--replicaof", "127.0.0.1", str(primary.port))
        self.wait_healthy(timeout)


def _pairs(flat: Any) -> dict[str, Any]:
    """A Redis reply of alternating names and values (``SENTINEL MASTER``) as a dict."""
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[::2], flat[1::2], strict=True))


class ClusterTopology:
    """A private Redis Cluster of ``masters`` primaries without replicas, each on a free port with a
    cluster bus port of its own, the slots split among them by ``redis-cli --cluster create``."""

    def __init__(self, folder: Path, *, masters: int = 3) -> None:
        self.nodes = [
            RedisNode(
                folder / f"node-{i}",
                [
                    *_DATA_NODE,
                    "cluster-enabled yes",
                    "cluster-config-file nodes.conf",
                    f"cluster-port {free_port()}",
                ],
            )
            for i in range(masters)
        ]

    def url(self) -> str:
        return "redis+cluster://" + ",".join(node.name for node in self.nodes)

    def start(self, timeout: float = 60) -> None:
        for node in self.nodes:
            node.start()
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *(node.name for node in self.nodes), "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if created.returncode != 0:
            raise HarnessError(f"redis-cli --cluster create failed:\n{created.stdout}{created.stderr}")
        wait_until(self.ok, timeout=timeout, what="the cluster to be ok on every node")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def slot_owners(self, node: RedisNode) -> dict[int, int]:
        """Slot -> the port of its primary, as ``node`` sees the cluster."""
        owners = {}
        for first, last, primary, *_ in node.ask("CLUSTER", "SLOTS"):
            for slot in range(int(first), int(last) + 1):
                owners[slot] = int(primary[1])
        return owners

    def ok(self) -> bool:
        """Every node says cluster_state:ok and all agree on who serves each slot."""
        try:
            if any("cluster_state:ok" not in node.ask("CLUSTER", "INFO") for node in self.nodes):
                return False
            views = [self.slot_owners(node) for node in self.nodes]
        except redis.RedisError:
            return False
        return len(views[0]) == 16384 and all(view == views[0] for view in views)

    def node_id(self, node: RedisNode) -> str:
        return str(node.ask("CLUSTER", "MYID"))

    def owner(self, slot: int) -> RedisNode:
        port = self.slot_owners(self.nodes[0])[slot]
        return next(node for node in self.nodes if node.port == port)

    def migrate_slot(
        self,
        slot: int,
        target: RedisNode,
        *,
        between: Callable[[int], object] = lambda left: None,
        timeout: float = 30,
    ) -> None:
        """Move ``slot`` to ``target`` as ``redis-cli --cluster reshard`` does, one key at a time:
        IMPORTING on the target, MIGRATING on the source, MIGRATE each key, then the new owner announced
        to every node. ``between(keys left on the source)`` runs once the slot is marked migrating and
        again after each key, so a caller can let its traffic meet every stage; it must return."""
        source = self.owner(slot)
        source_id, target_id = self.node_id(source), self.node_id(target)
        target.ask("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.ask("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        left = int(source.ask("CLUSTER", "COUNTKEYSINSLOT", slot))
        between(left)
        # Keys only leave the source while the slot migrates (a missing key is created on the target), so
        # the slot is empty after as many rounds as it held keys.
        for _ in range(left):
            keys = source.ask("CLUSTER", "GETKEYSINSLOT", slot, 1)
            if not keys:
                break
            source.ask("MIGRATE", "127.0.0.1", target.port, keys[0], 0, 5000)
            between(int(source.ask("CLUSTER", "COUNTKEYSINSLOT", slot)))
        for node in [target, source, *(n for n in self.nodes if n not in (source, target))]:
            node.ask("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        wait_until(
            lambda: self.ok() and self.owner(slot) is target,
            timeout=timeout,
            what=f"every node to agree that {target.name} serves slot {slot}",
        )


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
