"""PostgreSQL failover drills: a private primary and its streaming standby (testing.pg_cluster), fenced
reservations through the Inventory under real leases on the test Redis, the primary killed with SIGKILL
(its whole process group, as a host that dies), the standby promoted.

- Synchronous (the primary's synchronous_standby_names names the standby): every outcome the primary
  acknowledged is on the promoted server, with its idempotency record, its reservation and the stock row's
  fence; a holder whose lease a newer acknowledged token superseded is still refused there.
- Synchronous with the standby down: the primary acknowledges nothing; the write waits for the standby.
- Asynchronous, the standby behind: acknowledged outcomes are lost, each with its whole transaction (stock
  change, reservation, idempotency record), so the promoted server is an earlier, consistent database; a
  superseded holder's write is accepted there; a lost request sent again applies once.

docs/operations.md ("PostgreSQL failover and restore") says what each means for callers and operators.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from fencing import BackendUnavailable, Lease, LeaseManager, StaleToken
from fencing.lease import new_lease_id
from reservations import Inventory, schema, scope_of
from reservations.request_outcomes import RequestReply, RequestResult
from testing.harness import free_port, wait_until
from testing.pg_cluster import PgCluster, pg_cluster, pg_unavailable
from testing.stores import REDIS_URL

needs_cluster = pytest.mark.skipif(pg_unavailable() is not None, reason=str(pg_unavailable()))
# A commit that waits for a standby waits for good: the timeout fails a test in time for its finalizers.
pytestmark = pytest.mark.timeout(60)

SKUS = ("failover-a", "failover-b", "failover-c")
TTL = 5.0


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class Acknowledged:
    """What a caller was told: the request's outcome, under the token its write carried."""

    sku: str
    token: int
    result: RequestResult
    reservation_id: str


@dataclass
class Callers:
    """Reservations of one unit through the Inventory, each under a lease of its SKU; what the primary
    acknowledged (the call returned an outcome) kept by key."""

    inventory: Inventory
    leases: LeaseManager
    acknowledged: dict[str, Acknowledged] = field(default_factory=dict)
    unanswered: list[str] = field(default_factory=list)  # sent, and the database went away: unknown
    unexpected: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, sku: str, key: str) -> RequestReply | None:
        """One request under a new lease of its SKU; None when the database did not answer."""
        lease = self.leases.acquire(scope_of(sku), ttl=TTL, holder="drill", wait=TTL)
        try:
            return self.inventory.reserve_request(lease, sku, 1, key=key)
        except BackendUnavailable:
            with self.lock:
                self.unanswered.append(key)
            return None
        finally:
            self.leases.release(lease)

    def reserve(self, sku: str, key: str | None = None) -> bool:
        """One reservation that applies; False once the database no longer answers."""
        key = key or unique("k-")
        reply = self.send(sku, key)
        if reply is None:
            return False
        assert reply.outcome is not None and reply.outcome.reservation_id is not None, reply
        with self.lock:
            self.acknowledged[key] = Acknowledged(
                sku, reply.outcome.token or 0, reply.result, reply.outcome.reservation_id
            )
        return True

    def stream(self, stop: threading.Event, turn: int) -> None:
        """Reserve from each SKU in turn until the database goes away (or ``stop``)."""
        try:
            while not stop.is_set() and self.reserve(SKUS[turn % len(SKUS)]):
                turn += 1
        except BaseException as exc:  # for the test to fail on
            with self.lock:
                self.unexpected.append(exc)

    def count(self) -> int:
        with self.lock:
            return len(self.acknowledged)


@pytest.fixture
def leases(redis_prefix: str) -> Iterator[LeaseManager]:
    with LeaseManager.from_url(REDIS_URL, prefix=redis_prefix) as manager:
        yield manager


def stocked(cluster: PgCluster) -> Inventory:
    """The primary migrated, holding :data:`SKUS`."""
    url = cluster.primary.url()
    schema.upgrade(url)
    inventory = Inventory.from_url(url)
    for sku in SKUS:
        inventory.add_sku(sku, on_hand=10_000)
    return inventory


def superseded(leases: LeaseManager, sku: str) -> Lease:
    """A holder paused past its lease: it took a token, wrote nothing, and its lease ran out at the
    coordinator, so the next acquisition gets a newer token. Its write is still to come."""
    lease = leases.acquire(scope_of(sku), ttl=0.2, holder="paused")
    wait_until(lambda: leases.current(scope_of(sku)) is None, timeout=5, what="the paused lease to run out")
    return lease


def fail_over(cluster: PgCluster, inventory: Inventory) -> Inventory:
    """Kill the primary's host, promote the standby; the Inventory on the promoted server."""
    cluster.fail_over()
    inventory.close()
    return Inventory.from_url(cluster.standby.url())


def missing(promoted: Inventory, acknowledged: dict[str, Acknowledged]) -> list[str]:
    """The acknowledged keys whose outcome the promoted server does not hold as acknowledged."""
    return sorted(key for key, told in acknowledged.items() if promoted.request_outcome(key) != told.result)


def idempotency_keys(cluster: PgCluster, keys: list[str]) -> set[str]:
    rows = cluster.standby.query("SELECT key FROM idempotency_keys WHERE key = ANY(%s)", [keys])
    return {str(key) for (key,) in rows}


