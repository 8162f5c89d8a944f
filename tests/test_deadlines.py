"""Request deadlines: a request taken up after the deadline its sender gave ends ``expired``, touching no
stock and taking no lease.

The decision (tasks.messages.late) is tested with a clock of our own, without services; the deadline's
validation in the client too. Then the header on the wire, on a private Redis no worker reads: set by the
client and the command line, the same on a copy the client publishes again, never among the arguments.
Then a real ``celery worker`` on SQLite and on PostgreSQL: a request past its deadline ends expired with
the stock, the reservations and the SKU's token history as they were; one within its deadline is carried
out; a key that ended expired stays expired; a request decided before its deadline passed (its outcome
written, or only its effect) still answers that decision; a retry keeps its request's deadline.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from fencing import LeaseManager
from reservations import InvalidRequest, Inventory, schema
from reservations import validation as valid
from reservations.request_outcomes import request_id
from tasks import ReservationClient, Settings, create_app
from tasks.messages import DEADLINE, Late, deadline_header, late
from tasks.relay import relay_of
from testing.harness import wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.support import queued_messages, run
from testing.workers import Cluster, one_worker

OUTCOME_TIMEOUT = 20.0
NOW = 1_800_000_000.0


def clock(at: float) -> Any:
    return lambda: at


# -- the decision, with a clock of our own -----------------------------------------------------------------


def test_a_request_past_its_deadline_is_late_by_the_milliseconds_since() -> None:
    found = late(NOW - 12.34567, clock=clock(NOW))
    assert found is not None
    assert found.detail() == {"deadline": NOW - 12.34567, "late_by": 12.346, "attempts": 0}
    assert found.detail(3)["attempts"] == 3
    assert found == Late(NOW - 12.34567, found.late_by)


@pytest.mark.parametrize("deadline", [None, NOW, NOW + 0.001, NOW + 3600])
def test_no_deadline_or_one_not_passed_is_not_late(deadline: float | None) -> None:
    assert late(deadline, clock=clock(NOW)) is None


def test_a_whole_number_deadline_is_taken_as_seconds() -> None:
    found = late(int(NOW) - 5, clock=clock(NOW))
    assert found is not None and found.detail() == {"deadline": NOW - 5, "late_by": 5.0, "attempts": 0}


@pytest.mark.parametrize(
    "malformed", ["1800000000", True, math.nan, math.inf, -5.0, 0, NOW * 1000, [NOW], {"at": NOW}]
)
def test_a_malformed_deadline_is_ignored_with_one_warning(
    malformed: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tasks.messages"):
        assert late(malformed, clock=clock(NOW * 2000), key="order-1") is None
    (warned,) = caplog.records
    assert warned.levelno == logging.WARNING
    assert DEADLINE in warned.getMessage() and "order-1" in warned.getMessage()


def test_the_header_names_the_checked_deadline() -> None:
    assert deadline_header(None) == {}
    assert deadline_header(int(NOW)) == {DEADLINE: NOW}
    assert isinstance(deadline_header(int(NOW))[DEADLINE], float)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "soon", NOW * 1000])
def test_a_deadline_is_a_finite_number_of_seconds_since_the_epoch(bad: object) -> None:
    with pytest.raises(InvalidRequest) as refused:
        valid.deadline(bad)
    assert refused.value.field == "deadline"
    with pytest.raises(InvalidRequest):
        deadline_header(bad)  # type: ignore[arg-type]


@pytest.fixture
def offline_client() -> Iterator[ReservationClient]:
    """A client whose broker is nowhere: a refused deadline must never reach publishing."""
    settings = Settings(broker_url="redis://127.0.0.1:1/0", result_backend="redis://127.0.0.1:1/1")
    client = ReservationClient(create_app(settings))
    yield client
    client.close()
    client.app.close()


async def test_every_enqueue_refuses_a_bad_deadline_before_publishing(
    offline_client: ReservationClient,
) -> None:
    client, key, bad = offline_client, "refused-1", math.nan
    sends: list[Any] = [
        lambda: client.enqueue_reservation_sync("W", 1, idempotency_key=key, deadline=bad),
        lambda: client.enqueue_count_sync("W", 1, idempotency_key=key, deadline=bad),
        lambda: client.enqueue_replenish_sync("W", par=1, idempotency_key=key, deadline=bad),
        lambda: client.enqueue_sync("restock", idempotency_key=key, deadline=bad, sku="W", quantity=1),
    ]
    for send in sends:
        with pytest.raises(InvalidRequest) as refused:
            send()
        assert refused.value.field == "deadline"
    waits: list[Any] = [
        lambda: client.enqueue_reservation("W", 1, idempotency_key=key, deadline=-1),
        lambda: client.enqueue_order([("W", 1)], idempotency_key=key, deadline=-1),
        lambda: client.enqueue_count("W", 1, idempotency_key=key, deadline=-1),
        lambda: client.enqueue_replenish("W", par=1, idempotency_key=key, deadline=-1),
        lambda: client.enqueue("restock", idempotency_key=key, deadline=-1, sku="W", quantity=1),
    ]
    for wait in waits:
        with pytest.raises(InvalidRequest) as refused:
            await wait()
        assert refused.value.field == "deadline"


# -- the header on the wire, no worker reading -------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.mark.parametrize("shell", ["async", "sync"])
async def test_the_deadline_is_a_header_a_copy_published_again_keeps(
    server: RedisServer, tmp_path: Path, shell: str
) -> None:
    """The request is recorded with its deadline; its message is lost (the queue is emptied) and the
    relay publishes it again: both messages carry the deadline as a header, never as an argument."""
    db = 8 if shell == "async" else 9
    settings = Settings(
        broker_url=server.url(db),
        result_backend=server.url(db),
        database_url=f"sqlite:///{tmp_path / 'inventory.sqlite3'}",
        republish_after=0.05,
    )
    from reservations import schema

    schema.upgrade(settings.database_url)
    client = ReservationClient(create_app(settings))
    key, deadline = f"wire-{shell}", time.time() + 600
    try:
        if shell == "async":
            await client.enqueue_reservation("W", 2, idempotency_key=key, deadline=deadline)
        else:
            client.enqueue_reservation_sync("W", 2, idempotency_key=key, deadline=deadline)
    finally:
        await client.aclose()
        client.app.close()
    with redis.Redis.from_url(server.url(db)) as broker:
        messages = queued_messages(broker)
        broker.delete("celery")
        relay = relay_of(settings)
        try:
            wait_until(lambda: relay.run_once().counts["republish"] == 1, timeout=10, what="the copy")
        finally:
            relay.close()
        messages += queued_messages(broker)
    assert len(messages) == 2  # the first and the copy
    assert {m["headers"]["id"] for m in messages} == {request_id(key)}
    # The record keeps the deadline to the millisecond.
    assert [m["headers"][DEADLINE] for m in messages] == [deadline, pytest.approx(deadline, abs=0.001)]
    # Not an argument: the request's fingerprint does not depend on it.
    assert all("deadline" not in m["kwargs"] and DEADLINE not in m["kwargs"] for m in messages)


def test_the_command_line_sends_its_deadline_as_seconds_from_now(server: RedisServer, tmp_path: Path) -> None:
    env = {
        "RESERVATIONS_BROKER_URL": server.url(10),
        "RESERVATIONS_DATABASE_URL": f"sqlite:///{tmp_path / 'inventory.sqlite3'}",
    }
    schema.upgrade(env["RESERVATIONS_DATABASE_URL"])
    before = time.time()
    done = run("reserve", "W", "2", "--key", "cli-deadline", "--deadline", "90", env=env)
    assert done.returncode == 0, done.stderr
    without = run("restock", "W", "2", "--key", "cli-none", env=env)
    assert without.returncode == 0, without.stderr
    with redis.Redis.from_url(server.url(10)) as broker:
        sent, unbounded = queued_messages(broker)
    assert before + 90 <= sent["headers"][DEADLINE] <= time.time() + 90
    assert DEADLINE not in unbounded["headers"]
    refused = run("reserve", "W", "2", "--key", "cli-bad", "--deadline", "0", env=env)
    assert refused.returncode == 2 and "--deadline must be between 0.1" in refused.stderr


# -- a real worker, on SQLite and PostgreSQL -------------------------------------------------------------


@dataclass(frozen=True)
class Running:
    cluster: Cluster
    client: ReservationClient
    inventory: Inventory
    leases: LeaseManager

    def answers(self, key: str) -> list[str]:
        """The statuses the worker answered for ``key``'s request, one per message it ran, in order."""
        line = re.compile(
            rf"Task reservations\.\w+\[{request_id(key)}\] succeeded in \S+ \{{'status': '(\w+)'"
        )
        return line.findall(self.cluster.workers[0].log())

    def answered(self, key: str, count: int) -> list[str]:
        """Wait until the worker answered ``count`` messages of ``key``; their statuses."""

        def enough() -> list[str] | None:
            found = self.answers(key)
            return found if len(found) >= count else None

        return wait_until(enough, timeout=OUTCOME_TIMEOUT, what=f"{count} answers for {key}")

    def untouched(self, sku: str, on_hand: int, key: str, *, leased: bool = False) -> None:
        """SKU's stock as added, no reservation or write of ``key``, and (unless ``leased``) no lease ever
        taken of it."""
        level = self.inventory.stock(sku)
        assert (level.on_hand, level.reserved) == (on_hand, 0)
        assert [r for r in self.inventory.reservations(sku, limit=100) if r.idempotency_key == key] == []
        assert [(h.kind, h.operation) for h in self.inventory.history(sku)] == [("write", "create")]
        if not leased:
            assert self.leases.history(valid.scope_of(sku)) == []


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def running(
    request: pytest.FixtureRequest,
    server: RedisServer,
    migrated_sqlite: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    """One worker on the inventory database (its SQL leases there too), on the private Redis."""
    kind: str = request.param
    workdir = tmp_path_factory.mktemp(f"deadlines_{kind}")
    with one_worker(kind, workdir, server.url, migrated_sqlite, prefix="late") as (started, url):
        client = started.client()
        inventory = Inventory.from_url(url)
        leases = LeaseManager.from_url(started.lease_url)
        try:
            yield Running(started, client, inventory, leases)
        finally:
            leases.close()
            inventory.close()
            client.close()
            client.app.close()


@pytest.mark.slow
def test_a_request_past_its_deadline_ends_expired_touching_nothing(running: Running) -> None:
    inv, sku, key = running.inventory, "LATE-1", "late-1"
    inv.add_sku(sku, on_hand=10)
    deadline = time.time() - 60
    handle = running.client.enqueue_reservation_sync(sku, 2, idempotency_key=key, deadline=deadline)
    ended = handle.result_sync(timeout=OUTCOME_TIMEOUT)
    assert ended.status == "expired"
    assert ended.detail["deadline"] == deadline and ended.detail["late_by"] >= 60
    assert ended.epochs == 0
    running.untouched(sku, 10, key)
    # The outcome is visible before the worker records its attempt: wait for its answer first.
    assert running.answered(key, 1) == ["expired"]
    assert [a.result for a in inv.attempts(key)] == ["expired"]

    # The same request again, past its deadline, then without one: still expired, still nothing done.
    running.client.enqueue_reservation_sync(sku, 2, idempotency_key=key, deadline=time.time() - 1)
    assert running.answered(key, 2) == ["expired", "expired"]
    running.untouched(sku, 10, key)
    assert [a.result for a in inv.attempts(key)] == ["expired", "expired"]
    # Without a deadline the copy is carried out as any request is (under the SKU's lease), and its
    # key, closed by the expiry, answers with the stored outcome.
    again = running.client.enqueue_reservation_sync(sku, 2, idempotency_key=key)
    assert running.answered(key, 3) == ["expired"] * 3
    assert again.result_sync(timeout=OUTCOME_TIMEOUT) == ended
    running.untouched(sku, 10, key, leased=True)
    assert inv.invariant_violations() == []


@pytest.mark.slow
def test_a_request_within_its_deadline_is_carried_out(running: Running) -> None:
    inv, sku, key = running.inventory, "LATE-2", "late-2"
    inv.add_sku(sku, on_hand=10)
    handle = running.client.enqueue_reservation_sync(sku, 2, idempotency_key=key, deadline=time.time() + 300)
    done = handle.result_sync(timeout=OUTCOME_TIMEOUT)
    assert done.status == "reserved"
    level = inv.stock(sku)
    assert (level.on_hand, level.reserved) == (10, 2)
    assert [a.result for a in inv.attempts(key)] == ["applied"]


@pytest.mark.slow
def test_a_reserved_request_redelivered_after_its_deadline_answers_reserved(running: Running) -> None:
    inv, sku, key = running.inventory, "LATE-3", "late-3"
    inv.add_sku(sku, on_hand=10)
    first = running.client.enqueue_reservation_sync(sku, 2, idempotency_key=key)
    reserved = first.result_sync(timeout=OUTCOME_TIMEOUT)
    assert reserved.status == "reserved"
    copy = running.client.enqueue_reservation_sync(sku, 2, idempotency_key=key, deadline=time.time() - 30)
    assert running.answered(key, 2) == ["reserved", "reserved"]
    assert copy.result_sync(timeout=OUTCOME_TIMEOUT) == reserved
    level = inv.stock(sku)
    assert (level.on_hand, level.reserved) == (10, 2)
    assert [a.result for a in inv.attempts(key)] == ["applied"]  # the late copy recorded no expiry


@pytest.mark.slow
def test_a_request_applied_without_its_outcome_is_replayed_not_expired(running: Running) -> None:
    """A worker applied the request and stopped before writing its outcome; the copy that comes back
    after the deadline finds the key decided, so it carries the request out: a replay of that effect."""
    inv, sku, key = running.inventory, "LATE-4", "late-4"
    inv.add_sku(sku, on_hand=10)
    with running.leases.hold(valid.scope_of(sku), ttl=30) as lease:
        applied = inv.restock(lease, sku, 5, key=key)
    handle = running.client.enqueue_sync(
        "restock", idempotency_key=key, deadline=time.time() - 30, sku=sku, quantity=5
    )
    replayed = handle.result_sync(timeout=OUTCOME_TIMEOUT)
    assert replayed.status == "restocked", running.cluster.tails()
    assert inv.stock(sku).on_hand == 15  # once
    assert [a.result for a in inv.attempts(key)] == ["replayed"]
    assert replayed.detail["token"] == applied.token


@pytest.mark.slow
def test_a_retry_keeps_its_request_s_deadline(running: Running) -> None:
    """The SKU's lease is held here: the restock finds it busy and is retried by Celery, every retry
    within a second, until one is taken up past the deadline, which ends it expired. Without the
    deadline the retry would restock once the lease ran out (it is never released here)."""
    inv, sku, key = running.inventory, "LATE-5", "late-5"
    inv.add_sku(sku, on_hand=10)
    held = running.leases.acquire(valid.scope_of(sku), ttl=4.0, holder="test")
    deadline = time.time() + 1.0
    handle = running.client.enqueue_sync(
        "restock", idempotency_key=key, deadline=deadline, sku=sku, quantity=5
    )
    ended = handle.result_sync(timeout=OUTCOME_TIMEOUT)
    assert ended.status == "expired", running.cluster.tails()
    assert ended.detail["deadline"] == deadline
    assert running.answered(key, 1) == ["expired"]  # the attempts before were retries, not answers
    assert re.search(rf"Task reservations\.restock\[{handle.task_id}\] retry", running.cluster.tails(200))
    assert inv.stock(sku).on_hand == 10
    assert [a.result for a in inv.attempts(key)] == ["expired"]
    current = running.leases.current(valid.scope_of(sku))
    assert current is not None and current.token == held.token  # still the test's: never taken over
    running.leases.release(held)


@pytest.mark.slow
def test_the_command_line_exits_1_for_an_expired_outcome(running: Running) -> None:
    inv, sku, key = running.inventory, "LATE-6", "late-6"
    inv.add_sku(sku, on_hand=10)
    handle = running.client.enqueue_reservation_sync(sku, 1, idempotency_key=key, deadline=time.time() - 5)
    assert handle.result_sync(timeout=OUTCOME_TIMEOUT).status == "expired"
    done = run("reserve", sku, "1", "--key", key, "--wait", env=running.cluster.settings)
    assert done.returncode == 1, done.stderr
    assert "outcome: expired" in done.stdout
    assert inv.stock(sku).reserved == 0
