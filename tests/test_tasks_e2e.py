"""Reservation requests end to end through real Celery worker processes, a private Redis broker and
PostgreSQL: a mixed batch, the same request delivered twice, a worker paused past its lease (SIGSTOP), a
worker killed after its commit (SIGKILL) and a dead-lettered request, each audited in the database. The
SQL-lease cluster's tests run on RabbitMQ as the broker too.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import redis

from reservations import InvalidRequest
from reservations.request_outcomes import request_id
from reservations.validation import scope_of
from tasks import ReservationHandle
from testing.harness import process_state, wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.workers import (
    BROKERS,
    FAULT_TIMEOUT,
    KEEP_RESULTS,
    OUTCOME_TIMEOUT,
    Stack,
    Worker,
    client_result,
    identity,
    logged,
    rabbitmq_vhost,
    stack,
)

pytestmark = pytest.mark.slow

# Short, because the fault tests wait for a stopped or killed holder's lease to run out; long enough that
# a healthy task, renewing every ttl/3, keeps its lease on a busy machine.
SQL_TTL = 1.0
# The dead-letter cluster allows a single epoch: a healthy task that lost its lease to a scheduling
# hiccup would be dead-lettered too, so it gets more slack.
REDIS_TTL = 2.0
PAUSE_ROUNDS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture(scope="module")
def sql_redis(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two workers, SQL leases on the inventory database, up to three epochs per request."""
    workdir = tmp_path_factory.mktemp("sql_cluster")
    with stack("sql", workdir, server, 0, RESERVATIONS_LEASE_TTL=str(SQL_TTL), **KEEP_RESULTS) as running:
        yield running


