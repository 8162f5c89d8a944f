"""The relay: nothing accepted vanishes.

Its decision is checked without services (a record and what the broker carries in, an action out). Its
passes run in this process against a private Redis broker and the inventory database (SQLite and
PostgreSQL): a message still queued is left alone however long its request waits; one the broker lost is
published again under the same task id and arguments; one lost every time ends dead-lettered at the
publication cap; one past its deadline ends expired; a backlog gets no copies. Then real workers: a
message taken from the queue and never acknowledged (a worker killed between the two), and a broker
restarted empty with requests queued, each still end in one outcome, and copies are applied once.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from fencing import LeaseManager
from reservations import Inventory
from reservations.acceptance import Accepted, Due, accepted
from reservations.models import accepted_requests
from reservations.request_outcomes import RequestResult, request_id
from reservations.validation import scope_of
from tasks import ReservationClient, Settings, create_app
from tasks.messages import CURRENT_FORMAT, ENQUEUED_AT
from tasks.producer import Producer, request_of
from tasks.relay import MOST_SPACING, SECOND_LOOK, Action, Relay, decide, ending, relay_of, spacing
from testing.harness import wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.support import queued_messages
from testing.support import run as cli
from testing.workers import cluster, migrated_database

NOW = 1_800_000_000.0


def due(
    *,
    ended: bool = False,
    queued: bool = False,
    deadline: float | None = None,
    publishes: int = 1,
    arguments: dict[str, Any] | None = None,
) -> Due:
    record = Accepted(
        key="k",
        operation="reserve",
        fingerprint="f",
        at=NOW - 60,
        deadline=deadline,
        request_type="reserve",
        arguments={"sku": "W", "quantity": 1} if arguments is None else arguments,
        task_id="t",
        message_format=CURRENT_FORMAT,
        publishes=publishes,
    )
    return Due(record, ended=ended, queued=queued)


# -- the decision, without services ---------------------------------------------------------------------


def test_a_request_with_its_outcome_is_closed_whatever_else_holds() -> None:
    assert decide(due(ended=True, deadline=NOW - 1, publishes=99), NOW, set(), 6) == Action.CLOSE


def test_a_request_queued_for_its_lease_holder_waits_even_past_its_deadline() -> None:
    # The database carries it to the holder, who serves it without a second look at its deadline.
    assert decide(due(queued=True, deadline=NOW - 1), NOW, set(), 6) == Action.WAIT


def test_a_request_past_its_deadline_expires_even_while_the_broker_still_carries_it() -> None:
    assert decide(due(deadline=NOW), NOW, {"t"}, 6) == Action.EXPIRE
    assert decide(due(deadline=NOW + 1), NOW, {"t"}, 6) == Action.WAIT


def test_a_message_the_broker_carries_is_never_copied_however_often_it_was_published() -> None:
    assert decide(due(publishes=1), NOW, {"t"}, 6) == Action.WAIT
    assert decide(due(publishes=6), NOW, {"t"}, 6) == Action.WAIT


def test_a_lost_message_is_published_again_up_to_the_cap_then_dead_lettered() -> None:
    assert [decide(due(publishes=n), NOW, set(), 6) for n in range(1, 8)] == [
        *[Action.REPUBLISH] * 5,
        Action.DEAD_LETTER,
        Action.DEAD_LETTER,
    ]
    # Where the broker cannot be looked into, the same: a copy until the cap.
    assert decide(due(publishes=3), NOW, None, 6) == Action.REPUBLISH


def test_a_message_between_the_queue_and_a_workers_record_is_looked_for_again(
    tmp_path: Path, migrated_sqlite: Path
) -> None:
    """A worker takes a message off the queue, then records it as held: for that moment the broker
    carries it in neither place, and a look then misses it. A request a look misses is looked for once
    more, so the relay leaves it alone when the second look finds it (and copies it when none does)."""
    with migrated_database("sqlite", tmp_path, migrated_sqlite) as url, Inventory.from_url(url) as inventory:
        settings = Settings.from_env(
            {"RESERVATIONS_DATABASE_URL": url, "RESERVATIONS_BROKER_URL": "redis://127.0.0.1:9/0"}
        )
        taken = request_of("reserve", "in-transit", {"sku": "W", "quantity": 1, "hold_for": None})
        inventory.record_accepted([taken], 0)
        looks: list[set[str]] = [set(), {taken.task_id}]  # missed, then found in the worker's record
        paused: list[float] = []
        relay = Relay(
            inventory,
            Producer.configured(settings),
            after=60,
            max_publishes=6,
            carried=lambda: looks.pop(0),
            pause=paused.append,
        )
        try:
            done = relay.run_once()
        finally:
            relay.producer.close()
    assert (done.counts[Action.WAIT], done.counts[Action.REPUBLISH], looks, paused) == (
        1,
        0,
        [],
        [SECOND_LOOK],
    )


def test_copies_are_spaced_out_only_where_the_broker_cannot_be_looked_into() -> None:
    assert spacing(2.0, spaced=False) == [2.0]
    steps = spacing(2.0, spaced=True)
    assert steps[:4] == [2.0, 4.0, 8.0, 16.0] and steps[-1] == 2.0 * MOST_SPACING


def test_the_relays_endings_say_what_happened_and_carry_the_request() -> None:
    status, detail = ending(Action.EXPIRE, due(deadline=NOW - 2.5, publishes=3), NOW)
    assert status == "expired" and detail["late_by"] == 2.5 and "published 3 time(s)" in detail["reason"]
    status, detail = ending(Action.DEAD_LETTER, due(publishes=6), NOW)
    assert status == "dead_lettered" and detail["reason"] == "lost" and "6 publications" in detail["error"]
    assert detail["request"] == {"type": "reserve", "arguments": {"sku": "W", "quantity": 1}}


# -- passes against a real broker and database ----------------------------------------------------------


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "broker") as server:
        yield server


def settings_of(broker: RedisServer, database: str, **more: Any) -> Settings:
    return Settings(broker_url=broker.url(0), result_backend=broker.url(1), database_url=database, **more)


def passes(relay: Relay, until: Action, count: int = 1) -> dict[str, int]:
    """Relay passes until one did ``until`` for ``count`` records (records are due after the bound)."""
    done: dict[str, int] = {}

    def enough() -> bool:
        nonlocal done
        done = relay.run_once().counts
        return done[until] >= count

    wait_until(enough, timeout=10, what=f"a pass that did {until} {count} time(s)")
    return done


def test_a_queued_message_is_left_alone_and_a_lost_one_is_published_again_as_it_was(
    broker: RedisServer, inventory_url: str
) -> None:
    settings = settings_of(broker, inventory_url, republish_after=0.05)
    with (
        ReservationClient(create_app(settings)) as client,
        redis.Redis.from_url(broker.url(0)) as queue,
        Inventory.from_url(inventory_url) as inventory,
    ):
        client.enqueue_reservation_sync("W", 2, idempotency_key="lost-1", deadline=NOW)
        first = queued_messages(queue)
        relay = relay_of(settings)
        try:
            assert passes(relay, Action.WAIT)[Action.REPUBLISH] == 0
            assert queued_messages(queue) == first  # still queued: no copy
            queue.delete("celery")  # the broker loses it
            passes(relay, Action.REPUBLISH)
        finally:
            relay.close()
        copy = queued_messages(queue)
        record = inventory.executor.run(accepted("lost-1"))
    assert len(copy) == 1
    assert copy[0]["kwargs"] == first[0]["kwargs"] == {
        "sku": "W", "quantity": 2, "hold_for": None, "idempotency_key": "lost-1"
    }  # fmt: skip
    for header in ("id", "task", "reservations_format", "reservations_deadline"):
        assert copy[0]["headers"][header] == first[0]["headers"][header], header
    # The copy carries when the request was recorded (the database's clock): its latency counts the loss.
    assert abs(copy[0]["headers"][ENQUEUED_AT] - first[0]["headers"][ENQUEUED_AT]) < 1
    assert copy[0]["headers"]["id"] == request_id("lost-1")
    assert record is not None and record.publishes == 2


def test_a_request_lost_every_time_ends_dead_lettered_and_one_past_its_deadline_expired(
    broker: RedisServer, inventory_url: str
) -> None:
    settings = settings_of(broker, inventory_url, republish_after=0.05, max_publishes=3)
    with (
        ReservationClient(create_app(settings)) as client,
        redis.Redis.from_url(broker.url(0)) as queue,
        Inventory.from_url(inventory_url) as inventory,
    ):
        client.enqueue_reservation_sync("W", 1, idempotency_key="always-lost")
        relay = relay_of(settings)
        try:
            publishes = []
            while (outcome := inventory.request_outcome("always-lost")) is None:
                queue.delete("celery")  # lost again, whatever was published
                relay.run_once()
                record = inventory.executor.run(accepted("always-lost"))
                assert record is not None
                publishes.append(record.publishes)
                assert len(publishes) < 1000, "never ended"
            # Queued all along (never lost, never taken up): it ends expired at its deadline.
            client.enqueue_reservation_sync("W", 1, idempotency_key="too-late", deadline=time.time() + 0.5)
            passes(relay, Action.EXPIRE)
            late = inventory.request_outcome("too-late")
        finally:
            relay.close()
    assert outcome.status == "dead_lettered" and outcome.detail["reason"] == "lost"
    assert max(publishes) == 3  # the first publication and two copies
    assert late is not None and late.status == "expired" and late.detail["late_by"] >= 0


def test_a_backlog_gets_no_copies(broker: RedisServer, inventory_url: str) -> None:
    """1,000 requests queued and nobody consuming: however long they wait, the relay finds every one of
    them in the queue (the bench measures 10,000)."""
    settings = settings_of(broker, inventory_url, republish_after=0.05)
    backlog = 1000
    with ReservationClient(create_app(settings)) as client, redis.Redis.from_url(broker.url(0)) as queue:
        for n in range(backlog):
            client.enqueue_reservation_sync("W", 1, idempotency_key=f"backlog-{n}")
        relay = relay_of(settings)
        try:
            waited = passes(relay, Action.WAIT, count=backlog // 2)  # a pass claims up to 500
            again = relay.run_once().counts
        finally:
            relay.close()
        depth = queue.llen("celery")
    assert waited[Action.REPUBLISH] == again[Action.REPUBLISH] == 0
    assert depth == backlog


# -- real workers ---------------------------------------------------------------------------------------


RELAYED = {"RESERVATIONS_REPUBLISH_AFTER": "0.5", "RESERVATIONS_RELAY_EVERY": "0.2"}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_messages_taken_and_never_acknowledged_or_lost_in_a_broker_restart_each_end_once(
    broker: RedisServer, tmp_path: Path, migrated_sqlite: Path, kind: str
) -> None:
    """Requests are enqueued before any worker runs; three messages are taken from the queue and never
    acknowledged (a worker killed between BRPOP and the unacknowledged set); the broker then restarts
    empty, losing the rest. Once a worker runs, its relay publishes every one of them again: each ends
    reserved by ``GET`` alone (nobody publishes anything more), and each is applied once."""
    keys = [f"{kind}-{n}" for n in range(8)]
    with migrated_database(kind, tmp_path, migrated_sqlite) as url:
        env = {
            "RESERVATIONS_BROKER_URL": broker.url(0),
            "RESERVATIONS_RESULT_BACKEND": broker.url(1),
            "RESERVATIONS_DATABASE_URL": url,
            **RELAYED,
        }
        with Inventory.from_url(url) as inventory, redis.Redis.from_url(broker.url(0)) as queue:
            inventory.add_sku("W", on_hand=100)
            with ReservationClient(create_app(Settings.from_env(env))) as client:
                for key in keys:
                    client.enqueue_reservation_sync("W", 1, idempotency_key=key)
            for _ in range(3):
                assert queue.rpop("celery") is not None
            broker.stop()
            broker.start()  # empty: no persistence
            with cluster(tmp_path / "w", env, count=1, prefix=f"relay{kind[:2]}") as running:
                outcomes = [wait_for_outcome(inventory, key) for key in keys]
            history = inventory.history("W")
    assert [o.status for o in outcomes] == ["reserved"] * len(keys), running.tails()
    writes = [h.idempotency_key for h in history if h.kind == "write" and h.idempotency_key]
    assert sorted(writes) == sorted(keys)
    assert "relay: published" in running.workers[0].log()


def wait_for_outcome(inventory: Inventory, key: str, timeout: float = 60) -> RequestResult:
    found: list[RequestResult] = []

    def ended() -> bool:
        outcome = inventory.request_outcome(key)
        if outcome is not None:
            found.append(outcome)
        return bool(found)

    wait_until(ended, timeout=timeout, what=f"the outcome of {key}")
    return found[0]


def test_copies_of_a_request_still_queued_are_applied_once(
    broker: RedisServer, tmp_path: Path, migrated_sqlite: Path
) -> None:
    """Where the broker cannot be looked into (RabbitMQ), the relay copies a request that was only slow:
    here three copies of each of a few requests are queued before a worker runs. Each request is applied
    once and ends with one outcome: the key and the fingerprint make the copies replays."""
    keys = [f"copied-{n}" for n in range(4)]
    with migrated_database("sqlite", tmp_path, migrated_sqlite) as url:
        env = {
            "RESERVATIONS_BROKER_URL": broker.url(0),
            "RESERVATIONS_RESULT_BACKEND": broker.url(1),
            "RESERVATIONS_DATABASE_URL": url,
            "RESERVATIONS_REPUBLISH_AFTER": "0.05",
        }
        settings = Settings.from_env(env)
        with Inventory.from_url(url) as inventory:
            inventory.add_sku("W", on_hand=100)
            with ReservationClient(create_app(settings)) as client:
                for key in keys:
                    client.enqueue_reservation_sync("W", 1, idempotency_key=key)
            relay = Relay(
                inventory, Producer.configured(settings), after=0.05, max_publishes=100, carried=None
            )

            def published() -> list[int]:
                found = [inventory.executor.run(accepted(key)) for key in keys]
                return [0 if record is None else record.publishes for record in found]

            wait_until(
                lambda: relay.run_once() and min(published()) >= 3, timeout=30, what="two copies of each"
            )
            relay.producer.close()
            copies = sum(published())
            with redis.Redis.from_url(broker.url(0)) as queue:
                assert queue.llen("celery") == copies
            with cluster(tmp_path / "w", env, count=1, prefix="copies") as running:
                outcomes = [wait_for_outcome(inventory, key) for key in keys]
                wait_until(
                    lambda: running.workers[0].log().count("succeeded in") >= copies,
                    timeout=30,
                    what="every copy run",
                )
            history = inventory.history("W")
            level = inventory.stock("W")
    assert [o.status for o in outcomes] == ["reserved"] * len(keys)
    writes = [h.idempotency_key for h in history if h.kind == "write" and h.idempotency_key]
    assert sorted(writes) == sorted(keys)
    assert (level.on_hand, level.reserved) == (100, len(keys))


def _refusing_publishes(broker: RedisServer) -> str:
    """A broker URL for the workers under a user whom an ACL denies LPUSH: every publish is refused."""
    with redis.Redis.from_url(broker.url(0)) as admin:
        admin.execute_command("ACL", "SETUSER", "worker", "on", ">secret", "~*", "&*", "+@all", "-lpush")
    return broker.url(0).replace("redis://", "redis://worker:secret@")


def test_a_retry_the_broker_refuses_keeps_the_request_which_then_ends(
    broker: RedisServer, tmp_path: Path, migrated_sqlite: Path
) -> None:
    """The lease Redis is down, so the request retries; the broker refuses the retry's publish (an ACL
    takes LPUSH from the workers' user) and Celery would ack the message with no outcome. The worker keeps
    the request's record instead, its relay cannot publish it either, and at its deadline the relay ends
    it expired: the request has an outcome, the retries are recorded as attempts, and no message is
    left behind."""
    workers_broker = _refusing_publishes(broker)
    with (
        migrated_database("sqlite", tmp_path, migrated_sqlite) as url,
        redis_server(tmp_path / "leases") as leases,
    ):
        env = {
            "RESERVATIONS_BROKER_URL": workers_broker,
            "RESERVATIONS_RESULT_BACKEND": broker.url(1),
            "RESERVATIONS_DATABASE_URL": url,
            "RESERVATIONS_LEASE_URL": leases.url(0),
            **RELAYED,
        }
        producer_env = {**env, "RESERVATIONS_BROKER_URL": broker.url(0)}
        with Inventory.from_url(url) as inventory:
            inventory.add_sku("W", on_hand=10)
            with cluster(tmp_path / "w", env, count=1, prefix="refused") as running:
                leases.stop()  # the lease Redis goes away: the request retries
                with ReservationClient(create_app(Settings.from_env(producer_env))) as client:
                    client.enqueue_reservation_sync(
                        "W", 1, idempotency_key="refused-1", deadline=time.time() + 3
                    )
                outcome = wait_for_outcome(inventory, "refused-1", timeout=30)
                log = running.workers[0].log()
            attempts = inventory.attempts("refused-1")
            level = inventory.stock("W")
        with redis.Redis.from_url(broker.url(0)) as queue:
            left = queue.llen("celery"), queue.hlen("unacked")
    assert outcome.status == "expired", (outcome, running.tails())
    assert "the retry of refused-1 was refused" in log
    assert [a.result for a in attempts][:1] == ["transient"]
    assert left == (0, 0)
    assert (level.on_hand, level.reserved) == (10, 0)


def test_a_busy_retry_the_broker_refuses_keeps_the_request_rather_than_dead_lettering_it(
    broker: RedisServer, tmp_path: Path, migrated_sqlite: Path
) -> None:
    """Another holder keeps the SKU's lease, so the request (batching off) retries as busy; the broker
    refuses that retry's publish. The request is kept for the relay, as a refused outage retry is, and
    ends at its deadline ``expired``, not dead-lettered as an unexpected error."""
    workers_broker = _refusing_publishes(broker)
    with (
        migrated_database("sqlite", tmp_path, migrated_sqlite) as url,
        redis_server(tmp_path / "leases") as leases,
        LeaseManager.from_url(leases.url(0)) as other,
        other.hold(scope_of("B"), ttl=60, holder="someone else"),
    ):
        env = {
            "RESERVATIONS_BROKER_URL": workers_broker,
            "RESERVATIONS_RESULT_BACKEND": broker.url(1),
            "RESERVATIONS_DATABASE_URL": url,
            "RESERVATIONS_LEASE_URL": leases.url(0),
            "RESERVATIONS_BATCHING": "0",
            **RELAYED,
        }
        producer_env = {**env, "RESERVATIONS_BROKER_URL": broker.url(0)}
        with Inventory.from_url(url) as inventory:
            inventory.add_sku("B", on_hand=10)
            with cluster(tmp_path / "w", env, count=1, prefix="busy-refused") as running:
                with ReservationClient(create_app(Settings.from_env(producer_env))) as client:
                    client.enqueue_reservation_sync(
                        "B", 1, idempotency_key="busy-1", deadline=time.time() + 3
                    )
                outcome = wait_for_outcome(inventory, "busy-1", timeout=30)
                log = running.workers[0].log()
            level = inventory.stock("B")
    assert outcome.status == "expired", (outcome, running.tails())
    assert "the retry of busy-1 was refused" in log
    assert "failed unexpectedly" not in log
    assert (level.on_hand, level.reserved) == (10, 0)


# -- what an operator and a library caller see, without services ------------------------------------


def test_show_knows_a_request_accepted_without_an_outcome(tmp_path: Path, migrated_sqlite: Path) -> None:
    """The broker is unreachable: the command line records the request, says the broker did not take it,
    and `show` reports the request pending with its arguments, rather than "unknown"."""

    database = tmp_path / "inventory.sqlite3"
    shutil.copyfile(migrated_sqlite, database)
    env = {
        "RESERVATIONS_DATABASE_URL": f"sqlite:///{database}",
        "RESERVATIONS_BROKER_URL": "redis://127.0.0.1:9/0",
    }
    sent = cli("reserve", "W", "2", "--key", "shown-1", env=env, columns=200)
    assert sent.returncode == 4 and "the request is recorded" in sent.stderr, sent
    shown = cli("show", "shown-1", env=env, columns=300)
    assert shown.returncode == 0, shown
    assert "request shown-1: pending, reserve" in shown.stdout and "published 1 time(s)" in shown.stdout
    as_json = json.loads(cli("show", "shown-1", "--json", env=env).stdout)
    assert as_json["request"]["state"] == "pending" and as_json["outcome"] is None
    assert as_json["request"]["arguments"] == {"quantity": 2, "sku": "W"}
    assert cli("show", "never-sent", env=env).returncode == 3


def test_a_library_caller_cannot_take_a_redrive_s_key(tmp_path: Path, migrated_sqlite: Path) -> None:
    from reservations import InvalidRequest

    settings = Settings(broker_url="redis://127.0.0.1:9/0", database_url=f"sqlite:///{migrated_sqlite}")
    with ReservationClient(create_app(settings)) as client, pytest.raises(InvalidRequest, match="re-drive"):
        client.enqueue_reservation_sync("W", 1, idempotency_key="order-7~redrive-1")


def test_requests_lists_each_recorded_request_in_its_state_a_page_at_a_time(inventory_url: str) -> None:
    """Recorded requests in every state an operator asks about: pending (no attempt yet), retrying, an
    old one stuck without an outcome, and ended ones; each view and each page lists exactly its own."""
    made = {
        "r-pending": ("reserve", None, False),
        "r-retrying": ("reserve", None, True),
        "r-reserved": ("reserve", "reserved", True),
        "r-dead": ("restock", "dead_lettered", True),
        "r-stuck": ("reserve", None, False),
    }
    with Inventory.from_url(inventory_url) as inventory:
        requests = [request_of(op, key, {"sku": "W", "quantity": 1}) for key, (op, _, _) in made.items()]
        inventory.record_accepted(requests, 10)
        for key, (op, status, tried) in made.items():
            if tried:
                inventory.record_attempt(key, op, "transient", task_id=f"t-{key}", worker="w1")
            if status is not None:
                inventory.record_outcome(key, op, status, {"reason": "test"}, epochs=0)
        # Accepted a second apart, newest first in the order above; the last an hour before the others.
        with inventory.executor.engine.begin() as conn:
            base = conn.execute(sa.select(sa.func.max(accepted_requests.c.at_ms))).scalar_one()
            for n, key in enumerate(made):
                back = 3_600_000 if key == "r-stuck" else n * 1000
                conn.execute(
                    sa.update(accepted_requests)
                    .where(accepted_requests.c.key == key)
                    .values(at_ms=base - back)
                )
    env = {"RESERVATIONS_DATABASE_URL": inventory_url}

    def keys(*args: str) -> list[str]:
        done = cli("requests", *args, "--json", env=env)
        assert done.returncode == 0, done.stderr
        return [row["key"] for row in json.loads(done.stdout)]

    assert keys() == list(made)
    everything = json.loads(cli("requests", "--json", env=env).stdout)
    assert [(r["state"], r["attempts"]) for r in everything] == [
        ("pending", 0), ("retrying", 1), ("reserved", 1), ("dead_lettered", 1), ("pending", 0)
    ]  # fmt: skip
    assert keys("--state", "pending") == ["r-pending", "r-stuck"]
    assert keys("--state", "retrying") == ["r-retrying"]
    assert keys("--state", "in-flight") == ["r-pending", "r-retrying", "r-stuck"]
    assert keys("--state", "stuck") == ["r-stuck"]  # no outcome for more than 600 s
    assert keys("--state", "dead_lettered") == ["r-dead"]
    assert keys("--operation", "restock") == ["r-dead"]
    assert keys("--limit", "2") == ["r-pending", "r-retrying"]
    assert keys("--limit", "2", "--after", "r-retrying") == ["r-reserved", "r-dead"]
    assert keys("--after", "r-dead") == ["r-stuck"]
    refused = cli("requests", "--state", "lost", env=env)
    assert refused.returncode == 2 and "unknown state 'lost'" in refused.stderr, refused.stderr
    shown = cli("requests", "--limit", "2", env=env, columns=200)
    assert "next page: --after r-retrying" in shown.stdout, shown.stdout


def test_stock_lists_a_page_of_skus_at_a_time(inventory_url: str) -> None:
    """The command line at scale: --limit, --after the previous page's last SKU, --prefix (whose "_" is
    a character of SKUs, not a wildcard)."""
    with Inventory.from_url(inventory_url) as inventory:
        for sku in ("A_1", "A-1", "AB1", "B1", "B2"):
            inventory.add_sku(sku, on_hand=1)
    env = {"RESERVATIONS_DATABASE_URL": inventory_url}

    def skus(*args: str) -> list[str]:
        done = cli("stock", *args, "--json", env=env)
        assert done.returncode == 0, done.stderr
        return [row["sku"] for row in json.loads(done.stdout)]

    assert skus() == ["A-1", "AB1", "A_1", "B1", "B2"]
    assert skus("--limit", "2") == ["A-1", "AB1"]
    assert skus("--limit", "2", "--after", "AB1") == ["A_1", "B1"]
    assert skus("--prefix", "A_") == ["A_1"]
    assert skus("--prefix", "B", "--after", "B1") == ["B2"]
    table = cli("stock", "--limit", "2", env=env, columns=200)
    assert "next page: --after AB1" in table.stdout, table.stdout
    assert cli("stock", "--after", "no way", env=env).returncode == 2
