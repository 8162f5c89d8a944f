"""Through a real PgBouncer in transaction pooling mode (``RESERVATIONS_DATABASE_POOLING=transaction``):
the migrations, the one-statement reserve and the other inventory operations with SQL leases, many times
over from several threads (psycopg prepares a statement at its 6th execution: that must not happen behind
the pooler), the asyncio outcome watcher, and a worker frozen inside its transaction, whose row lock the
database frees within the bound docs/operations.md states although the worker cannot set it per
connection. A worker refuses to start behind the pooler when the database or role leaves that bound out.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from fencing import BackendUnavailable, LeaseBusy, LeaseManager
from fencing.engines import make_engine, transaction_bounds
from reservations import AsyncInventory, Inventory, schema, scope_of
from tasks.outcomes import OutcomeWatcher
from testing import pgbouncer as bouncer
from testing.celery_processes import worker_env
from testing.harness import wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.support import refused_worker, run
from testing.workers import cluster

pytestmark = pytest.mark.skipif(not bouncer.available(), reason=f"no {bouncer.PGBOUNCER}")

# The lease ttl of the frozen-worker test, and the bounds the role gives every server session of it.
TTL = 2.0
BOUNDED = {
    "idle_in_transaction_session_timeout": f"'{TTL * 1000:g}ms'",
    "lock_timeout": f"'{TTL * 1000:g}ms'",
}
# More executions of one statement than psycopg runs before preparing it (its prepare_threshold, 5).
ROUNDS = 12


@dataclass(frozen=True)
class Pooled:
    """A role of its own reaching its schema through a PgBouncer of its own."""

    role: str
    pooler: bouncer.PgBouncer

    @property
    def url(self) -> str:
        return self.pooler.url(self.role)

    def env(self, **more: str) -> dict[str, str]:
        return {"RESERVATIONS_DATABASE_URL": self.url, "RESERVATIONS_DATABASE_POOLING": "transaction", **more}


@pytest.fixture
def pooled() -> Iterator[Pooled]:
    """An empty schema behind the pooler; its role bounds transactions by :data:`TTL`."""
    with bouncer.pooled_role(BOUNDED) as role, bouncer.pgbouncer([role]) as pooler:
        yield Pooled(role, pooler)


@pytest.fixture
def migrated(pooled: Pooled) -> Pooled:
    schema.upgrade(pooled.url)
    return pooled


def test_migrations_run_through_the_pooler(pooled: Pooled) -> None:
    for _ in range(2):  # the second run finds the newest revision and changes nothing
        upgraded = run("db", "upgrade", env=pooled.env())
        assert upgraded.returncode == 0, upgraded.stderr
    current = run("db", "current", env=pooled.env())
    assert current.returncode == 0, current.stderr
    assert schema.current(pooled.url) == schema.head()


def _operations(inventory: Inventory, leases: LeaseManager, sku: str) -> list[str]:
    """Every kind of write on ``sku``, :data:`ROUNDS` times over, each in its own transaction or (the
    reserve) its one statement; the statuses of the requests recorded along the way."""
    told = []
    lease = leases.acquire(scope_of(sku), ttl=30)
    try:
        for n in range(ROUNDS):
            held = inventory.reserve(lease, sku, 2, key=f"{sku}-r{n}")
            inventory.confirm(lease, held.reservation_ids[0], key=f"{sku}-c{n}")
            freed = inventory.reserve(lease, sku, 1, key=f"{sku}-f{n}")
            inventory.release(lease, freed.reservation_ids[0], key=f"{sku}-x{n}")
            inventory.restock(lease, sku, 2, key=f"{sku}-s{n}")
            reply = inventory.reserve_request(lease, sku, 1, key=f"{sku}-q{n}")
            told.append(reply.result.status)
    finally:
        leases.release(lease)
    return told


def _operations_at_once(inventory: Inventory, leases: LeaseManager, prefix: str = "P") -> list[list[str]]:
    """:func:`_operations` on four SKUs from four threads at once: they keep several server sessions
    busy, so each thread's transactions run in turn in different ones."""
    skus = [f"{prefix}{n}" for n in range(4)]
    for sku in skus:
        inventory.add_sku(sku, on_hand=100)
    with ThreadPoolExecutor(max_workers=len(skus)) as pool:
        return list(pool.map(lambda sku: _operations(inventory, leases, sku), skus))


def test_inventory_operations_run_through_the_pooler(migrated: Pooled) -> None:
    with (
        Inventory.from_url(migrated.url, pooling="transaction", pool_size=4) as inventory,
        LeaseManager.from_url(migrated.url, pooling="transaction", pool_size=4) as leases,
    ):
        assert _operations_at_once(inventory, leases) == [["reserved"] * ROUNDS] * 4
        for level in inventory.all_stock():
            # Per round: 2 confirmed (shipped), 1 reserved and released, 2 restocked, 1 held.
            assert (level.on_hand, level.reserved) == (100, ROUNDS), level
            outcomes = inventory.request_outcomes([f"{level.sku}-q{n}" for n in range(ROUNDS)])
            assert len(outcomes) == ROUNDS
        assert inventory.invariant_violations() == []