@pytest.fixture(scope="module")
def sql_rabbitmq(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The same cluster with RabbitMQ as its broker (a vhost of its own); results on the private Redis."""
    workdir = tmp_path_factory.mktemp("amqp_cluster")
    with (
        rabbitmq_vhost() as broker,
        stack(
            "amqp", workdir, server, 6, broker=broker, RESERVATIONS_LEASE_TTL=str(SQL_TTL), **KEEP_RESULTS
        ) as running,
    ):
        yield running


@pytest.fixture(params=BROKERS)
def sql(request: pytest.FixtureRequest) -> Stack:
    """The SQL-lease cluster on each broker: Redis, then RabbitMQ."""
    stack: Stack = request.getfixturevalue(f"sql_{request.param}")
    return stack


@pytest.fixture(scope="module")
def redis_leases(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two workers, Redis leases on the private server, one epoch per request (dead-letter on loss)."""
    with stack(
        "redis",
        tmp_path_factory.mktemp("redis_cluster"),
        server,
        2,
        RESERVATIONS_LEASE_URL=server.url(4),
        RESERVATIONS_LEASE_TTL=str(REDIS_TTL),
        RESERVATIONS_MAX_EPOCHS="1",
    ) as running:
        yield running


# -- the happy path --------------------------------------------------------------------------------------


def test_mixed_batch_every_request_gets_one_outcome(sql: Stack) -> None:
    inv, client = sql.inventory, sql.client
    stock = {"E1": 10, "E2": 5, "E3": 3, "E4": 6}
    for sku, on_hand in stock.items():
        inv.add_sku(sku, on_hand=on_hand)

    # Two units per request: E1 can take all four, E2 two of three, E3 one of three.
    wanted = {"E1": 4, "E2": 3, "E3": 3}
    handles = {
        f"batch-{sku}-{i}": client.enqueue_reservation_sync(sku, 2, idempotency_key=f"batch-{sku}-{i}")
        for sku, count in wanted.items()
        for i in range(count)
    }
    handles["batch-unknown"] = client.enqueue_reservation_sync("E-NONE", 1, idempotency_key="batch-unknown")
    # The producer refuses a malformed SKU before anything is sent; a raw send gets it to the worker.
    with pytest.raises(InvalidRequest):
        client.enqueue_reservation_sync("bad sku", 1, idempotency_key="batch-malformed")
    handles["batch-malformed"] = client.enqueue_sync(
        "reserve", idempotency_key="batch-malformed", sku="bad sku", quantity=1
    )

    outcomes = dict(zip(handles, sql.results(list(handles.values())), strict=True))
    by_sku = {
        sku: Counter(outcomes[f"batch-{sku}-{i}"].status for i in range(n)) for sku, n in wanted.items()
    }
    assert by_sku == {
        "E1": {"reserved": 4},
        "E2": {"reserved": 2, "insufficient_stock": 1},
        "E3": {"reserved": 1, "insufficient_stock": 2},
    }
    assert outcomes["batch-unknown"].status == "invalid"
    assert outcomes["batch-unknown"].detail["error"] == "UnknownSku"
    assert outcomes["batch-malformed"].status == "invalid"
    assert outcomes["batch-malformed"].detail["error"] == "InvalidRequest"
    for key, outcome in outcomes.items():
        # One outcome per request, durable, and the same one the worker handed back to Celery.
        assert inv.request_outcome(key) == outcome
        assert outcome.task_id == request_id(key)
        celery_result = client_result(sql, request_id(key))
        assert (celery_result["key"], celery_result["status"]) == (key, outcome.status)
        applied = Counter(a.result for a in inv.attempts(key))["applied"]
        assert applied == (1 if outcome.status == "reserved" else 0), (key, inv.attempts(key))
        if outcome.status == "reserved":
            (reservation_id,) = outcome.detail["reservation_ids"]
            sku = key.split("-")[1]
            assert sql.reservations_of(sku, key) == [reservation_id]
    for sku in wanted:
        level = inv.stock(sku)
        assert (level.on_hand, level.reserved) == (stock[sku], 2 * by_sku[sku]["reserved"])

    # An order is all or nothing: E3 has one unit left, so the second order reserves nothing on E4 either.
    order, short = (
        client.enqueue_sync("reserve_order", idempotency_key="batch-order", lines=[["E1", 1], ["E4", 2]]),
        client.enqueue_sync(
            "reserve_order", idempotency_key="batch-order-short", lines=[["E4", 1], ["E3", 2]]
        ),
    )
    placed, refused = sql.results([order, short])
    assert placed.status == "reserved" and len(placed.detail["reservation_ids"]) == 2
    assert refused.status == "insufficient_stock" and refused.detail["sku"] == "E3"
    assert inv.reservations(order_key="batch-order-short") == []

    confirmed_id = outcomes["batch-E1-0"].detail["reservation_ids"][0]
    released_id = outcomes["batch-E1-1"].detail["reservation_ids"][0]
    finishing = [
        client.enqueue_sync("confirm", idempotency_key="batch-confirm", reservation_id=confirmed_id),
        client.enqueue_sync("release", idempotency_key="batch-release", reservation_id=released_id),
        client.enqueue_sync("restock", idempotency_key="batch-restock", sku="E3", quantity=4),
    ]
    assert [r.status for r in sql.results(finishing)] == ["confirmed", "released", "restocked"]
    # A second, differently keyed confirm of the same reservation is refused by its lifecycle.
    again = client.enqueue_sync("confirm", idempotency_key="batch-confirm-again", reservation_id=confirmed_id)
    refused_again = sql.result(again)
    assert (refused_again.status, refused_again.detail["error"]) == ("invalid", "InvalidTransition")

    assert inv.reservation(confirmed_id).status == "confirmed"
    assert inv.reservation(released_id).status == "released"
    levels = {sku: inv.stock(sku) for sku in stock}
    # E1: 10 on hand, 4x2 + 1 held; confirm takes 2 out of stock, release gives 2 back.
    assert {sku: (s.on_hand, s.reserved, s.available) for sku, s in levels.items()} == {
        "E1": (8, 5, 3),
        "E2": (5, 4, 1),
        "E3": (7, 2, 5),
        "E4": (6, 2, 4),
    }
    assert inv.invariant_violations() == []


def test_a_confirm_takes_the_lease_its_sku_hint_names_and_a_wrong_hint_costs_a_lease_not_the_request(
    sql: Stack,
) -> None:
    """A confirm or release that names its reservation's SKU has its worker take that SKU's lease without
    reading the reservation first. A wrong SKU is refused by the write, which names the right one, and the
    worker takes that lease: the request still ends as it would have. Found busy, that lease is waited for
    by a retry that carries the SKU found, so the wrong one costs one lease, not one per retry; and a wrong
    SKU whose own lease is busy is not waited for: the worker reads the reservation's."""
    client, inv = sql.client, sql.inventory
    inv.add_sku("HINT1", on_hand=5)
    inv.add_sku("HINT2", on_hand=5)
    made = sql.results(
        [client.enqueue_reservation_sync("HINT1", 1, idempotency_key=f"hint-{i}") for i in range(3)]
    )
    kept, let_go, let_go_too = (outcome.detail["reservation_ids"][0] for outcome in made)
    with pytest.raises(InvalidRequest):
        client.enqueue_sync("confirm", idempotency_key="hint-bad", reservation_id=kept, sku_hint="no sku")
    right = client.enqueue_sync(
        "confirm", idempotency_key="hint-right", reservation_id=kept, sku_hint="HINT1"
    )
    assert sql.result(right).status == "confirmed"

    def held_until_retried(sku: str, key: str, reservation: str) -> ReservationHandle:
        """The release sent with the hint HINT2 while the test holds ``sku``'s lease, which it lets go once
        the release was retried (nothing else holds that lease for long); or once it ended, if it did not
        wait for the lease."""
        held = sql.leases.acquire(scope_of(sku), ttl=60, holder="the test")
        try:
            handle = client.enqueue_sync(
                "release", idempotency_key=key, reservation_id=reservation, sku_hint="HINT2"
            )
            retried = f"Task reservations.release[{handle.task_id}] retry"
            wait_until(
                lambda: (
                    any(retried in worker.log() for worker in sql.cluster.workers)
                    or inv.request_outcome(key) is not None
                    or None
                ),
                timeout=FAULT_TIMEOUT,
                what=f"the release retried or ended, {sku}'s lease held",
            )
        finally:
            sql.leases.release(held)
        return handle

    # The right SKU's lease is held: the release takes HINT2's (free), is refused there, finds HINT1's held
    # and retries; the retry goes straight to HINT1.
    wrong = held_until_retried("HINT1", "hint-wrong", let_go)
    assert sql.result(wrong).status == "released"
    acquired = [event.event for event in sql.leases.history(scope_of("HINT2"))].count("acquired")
    assert acquired == 1  # the wrong hint was followed once, and wrote nothing there
    # The hinted SKU's lease is held: the release reads its reservation's SKU and takes that lease at once.
    waiting = held_until_retried("HINT2", "hint-wrong-busy", let_go_too)
    assert sql.result(waiting).status == "released"
    assert inv.request_outcome("hint-wrong-busy") is not None
    history = [event.event for event in sql.leases.history(scope_of("HINT2"))]
    assert history.count("acquired") == acquired + 1  # the test's own hold, nothing of the worker's
    stock = {sku: inv.stock(sku) for sku in ("HINT1", "HINT2")}
    assert {sku: (s.on_hand, s.reserved) for sku, s in stock.items()} == {"HINT1": (4, 0), "HINT2": (5, 0)}
    assert [entry.idempotency_key for entry in inv.history("HINT2")] == [None]  # its add_sku alone


# -- faults ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Paused:
    """A worker whose pool child stopped itself holding a SKU's lease, and that lease."""

    worker: Worker
    child: int
    token: int


@contextmanager
def paused_holder(stack: Stack, sku: str, key: str) -> Iterator[tuple[ReservationHandle, Paused]]:
    """Enqueue ``key`` with before_write=stop armed; yield once its worker stopped and its lease expired.

    The stopped child is always continued on the way out, so a failing test leaves no worker frozen for
    the tests after it.
    """
    stack.cluster.arm("before_write")
    handle = stack.client.enqueue_reservation_sync(sku, 2, idempotency_key=key)
    stopped = None
    try:
        try:
            worker, child = wait_until(
                stack.cluster.worker_with_stopped_child, timeout=FAULT_TIMEOUT, what="a worker to stop itself"
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{stack.cluster.tails()}") from None
        stopped = child
        holder = f"{identity(child)}:{request_id(key)}"
        events = stack.leases.history(f"sku:{sku}")
        (acquired,) = [e for e in events if e.event == "acquired" and e.holder == holder]
        # Its renewal thread is stopped with it, so the lease runs out at the coordinator.
        wait_until(
            lambda: stack.leases.current(f"sku:{sku}") is None,
            timeout=FAULT_TIMEOUT,
            what=f"the stopped holder's lease on {sku} to expire",
        )
        assert process_state(child) == "T", "the holder must still be stopped while its lease expires"
        yield handle, Paused(worker, child, acquired.token)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)


def paused_round(stack: Stack, sku: str) -> bool:
    """One SIGSTOP round on a fresh SKU, fully checked; True if the late write reached the fence.

    On resuming, the paused child's main thread (about to write) races its own renewal thread (about to
    renew). Usually the write gets to the stock row first and is refused there; sometimes the renewal
    finds the lease superseded first and marks it lost, and the write is never sent. Both are lost
    ownership and must end the same way; only the first leaves a fenced rejection behind.
    """
    inv = stack.inventory
    inv.add_sku(sku, on_hand=10)
    key_a, key_b = f"paused-{sku}-a", f"paused-{sku}-b"

    with paused_holder(stack, sku, key_a) as (handle_a, paused):
        # The other worker is free (the paused one holds its single prefetched message unacked): it takes
        # a newer lease on the SKU and writes, moving the fence past the paused holder's token.
        written = stack.result(stack.client.enqueue_reservation_sync(sku, 3, idempotency_key=key_b))
        assert written.status == "reserved"
        assert written.worker != identity(paused.child)
        assert written.detail["token"] > paused.token
    # Leaving the block continued the paused child: its attempt is lost, and the request goes round again
    # in a new epoch under a new lease.
    outcome = stack.result(handle_a)
    assert outcome.status == "reserved"
    assert outcome.epochs >= 1
    assert outcome.detail["token"] > written.detail["token"]

    attempts = inv.attempts(key_a)
    lost = [a for a in attempts if a.result == "lost_ownership"]
    assert [(a.task_id, a.worker, a.token) for a in lost] == [
        (request_id(key_a), identity(paused.child), paused.token)
    ], attempts
    assert [a.result for a in attempts if a.result != "lost_ownership"] == ["applied"]

    rejected = [h for h in inv.history(sku) if h.kind == "rejected"]
    assert [(h.idempotency_key, h.token, h.highest_token) for h in rejected] in (
        [],
        [(key_a, paused.token, written.detail["token"])],
    )
    assert inv.rejection_counts().get(sku, 0) == len(rejected)
    # Each request changed the stock exactly once: 2 + 3 units held.
    assert stack.writes_of(sku, key_a) == ["reserve"] and stack.writes_of(sku, key_b) == ["reserve"]
    level = inv.stock(sku)
    assert (level.on_hand, level.reserved, level.available) == (10, 5, 5)
    assert inv.invariant_violations() == []
    return bool(rejected)


def test_paused_worker_is_fenced_off_and_its_request_redriven(sql: Stack) -> None:
    # With SQL leases the renewal thread wins the race in roughly one round of fifteen; a few rounds
    # make sure the fence itself is seen refusing a late write (each round costs about one ttl).
    paths = []
    for n in range(PAUSE_ROUNDS):
        fenced = paused_round(sql, f"P{n}")
        paths.append("fence" if fenced else "renewal")
        if fenced:
            break
    print(f"\nlate write of the paused worker stopped by: {', '.join(paths)}")
    assert paths[-1] == "fence", f"the fence never saw a late write in {PAUSE_ROUNDS} rounds"


def test_worker_killed_after_commit_redelivers_and_replays(sql: Stack) -> None:
    inv, sku, key = sql.inventory, "K1", "killed"
    inv.add_sku(sku, on_hand=10)
    children_before = {worker.name: worker.pool_child() for worker in sql.cluster.workers}

    sql.cluster.arm("after_write")
    handle = sql.client.enqueue_reservation_sync(sku, 2, idempotency_key=key)

    def killed() -> tuple[Worker, int] | None:
        for worker in sql.cluster.workers:
            found = re.search(r"failpoint after_write: kill in process (\d+)", worker.log())
            if found:
                return worker, int(found.group(1))
        return None

    victim, dead_child = wait_until(killed, timeout=FAULT_TIMEOUT, what="a worker to kill itself")
    outcome = sql.result(handle)
    assert outcome.status == "reserved"
    # The outcome was written by the killed run's own statement, with the reservation it reports.
    assert outcome.worker == identity(dead_child)
    assert dead_child == children_before[victim.name]
    # The redelivered run answers from it: its Celery result is that outcome, not a failure.
    assert client_result(sql, handle.task_id)["status"] == "reserved"

    # The worker's main process saw its pool child die and gave the unacked message back to the queue
    # (acks_late + reject_on_worker_lost), well before any visibility timeout could have.
    log = victim.log()
    assert f"pid:{dead_child} exited with 'signal 9 (SIGKILL)'" in log
    assert "WorkerLostError" in log
    # Delivered again: the killed run died before it could have sent a retry of its own.
    assert logged(sql, handle.task_id, "received") >= 2
    # ... and started a new pool child, which keeps serving.
    assert victim.pool_child() != dead_child

    # The commit of the killed run stands, and nothing else was attempted under the key.
    attempts = inv.attempts(key)
    assert [(a.result, a.worker) for a in attempts] == [("applied", identity(dead_child))], attempts
    assert sql.reservations_of(sku, key) == outcome.detail["reservation_ids"]
    assert len(outcome.detail["reservation_ids"]) == 1
    assert sql.writes_of(sku, key) == ["reserve"]
    level = inv.stock(sku)
    assert (level.on_hand, level.reserved, level.available) == (10, 2, 8)
    assert inv.invariant_violations() == []


# -- both lease backends ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sql_redis", "sql_rabbitmq", "redis_leases"])
def test_same_request_twice_is_applied_once(backend: str, request: pytest.FixtureRequest) -> None:
    run: Stack = request.getfixturevalue(backend)
    inv, sku, key = run.inventory, f"D-{backend}", f"twice-{backend}"
    inv.add_sku(sku, on_hand=10)

    first = run.client.enqueue_reservation_sync(sku, 3, idempotency_key=key)
    second = run.client.enqueue_reservation_sync(sku, 3, idempotency_key=key)
    assert first.task_id == second.task_id == request_id(key)

    outcome = run.result(first)
    assert outcome.status == "reserved"
    assert run.result(second) == outcome
    # "Applied once" only means something once both messages have been consumed. A copy that found the
    # lease busy was queued for the holder and ended at once, leaving its result to the holder.
    wait_until(
        lambda: logged(run, first.task_id, "succeeded") >= 2,
        timeout=OUTCOME_TIMEOUT,
        what="both runs",
    )

    assert run.reservations_of(sku, key) == outcome.detail["reservation_ids"]
    assert run.writes_of(sku, key) == ["reserve"]
    assert Counter(a.result for a in inv.attempts(key))["applied"] == 1
    level = inv.stock(sku)
    assert (level.on_hand, level.reserved, level.available) == (10, 3, 7)
    assert inv.invariant_violations() == []


# How long each cluster keeps a request's Celery result: seconds left, or -2 (Redis: no such key).
RESULT_TTLS = {"sql_redis": range(1, 601), "redis_leases": range(-2, -1)}


@pytest.mark.parametrize("backend", sorted(RESULT_TTLS))
def test_a_request_stores_its_celery_result_only_when_results_are_kept(
    backend: str, request: pytest.FixtureRequest
) -> None:
    run: Stack = request.getfixturevalue(backend)
    inv, sku, key = run.inventory, f"K-{backend}", f"kept-{backend}"
    inv.add_sku(sku, on_hand=5)
    handle = run.client.enqueue_reservation_sync(sku, 1, idempotency_key=key)
    assert run.result(handle).status == "reserved"
    # Celery logs the success after storing the result: from then on nothing more is stored.
    wait_until(lambda: logged(run, handle.task_id, "succeeded") >= 1, timeout=OUTCOME_TIMEOUT, what="its run")
    with redis.Redis.from_url(run.cluster.parsed.result_backend) as results:
        name = f"celery-task-meta-{handle.task_id}"
        ttl, stored = results.ttl(name), results.get(name)
    assert ttl in RESULT_TTLS[backend]
    if stored is not None:  # without the extended metadata: the outcome row holds who ran what
        meta = json.loads(stored)
        assert meta["result"]["status"] == "reserved"
        assert not {"name", "args", "kwargs", "worker"} & set(meta)


def test_request_losing_its_only_epoch_is_dead_lettered(redis_leases: Stack) -> None:
    inv, sku = redis_leases.inventory, "X1"
    inv.add_sku(sku, on_hand=10)
    key_a, key_b = "dead-a", "dead-b"

    with paused_holder(redis_leases, sku, key_a) as (handle_a, paused):
        written = redis_leases.result(
            redis_leases.client.enqueue_reservation_sync(sku, 3, idempotency_key=key_b)
        )
        assert written.status == "reserved"
        assert written.detail["token"] > paused.token

    outcome = redis_leases.result(handle_a)
    assert outcome.status == "dead_lettered"
    assert outcome.detail["reason"] == "lost ownership 1 times"
    assert outcome.epochs == 0
    assert outcome.worker == identity(paused.child)

    (lost,) = inv.attempts(key_a)
    assert (lost.result, lost.worker, lost.token) == ("lost_ownership", identity(paused.child), paused.token)
    # Lost either way: the fence refused the late write, or the renewal thread, resuming first, found the
    # lease superseded and the write was never sent (with Redis leases that race goes both ways).
    fenced = [(h.idempotency_key, h.token) for h in inv.history(sku) if h.kind == "rejected"]
    assert fenced in ([], [(key_a, paused.token)])
    # Nothing of the request reached the stock.
    assert redis_leases.writes_of(sku, key_a) == []
    assert redis_leases.reservations_of(sku, key_a) == []
    level = inv.stock(sku)
    assert (level.on_hand, level.reserved, level.available) == (10, 3, 7)
    assert inv.invariant_violations() == []


def test_settings_never_print_passwords() -> None:
    from tasks import Settings

    shown = repr(Settings(database_url="postgresql://app:s3cret@db/inv", broker_url="redis://:pw2@r:6379/0"))
    assert "s3cret" not in shown and "pw2" not in shown and "***" in shown
