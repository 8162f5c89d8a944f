"""Private Redis Sentinel and Redis Cluster deployments, for the lease failover tests and the chaos
run's lease-failover nemesis."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from testing.harness import HarnessError, free_port, wait_until
from testing.redis_servers import RedisNode

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
