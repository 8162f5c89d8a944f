"""A real network partition: a Celery worker on a host of its own (a network namespace with a veth pair)
holds a SKU's lease when its host is cut off from the lease Redis, both ways, while it keeps its database
connection. Its write has passed the lease's local checks and is delayed on its way (the ``in_write``
failpoint: the delayed packet); meanwhile its renewal fails, the lease runs out, and a newer holder takes
the next token and writes. The delayed write arrives anyway. The stock row refuses that write; after the
heal every request ends with one outcome, and nothing of the host is left on the machine.

Needs root and ``ip netns`` (skipped with the reason otherwise).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from fencing import LeaseManager
from reservations import Inventory, scope_of
from tasks.producer import Producer
from testing import netns
from testing.celery_processes import CeleryProcess, start_all, stop_all, worker_env
from testing.harness import wait_until
from testing.links import Link
from testing.netns import Hosts
from testing.pg_schemas import pg_schema
from testing.proxy import DelayProxy
from testing.redis_servers import RedisServer
from testing.stores import POSTGRES_URL

UNAVAILABLE = netns.unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no network namespaces here: {UNAVAILABLE}"),
]

SKU = "WIDGET"
KEYS = ("part-1", "part-2")
# The worker's write waits this long after its local checks, before its statement is sent: the partition
# comes in that time, the lease (ttl 1 s) runs out, and the newer holder writes first.
HANDLER_SLEEP = 3.0


@dataclass
class Partitioned:
    database_url: str
    host: netns.Host
    made: list[str]  # the namespace and link the host is made of
    lease_port: int
    leases: LeaseManager
    inventory: Inventory
    producer: Producer
    worker: CeleryProcess


@contextmanager
def partitioned(folder: Path) -> Iterator[Partitioned]:
    """A schema, a host, two private redis-servers and a PostgreSQL forwarder on its service address, and
    one worker on the host; the test's own clients reach the servers on loopback."""
    with ExitStack() as stack:
        database_url = stack.enter_context(pg_schema(POSTGRES_URL, prefix="partition"))
        hosts = stack.enter_context(Hosts(["holder"]))
        host = hosts["holder"]
        broker = RedisServer(folder / "broker", binds=(host.service,))
        lease_redis = RedisServer(folder / "leases", binds=(host.service,))
        stack.callback(broker.kill)
        stack.callback(lease_redis.kill)
        broker.start()
        lease_redis.start()
        target = sa.engine.make_url(database_url)
        forwarder = DelayProxy(
            (target.host or "127.0.0.1", target.port or 5432), delay=0.0, fraction=0.0, listen=host.service
        ).start()
        stack.callback(forwarder.close)
        settings = {
            "RESERVATIONS_DATABASE_URL": target.set(host=host.service, port=forwarder.port).render_as_string(
                hide_password=False
            ),
            "RESERVATIONS_BROKER_URL": broker.url(0, host.service),
            "RESERVATIONS_RESULT_BACKEND": broker.url(1, host.service),
            "RESERVATIONS_LEASE_URL": lease_redis.url(0, host.service),
            "RESERVATIONS_LEASE_TTL": "1",
            "RESERVATIONS_VISIBILITY_TIMEOUT": "60",
            "RESERVATIONS_BATCHING": "0",
            "RESERVATIONS_FAILPOINTS": f"in_write=sleep:{HANDLER_SLEEP:g},once",
            "RESERVATIONS_FAILPOINT_DIR": str(folder / "failpoints"),
        }
        worker = CeleryProcess("holder", worker_env(settings), folder / "holder.log", host=host)
        stack.callback(stop_all, [worker])
        inventory = stack.enter_context(Inventory.from_url(database_url))
        leases = stack.enter_context(LeaseManager.from_url(lease_redis.url(0)))
        producer = stack.enter_context(Producer(broker.url(0), broker.url(1)))
        inventory.add_sku(SKU, on_hand=10)
        start_all([worker])
        yield Partitioned(
            database_url, host, hosts.made(), lease_redis.port, leases, inventory, producer, worker
        )


def test_a_holder_cut_off_from_the_lease_redis_writes_late_and_is_refused_at_the_stock_row(
    tmp_path: Path,
) -> None:
    with partitioned(tmp_path) as run:
        made = run.made
        for key in KEYS:
            run.producer.send("reserve", key, {"sku": SKU, "quantity": 1})
        scope = scope_of(SKU)
        pid = run.worker.pool_child()

        # The worker takes the lease (its pool child is the holder) and its write is held before it is
        # sent: cut its host off from the lease Redis, both ways. The database stays reachable.
        first = wait_until(
            lambda: (info := run.leases.current(scope)) is not None and f":{pid}:" in info.holder and info,
            timeout=30,
            what="the worker to hold the SKU's lease",
        )
        link = Link(run.host)
        try:
            link.cut(run.lease_port)
            # Its renewals no longer arrive: the lease runs out at the coordinator, a newer holder takes
            # the next token and writes first.
            wait_until(
                lambda: run.leases.current(scope) is None, timeout=5, what="the cut-off lease to run out"
            )
            newer = run.leases.acquire(scope, ttl=30, holder="root-namespace:newer")
            assert newer.token == first.token + 1
            run.inventory.restock(newer, SKU, 1, key="newer-epoch")

            # The held write goes out with the old token.
            refused = wait_until(
                lambda: [e for e in run.inventory.history(SKU) if e.kind == "rejected"],
                timeout=HANDLER_SLEEP + 10,
                what="the worker's late write to be refused",
            )
            assert [(e.token, e.highest_token) for e in refused] == [(first.token, newer.token)]
            assert f":{pid}:" in (refused[0].holder or "")
            run.leases.release(newer)
        finally:
            link.heal()

        # After the heal the worker takes a new epoch; every request ends with exactly one outcome.
        outcomes = wait_until(
            lambda: (
                (found := run.inventory.request_outcomes(list(KEYS))) and len(found) == len(KEYS) and found
            ),
            timeout=40,
            what="an outcome for every request",
        )
        assert {key: outcome.status for key, outcome in outcomes.items()} == dict.fromkeys(KEYS, "reserved")
        assert "lost_ownership" in [attempt.result for attempt in run.inventory.attempts(KEYS[0])]
        writes = [e for e in run.inventory.history(SKU) if e.kind == "write" and e.operation == "reserve"]
        assert sorted(e.idempotency_key or "" for e in writes) == sorted(KEYS)  # each applied once
        assert all(e.token > newer.token for e in writes)
        assert run.inventory.stock(SKU).reserved == 2
        assert run.inventory.invariant_violations() == []

    # Nothing of the host is left: its namespace and both ends of its veth pair are gone.
    assert made and not set(made) & set(netns.namespaces() + netns.links())
