"""Counts and replenishments end to end through real Celery worker processes, a private Redis broker and
PostgreSQL with SQL leases: each request's outcome, a count refused below the held units, and a count whose
worker stopped itself after reading the stock (SIGSTOP at ``before_write``) while a newer epoch restocked:
its figure, decided before the pause, is refused, and the request counts again from a fresh read.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pytest

from fencing import LeaseEvent
from reservations.request_outcomes import request_id
from testing.harness import process_state, wait_until
from testing.redis_servers import redis_server
from testing.workers import Stack, identity, stack

pytestmark = pytest.mark.slow

TTL = 1.0
LEASES = {"RESERVATIONS_LEASE_TTL": str(TTL)}
FAULT_TIMEOUT = 15.0


@pytest.fixture(scope="module")
def sql(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two workers, SQL leases on the inventory database, the one-shot failpoints disarmed."""
    workdir = tmp_path_factory.mktemp("counting_cluster")
    with redis_server(workdir / "redis") as server, stack("count", workdir, server, 0, **LEASES) as running:
        yield running


def test_count_and_replenish_requests_end_with_their_outcomes(sql: Stack) -> None:
    inv, client = sql.inventory, sql.client
    inv.add_sku("C1", on_hand=10)
    held = sql.result(client.enqueue_reservation_sync("C1", 3, idempotency_key="hold-3"))
    assert held.status == "reserved"

    counted = sql.result(client.enqueue_count_sync("C1", 12, idempotency_key="count-12"))
    assert (counted.status, counted.detail["quantity"]) == ("counted", 2)
    short = sql.result(client.enqueue_count_sync("C1", 2, idempotency_key="count-2"))
    assert (short.status, short.detail["error"]) == ("invalid", "CountBelowHeld")
    replenished = sql.result(client.enqueue_replenish_sync("C1", par=20, idempotency_key="par-20"))
    assert (replenished.status, replenished.detail["quantity"]) == ("replenished", 8)
    assert sql.result(client.enqueue_replenish_sync("C1", par=20, idempotency_key="par-20")) == replenished

    level = inv.stock("C1")
    assert (level.on_hand, level.reserved, level.available) == (20, 3, 17)
    history = [h for h in inv.history("C1") if h.kind == "write"]
    assert [(h.operation, h.on_hand_delta) for h in history] == [
        ("create", 10),
        ("reserve", 0),
        ("count", 2),
        ("replenish", 8),
    ]
    # Each records what it read under its lease: the reservation's write, then the count's.
    assert json.loads(history[2].detail or "")["seen"] == history[1].id
    assert json.loads(history[3].detail or "") == {"par": 20, "seen": history[2].id, "seen_on_hand": 12}
    assert inv.invariant_violations() == []


def test_a_count_decided_before_its_worker_paused_is_refused_and_counted_again(sql: Stack) -> None:
    inv, client, sku = sql.inventory, sql.client, "C2"
    inv.add_sku(sku, on_hand=10)
    sql.cluster.arm("before_write")
    # One unit missing from whatever the worker reads: a figure decided from the read.
    handle = client.enqueue_sync("count", idempotency_key="count-short-1", sku=sku, shrinkage=1)
    stopped = None
    try:
        try:
            _, stopped = wait_until(
                sql.cluster.worker_with_stopped_child, timeout=FAULT_TIMEOUT, what="a worker to stop itself"
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{sql.cluster.tails()}") from None
        holder = f"{identity(stopped)}:{request_id('count-short-1')}"

        def acquired_by_it() -> list[LeaseEvent]:
            return [
                e for e in sql.leases.history(f"sku:{sku}") if e.event == "acquired" and e.holder == holder
            ]

        try:
            (acquired,) = wait_until(acquired_by_it, timeout=FAULT_TIMEOUT, what=f"the acquire of {holder}")
        except TimeoutError as exc:
            events = sql.leases.history(f"sku:{sku}")
            raise AssertionError(f"{exc}; the scope's events: {events}\n{sql.cluster.tails()}") from None
        wait_until(
            lambda: sql.leases.current(f"sku:{sku}") is None,
            timeout=FAULT_TIMEOUT,
            what="the stopped holder's lease to expire",
        )
        assert process_state(stopped) == "T"
        # It read 10 and decided 9. Meanwhile a delivery of 5 lands in a newer epoch on the other worker.
        restocked = sql.result(
            client.enqueue_sync("restock", idempotency_key="delivery-5", sku=sku, quantity=5)
        )
        assert restocked.status == "restocked" and restocked.detail["token"] > acquired.token
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)

    outcome = sql.result(handle)
    assert outcome.status == "counted" and outcome.epochs >= 1
    # Counted again from a fresh read: 15 seen, one missing. The paused figure (9) would have lost the
    # delivery.
    assert outcome.detail["stock"][0]["on_hand"] == 14 and outcome.detail["quantity"] == -1
    lost = [a for a in inv.attempts("count-short-1") if a.result == "lost_ownership"]
    assert [(a.worker, a.token) for a in lost] == [(identity(stopped), acquired.token)]
    # The late write reached the stock row and was refused there, or the renewal thread found the lease
    # superseded first and it was never sent.
    rejected = [(h.operation, h.token) for h in inv.history(sku) if h.kind == "rejected"]
    assert rejected in ([], [("count", acquired.token)])
    writes = [h for h in inv.history(sku) if h.kind == "write"]
    assert [h.operation for h in writes] == ["create", "restock", "count"]
    assert json.loads(writes[2].detail or "") == {
        "counted": 14,
        "seen": writes[1].id,
        "seen_on_hand": 15,
        "shrinkage": 1,
    }
    assert inv.invariant_violations() == []