def test_a_write_to_a_server_that_refuses_connections_is_unavailable() -> None:
    """As a promotion goes on, the old address refuses connections: a one-statement write (checked out
    of the pool on its own path) says the database is unavailable, as a connection lost mid-statement
    does, so a worker retries it as an outage."""
    lease = Lease("sku:x", 7, new_lease_id(), "drill", TTL, time.monotonic())
    down = Inventory.from_url(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    with down, pytest.raises(BackendUnavailable, match="database unavailable"):
        down.reserve_request(lease, "x", 1, key=unique("k-"))


@needs_cluster
def test_a_promoted_synchronous_standby_keeps_every_acknowledged_outcome(leases: LeaseManager) -> None:
    """Three callers reserve while the primary is killed; whatever it acknowledged is on the promoted
    standby, and the fence there still refuses the holder a newer acknowledged token superseded."""
    with pg_cluster(synchronous=True) as cluster:
        inventory = stocked(cluster)
        callers = Callers(inventory, leases)
        paused = superseded(leases, SKUS[0])
        stop = threading.Event()
        threads = [threading.Thread(target=callers.stream, args=(stop, turn)) for turn in range(3)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: callers.count() >= 60, timeout=20, what="60 acknowledged reservations")
            cluster.primary.kill()  # mid-stream: each caller is inside a call or about to make one
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
        assert callers.unexpected == []
        acknowledged = dict(callers.acknowledged)
        promoted = fail_over(cluster, inventory)
        try:
            assert missing(promoted, acknowledged) == []
            assert idempotency_keys(cluster, list(acknowledged)) >= set(acknowledged)
            for key, told in acknowledged.items():
                held = promoted.reservation(told.reservation_id)
                assert (held.sku, held.quantity, held.token) == (told.sku, 1, told.token), key
            for sku in SKUS:
                tokens = [told.token for told in acknowledged.values() if told.sku == sku]
                level = promoted.stock(sku)
                assert level.fence_token >= max(tokens)
                # A write that committed as the primary died but was never answered may be there too.
                assert len(tokens) <= level.reserved <= len(tokens) + len(callers.unanswered)
            assert promoted.invariant_violations() == []

            with pytest.raises(StaleToken) as refused:
                promoted.reserve_request(paused, SKUS[0], 1, key=unique("late-"))
            assert refused.value.highest > paused.token
            # The lease store, untouched by the failover, goes on with newer tokens: they write.
            callers.inventory = promoted
            assert callers.reserve(SKUS[0])
        finally:
            promoted.close()


@needs_cluster
def test_without_its_standby_a_synchronous_primary_acknowledges_nothing(leases: LeaseManager) -> None:
    """The price of the guarantee: with the synchronous standby down a commit waits for it (no answer,
    no outcome to lose); a failover then loses nothing acknowledged, and the request sent again applies."""
    with pg_cluster(synchronous=True) as cluster:
        inventory = stocked(cluster)
        callers = Callers(inventory, leases)
        for turn in range(6):
            assert callers.reserve(SKUS[turn % len(SKUS)])
        cluster.standby.stop()
        waiting = unique("waits-")
        call = threading.Thread(target=callers.reserve, args=(SKUS[0], waiting))
        call.start()
        try:
            wait_until(
                lambda: cluster.primary.query("SELECT 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep'"),
                timeout=10,
                what="the reservation's commit to wait for the standby",
            )
            assert waiting not in callers.acknowledged
        finally:
            cluster.primary.kill()
            call.join(timeout=30)
        assert not call.is_alive() and callers.unanswered == [waiting]
        promoted = fail_over(cluster, inventory)
        try:
            assert missing(promoted, callers.acknowledged) == []
            assert promoted.request_outcome(waiting) is None
            reserved = promoted.stock(SKUS[0]).reserved
            callers.inventory = promoted
            assert callers.reserve(SKUS[0], waiting)
            assert promoted.stock(SKUS[0]).reserved == reserved + 1
        finally:
            promoted.close()


@needs_cluster
def test_an_asynchronous_standby_promoted_behind_loses_acknowledged_outcomes(leases: LeaseManager) -> None:
    """The contrast, made certain by stopping the standby rather than hoping it lags: the writes the
    primary acknowledged after it are gone from the promoted server, each with its whole transaction, so
    the database is an earlier consistent one. A holder that newer tokens had superseded writes there;
    each lost request, sent again as the relay would, applies once."""
    with pg_cluster(synchronous=False) as cluster:
        inventory = stocked(cluster)
        callers = Callers(inventory, leases)
        for turn in range(3):
            assert callers.reserve(SKUS[turn % len(SKUS)])
        # Every write so far replayed on the standby before it stops.
        wait_until(
            lambda: cluster.standby.query(
                "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn",
                [cluster.primary.query("SELECT pg_current_wal_lsn()::text")[0][0]],
            )[0][0],
            timeout=10,
            what="the standby to replay the primary's WAL",
        )
        kept = dict(callers.acknowledged)
        fence = inventory.stock(SKUS[0]).fence_token
        paused = superseded(leases, SKUS[0])
        cluster.standby.stop()
        for _ in range(4):
            assert callers.reserve(SKUS[0])
        lost = sorted(set(callers.acknowledged) - set(kept))
        promoted = fail_over(cluster, inventory)
        try:
            assert missing(promoted, callers.acknowledged) == lost
            assert idempotency_keys(cluster, lost) == set()
            assert [promoted.request_outcome(key) for key in lost] == [None] * len(lost)
            level = promoted.stock(SKUS[0])
            assert (level.fence_token, level.reserved) == (fence, 1)
            assert promoted.invariant_violations() == []

            # The old primary had refused this holder (newer tokens wrote); its database is gone.
            late = promoted.reserve_request(paused, SKUS[0], 1, key=unique("late-"))
            assert late.result.status == "reserved"

            callers.inventory = promoted
            for key in lost:
                assert callers.reserve(SKUS[0], key)
                copy = callers.send(SKUS[0], key)  # a second copy answers the first's outcome
                assert copy is not None and copy.result == callers.acknowledged[key].result
            assert promoted.stock(SKUS[0]).reserved == 1 + 1 + len(lost)
            assert promoted.invariant_violations() == []
        finally:
            promoted.close()
