"""Private Redis Sentinel and Redis Cluster deployments, for the lease and broker failover tests and the
chaos run's lease-failover nemesis; and the relay a Sentinel replica can replicate through, to lose what
asynchronous replication loses."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import redis

from testing.harness import HarnessError, HarnessTimeout, free_port, wait_until
from testing.redis_servers import RedisNode

# How often a topology's state is asked while it converges (seconds of gossip and elections): each look
# opens a connection per node and sentinel, so the harness's usual 20 ms would spend a core on asking.
LOOK = 0.1

# Settings every data node of a topology runs with: no persistence (a kill loses the data, as with
# RedisServer), and a full resync (a replica joining, a demoted primary) started at once instead of after
# the 5 s Redis waits by default for more replicas to share the transfer.
_DATA_NODE = ('save ""', "appendonly no", "repl-diskless-sync yes", "repl-diskless-sync-delay 0")


class Relay:
    """A TCP relay a replica replicates through. ``hold`` keeps what the primary sends from reaching the
    replica (it waits in the relay, as a lagging link's bytes do); ``sever`` closes every connection and
    drops what was held, so the replica never receives it: asynchronous replication's loss."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._severed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="relay", daemon=True).start()

    def _accept(self) -> None:
        while not self._severed.is_set():
            try:
                downstream, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [downstream, upstream]
            threading.Thread(target=self._pump, args=(upstream, downstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(downstream, upstream, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_primary: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if from_primary:
                self._flowing.wait()
            if not data or self._severed.is_set():
                return
            try:
                sink.sendall(data)
            except OSError:
                return

    def hold(self) -> None:
        self._flowing.clear()

    def sever(self) -> None:
        self._severed.set()
        self._flowing.set()  # the held pumps wake up, see the relay severed and drop what they hold
        with suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


class SentinelTopology:
    """A private Redis Sentinel deployment: a primary, a replica and three sentinels (quorum 2) that
    declare the primary down after ``down_after_ms`` of silence and then promote the replica.

    The data nodes and the sentinels share one password (``None``: no password), as the lease URL's
    password is sent to both. The primary accepts writes without a replica confirming them
    (``min-replicas-to-write 0``, Redis's default, written out): replication is asynchronous, so a
    failover can lose the newest writes, which is what the fence and the counter repair are for, and what
    the relay republishes for a broker. With ``relayed`` the replica replicates through a :class:`Relay`
    (``relay``), so that a test decides what it misses. Which node is primary is whatever the sentinels
    say; a failover never changes the URL.
    """

    def __init__(
        self,
        folder: Path,
        *,
        service: str = "leases",
        password: str | None = "sentinel-secret",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 2000,
        relayed: bool = False,
    ) -> None:
        self.service = service
        self.password = password
        auth = [f"masterauth {password}"] if password else []
        data = [*_DATA_NODE, *auth, "min-replicas-to-write 0"]
        primary = RedisNode(folder / "data-0", data, password=password)
        self.relay = Relay(primary.port) if relayed else None
        upstream = self.relay.port if self.relay is not None else primary.port
        replica = RedisNode(folder / "data-1", [*data, f"replicaof 127.0.0.1 {upstream}"], password=password)
        self.data = [primary, replica]
        watch = [
            f"sentinel monitor {service} 127.0.0.1 {primary.port} 2",
            f"sentinel down-after-milliseconds {service} {down_after_ms}",
            f"sentinel failover-timeout {service} {failover_timeout_ms}",
            *([f"sentinel auth-pass {service} {password}"] if password else []),
        ]
        self.sentinels = [
            RedisNode(folder / f"sentinel-{i}", watch, sentinel=True, password=password) for i in range(3)
        ]

    def url(self, db: int = 0) -> str:
        """The lease URL (``redis+sentinel://``) naming every sentinel."""
        hosts = ",".join(s.name for s in self.sentinels)
        auth = f":{self.password}@" if self.password else ""
        return f"redis+sentinel://{auth}{hosts}/{self.service}/{db}"

    def broker_url(self, db: int = 0) -> str:
        """The broker or result backend URL (kombu's ``sentinel://``, one per sentinel)."""
        auth = f":{self.password}@" if self.password else ""
        return ";".join(f"sentinel://{auth}{s.name}/{db}" for s in self.sentinels)

    def start(self, timeout: float = 60) -> None:
        for node in [*self.data, *self.sentinels]:
            node.start()
        self.wait_healthy(timeout)

    def stop(self) -> None:
        if self.relay is not None:
            self.relay.sever()
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
        return self.node(
            wait_until(self.named_primary, timeout=timeout, what="the sentinels to agree", interval=LOOK)
        )

    def replica(self, timeout: float = 30) -> RedisNode:
        primary = self.primary(timeout)
        return next(node for node in self.data if node is not primary)

    def unhealthy(self) -> str | None:
        """What keeps the topology from being healthy, None once it is: the sentinels agree on a primary
        that says it is one, with the other node replicating it, and every sentinel sees the other two and
        that replica, none of them down or failing over."""
        port = self.named_primary()
        if port is None:
            return "the sentinels do not agree on a primary"
        if not all(node.alive() for node in self.data):
            return "a data node has exited"
        replica = next(node for node in self.data if node.port != port)
        try:
            role = self.node(port).info("replication")["role"]
            if role != "master":
                return f"the primary the sentinels name ({port}) says it is a {role}"
            link = replica.info("replication")
            # A replica of the first primary may reach it through the relay.
            upstream = {port} | ({self.relay.port} if self.relay is not None else set())
            if link.get("master_port") not in upstream or link.get("master_link_status") != "up":
                return f"the replica's link: {link.get('master_port')} {link.get('master_link_status')}"
            for sentinel in self.sentinels:
                master = _pairs(sentinel.ask("SENTINEL", "MASTER", self.service))
                if master["flags"] != "master" or master["num-other-sentinels"] != "2":
                    flags, others = master["flags"], master["num-other-sentinels"]
                    return f"sentinel {sentinel.port}: primary flags {flags}, {others} other sentinels"
                replicas = [_pairs(r) for r in sentinel.ask("SENTINEL", "REPLICAS", self.service)]
                seen = {int(r["port"]): r["flags"] for r in replicas}
                if seen.get(replica.port) != "slave":
                    return f"sentinel {sentinel.port}: the replica's flags {seen.get(replica.port)}"
        except redis.RedisError as exc:
            return f"a node does not answer: {exc}"
        return None

    def wait_healthy(self, timeout: float = 30) -> None:
        """Wait until the topology is healthy; at the deadline, the error says what still kept it from
        being so, with the end of each sentinel's log (a loaded machine's TILT mode, a failover)."""
        why: str | None = None

        def healthy() -> bool:
            nonlocal why
            why = self.unhealthy()
            return why is None

        try:
            wait_until(healthy, timeout=timeout, what="the sentinel topology to be healthy", interval=LOOK)
        except HarnessTimeout as exc:
            logs = "\n".join(f"{s.name}: {_tail(s.log_path)}" for s in self.sentinels)
            raise HarnessTimeout(f"{exc}: {why}\n{logs}") from None

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

        return self.node(
            wait_until(moved, timeout=timeout, what=f"a primary other than {old.name}", interval=LOOK)
        )

    def heal(self, timeout: float = 30) -> None:
        """Bring a killed data node back as a replica of the current primary, as an operator would (left
        to the sentinels, a node that comes back as an empty primary is demoted only after 8 s), and wait
        until the topology is healthy again."""
        primary = self.primary(timeout)
        for node in self.data:
            if not node.alive():
                node.start("--replicaof", "127.0.0.1", str(primary.port))
        self.wait_healthy(timeout)


@contextmanager
def sentinel_topology(folder: Path, **options: Any) -> Iterator[SentinelTopology]:
    """A :class:`SentinelTopology` started, and stopped on exit."""
    topology = SentinelTopology(folder, **options)
    try:
        topology.start()
        yield topology
    finally:
        topology.stop()


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
        wait_until(self.ok, timeout=timeout, what="the cluster to be ok on every node", interval=LOOK)

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
            interval=LOOK,
        )


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"no log ({exc})"