def test_a_client_that_prepares_statements_fails_behind_the_pooler(migrated: Pooled) -> None:
    """The control of the test above: psycopg left to prepare (its default) fails through this pooler."""
    # psycopg names its statements _pg3_0, _pg3_1, ... per connection in the order it prepares them: clients
    # that happen to prepare the same statements in the same order find each other's under the right
    # name, so one round can pass by that chance. A few fresh rounds, each with clients of its own.
    raised: BaseException | None = None
    for attempt in range(5):
        with (
            Inventory.from_url(migrated.url, pool_size=4) as inventory,
            LeaseManager.from_url(migrated.url, pool_size=4) as leases,
        ):
            try:
                _operations_at_once(inventory, leases, prefix=f"P{attempt}-")
            except (sa.exc.DBAPIError, BackendUnavailable) as exc:
                raised = exc
        if raised is not None:
            break
    assert raised is not None, "five rounds of clients that prepare all passed through the pooler"
    # The driver's error surfaces as is, or (when it came while the lease's transaction was being
    # classified as an outage) as the backend's unavailability caused by it: either way it is this one.
    chain: list[BaseException] = []
    error: BaseException | None = raised
    while error is not None and len(chain) < 10:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any("prepared statement" in str(e) for e in chain), chain


def test_the_async_outcome_watcher_reads_through_the_pooler(migrated: Pooled) -> None:
    keys = [f"watched-{n}" for n in range(ROUNDS)]

    async def watch() -> list[str]:
        inventory = AsyncInventory.from_url(migrated.url, pooling="transaction")
        try:
            watcher = OutcomeWatcher(inventory.request_outcomes)
            waits = [asyncio.ensure_future(watcher.wait(key, 20.0)) for key in keys]
            # One outcome at a time, the next once the watcher has seen the last: a look of its own for
            # each, the same statement every time.
            for key, waiting in zip(keys, waits, strict=True):
                await inventory.record_outcome(key, "reserve", "reserved", {"quantity": 1})
                await asyncio.wait_for(asyncio.shield(waiting), 20.0)
            return [result.status for result in await asyncio.gather(*waits)]
        finally:
            await inventory.close()

    assert asyncio.run(watch()) == ["reserved"] * len(keys)


def test_a_worker_refuses_a_pooler_whose_database_leaves_transactions_unbounded(tmp_path: Path) -> None:
    with bouncer.pooled_role() as role, bouncer.pgbouncer([role]) as pooler:
        url = pooler.url(role)
        schema.upgrade(url)
        engine = make_engine(url, pooling="transaction")
        try:
            assert transaction_bounds(engine).beyond(TTL) == [
                "idle_in_transaction_session_timeout=0 (none)",
                "lock_timeout=0 (none)",
            ]
        finally:
            engine.dispose()
        env = {
            "RESERVATIONS_DATABASE_URL": url,
            "RESERVATIONS_DATABASE_POOLING": "transaction",
            "RESERVATIONS_LEASE_URL": f"sqlite:///{tmp_path / 'leases.sqlite3'}",
            "RESERVATIONS_LEASE_TTL": f"{TTL:g}",
            "RESERVATIONS_VISIBILITY_TIMEOUT": "60",
        }
        refused = refused_worker(worker_env(env))
    assert refused.returncode == 2, refused.stderr
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("reservations:")]
    assert "transaction pooler" in line and "idle_in_transaction_session_timeout=0 (none)" in line, line
    # A role setting changed now reaches only new server sessions: the line says how to renew the open ones.
    assert "open server sessions keep the old values until RECONNECT" in line, line


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


def test_a_worker_frozen_in_its_transaction_holds_its_sku_for_about_a_ttl(
    migrated: Pooled, server: RedisServer, tmp_path: Path
) -> None:
    env = migrated.env(
        RESERVATIONS_BROKER_URL=server.url(0),
        RESERVATIONS_RESULT_BACKEND=server.url(1),
        RESERVATIONS_LEASE_URL=server.url(2),
        RESERVATIONS_LEASE_TTL=f"{TTL:g}",
        RESERVATIONS_VISIBILITY_TIMEOUT="60",
        RESERVATIONS_BATCHING="0",
    )
    with (
        cluster(tmp_path, env, count=1, failpoint_spec="in_write=stop,once") as running,
        Inventory.from_url(migrated.url, pooling="transaction") as inventory,
        LeaseManager.from_url(server.url(2)) as leases,
        ThreadPoolExecutor(max_workers=1) as writer,
    ):
        client = running.client()
        stopped = None
        try:
            inventory.add_sku("FROZEN", on_hand=10)
            running.arm("in_write")
            # The restock locks the stock row, then stops (SIGSTOP) just before its fenced UPDATE: inside
            # its open transaction, its lease no longer renewed.
            frozen = client.enqueue_sync(
                "restock", idempotency_key="frozen-restock", sku="FROZEN", quantity=5
            )
            _, stopped = wait_until(
                running.worker_with_stopped_child, timeout=30, what="the worker to freeze"
            )
            froze = time.monotonic()

            def take() -> object:
                try:
                    return leases.acquire(scope_of("FROZEN"), ttl=30, holder="next-holder")
                except LeaseBusy:
                    return None

            lease = wait_until(take, timeout=3 * TTL, what="the frozen holder's lease to run out")
            # The next holder's write waits for the row lock until the database ends the frozen
            # transaction; it must not wait for the end of the pause. Bounded here by a deadline of our
            # own, so that a lock held for good fails the test instead of hanging it.
            written = writer.submit(inventory.restock, lease, "FROZEN", 1, key="next-holder-restock")
            bound = 2 * TTL + 1.0  # docs/operations.md: about one ttl after the freeze, at most two
            outcome = written.result(timeout=bound + 5)
            waited = time.monotonic() - froze
            print(f"\nnext holder wrote {waited:.2f}s after the holder froze (lease ttl {TTL:g}s)")
            assert outcome.operation == "restock" and not outcome.replayed
            assert waited < bound, (waited, running.tails())
            leases.release(lease)
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
        # The resumed holder's transaction is gone; its request goes round again and ends once.
        late = frozen.result_sync(timeout=30)
        assert late.status == "restocked", late
        level = inventory.stock("FROZEN")
        assert level.on_hand == 10 + 1 + 5
        assert inventory.invariant_violations() == []
        client.close()
        client.app.close()
