"""Every request ends in one outcome that is true for that request, through real Celery workers on
PostgreSQL: a key reused for a different request is a conflict for its caller (never the other request's
success), malformed messages and retry counters end ``invalid`` on a busy SKU as on a free one, a request
whose backend stays unreachable is dead-lettered with a reason, a frozen transaction holds its SKU for
about a lease ttl only, and enqueueing needs no result backend.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from reservations import IdempotencyConflict
from reservations.request_outcomes import RequestResult, request_id
from testing.harness import free_port, wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.workers import OUTCOME_TIMEOUT, Stack, identity, stack

pytestmark = pytest.mark.slow

TTL = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture(scope="module")
def truth(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two workers, SQL leases with a short ttl, a frozen-in-transaction failpoint (disarmed)."""
    with stack(
        "truth",
        tmp_path_factory.mktemp("truth"),
        server,
        0,
        failpoint_spec="in_write=stop,once",
        RESERVATIONS_LEASE_TTL=str(TTL),
        RESERVATIONS_HANDOFF_CHECK="0.05",
    ) as running:
        yield running


def outcome(stack: Stack, key: str) -> RequestResult:
    """The request's stored outcome, waited for by polling the database."""
    try:
        return wait_until(
            lambda: stack.inventory.request_outcome(key),
            timeout=OUTCOME_TIMEOUT,
            what=f"an outcome for {key}",
        )
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{stack.cluster.tails()}") from None


def send_raw(stack: Stack, name: str, key: str, **kwargs: Any) -> None:
    """A message as any producer could publish it, unchecked."""
    stack.client.app.send_task(
        f"reservations.{name}", kwargs={**kwargs, "idempotency_key": key}, task_id=request_id(key)
    )


# -- a key names one request -----------------------------------------------------------------------------


def test_concurrent_reuse_of_a_key_is_a_conflict_for_every_other_request(truth: Stack) -> None:
    truth.inventory.add_sku("T1", on_hand=1000)
    key = "truth-shared-key"

    def enqueue_and_wait(quantity: int) -> tuple[int, RequestResult | IdempotencyConflict]:
        handle = truth.client.enqueue_reservation_sync("T1", quantity, idempotency_key=key)
        try:
            return quantity, handle.result_sync(timeout=OUTCOME_TIMEOUT)
        except IdempotencyConflict as conflict:
            return quantity, conflict

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(enqueue_and_wait, [1 + i % 3 for i in range(60)]))

    (reservation,) = [r for r in truth.inventory.reservations("T1", limit=100) if r.idempotency_key == key]
    told_reserved = [q for q, answer in answers if isinstance(answer, RequestResult)]
    conflicts = [q for q, answer in answers if isinstance(answer, IdempotencyConflict)]
    # One effect; exactly the callers who asked for what was applied are told it was applied.
    assert Counter(told_reserved) == {reservation.quantity: 20}
    assert set(conflicts) == {1, 2, 3} - {reservation.quantity} and len(conflicts) == 40
    for _, answer in answers:
        if isinstance(answer, RequestResult):
            assert (answer.status, answer.detail["quantity"]) == ("reserved", reservation.quantity)
    assert truth.inventory.stock("T1").reserved == reservation.quantity
    assert truth.inventory.invariant_violations() == []


def test_a_different_operation_under_a_used_key_is_told_conflict_and_changes_nothing(truth: Stack) -> None:
    truth.inventory.add_sku("T2", on_hand=10)
    reserved = truth.client.enqueue_reservation_sync("T2", 2, idempotency_key="truth-op-key")
    assert reserved.result_sync(timeout=OUTCOME_TIMEOUT).status == "reserved"

    restock = truth.client.enqueue_sync("restock", idempotency_key="truth-op-key", sku="T2", quantity=5)
    with pytest.raises(IdempotencyConflict) as raised:
        restock.result_sync(timeout=OUTCOME_TIMEOUT)
    assert raised.value.stored_operation == "reserve"
    other_sku = truth.client.enqueue_reservation_sync("T1", 2, idempotency_key="truth-op-key")
    with pytest.raises(IdempotencyConflict):
        other_sku.result_sync(timeout=OUTCOME_TIMEOUT)
    # The same request again is the same request: it replays.
    again = truth.client.enqueue_reservation_sync("T2", 2, idempotency_key="truth-op-key")
    assert again.result_sync(timeout=OUTCOME_TIMEOUT) == truth.inventory.request_outcome("truth-op-key")

    level = truth.inventory.stock("T2")
    assert (level.on_hand, level.reserved) == (10, 2)
    assert [h.operation for h in truth.inventory.history("T2") if h.kind == "write"] == ["create", "reserve"]


# -- malformed messages ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def busy_sku(truth: Stack) -> str:
    truth.inventory.add_sku("T3", on_hand=10)
    return "T3"


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("quantity-text", {"sku": "T3", "quantity": "3"}),
        ("quantity-list", {"sku": "T3", "quantity": [1]}),
        ("negative-epoch", {"sku": "T3", "quantity": 1, "epoch": -1000}),
        ("text-epoch", {"sku": "T3", "quantity": 1, "epoch": "abc"}),
        ("bool-busy", {"sku": "T3", "quantity": 1, "busy": True}),
        ("unknown-argument", {"sku": "T3", "quantity": 1, "priority": "high"}),
        ("missing-quantity", {"sku": "T3"}),
    ],
)
def test_malformed_message_on_a_busy_sku_ends_invalid(
    truth: Stack, busy_sku: str, case: str, kwargs: dict[str, Any]
) -> None:
    key = f"truth-malformed-{case}"
    # The SKU's lease is held for the whole test, as by a long batch: the message must not wait for it.
    with truth.leases.hold("sku:T3", ttl=30, holder="test:busy"):
        send_raw(truth, "reserve", key, **kwargs)
        ended = outcome(truth, key)
    assert (ended.status, ended.detail["error"]) == ("invalid", "InvalidRequest"), ended
    assert truth.inventory.reservations("T3", limit=10) == []
    assert truth.inventory.pending_count("T3") == 0
    assert [h.operation for h in truth.inventory.history("T3")] == ["create"]


def test_watch_of_a_malformed_sku_ends_without_rescheduling(truth: Stack) -> None:
    result = truth.client.app.send_task("reservations.watch_waiting", args=["bad sku"])
    marker = f"Task reservations.watch_waiting[{result.id}] succeeded"
    wait_until(
        lambda: any(marker in worker.log() for worker in truth.cluster.workers),
        timeout=OUTCOME_TIMEOUT,
        what="the watch of a malformed SKU to end",
    )
    logs = "".join(worker.log() for worker in truth.cluster.workers)
    assert "not watching a queue for a malformed SKU" in logs
    assert "could not serve its queue" not in logs


# -- faults ------------------------------------------------------------------------------------------------


def test_request_whose_lease_backend_stays_down_is_dead_lettered_with_a_reason(
    server: RedisServer, tmp_path: Path
) -> None:
    lease_redis = RedisServer(tmp_path / "leases")
    lease_redis.start()  # a worker waits at start for a lease backend that does not answer yet
    with stack(
        "down",
        tmp_path,
        server,
        4,
        RESERVATIONS_LEASE_URL=lease_redis.url(0),
        RESERVATIONS_MAX_TRANSIENT_RETRIES="1",
    ) as down:
        lease_redis.stop()  # down once the workers run, and for good
        down.inventory.add_sku("D1", on_hand=5)
        handle = down.client.enqueue_reservation_sync("D1", 1, idempotency_key="truth-down")
        ended = handle.result_sync(timeout=OUTCOME_TIMEOUT)
        assert (ended.status, ended.detail["reason"]) == ("dead_lettered", "backend unavailable")
        assert down.inventory.stock("D1").reserved == 0
        # The key is closed: a late copy of the request cannot apply after its caller was told it failed.
        again = down.client.enqueue_reservation_sync("D1", 1, idempotency_key="truth-down")
        assert again.result_sync(timeout=OUTCOME_TIMEOUT) == ended


def test_requests_are_enqueued_and_answered_without_a_result_backend(
    server: RedisServer, tmp_path: Path
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with stack("noresults", tmp_path, server, 6, RESERVATIONS_RESULT_BACKEND=dead) as running:
        running.inventory.add_sku("R1", on_hand=5)
        started = time.monotonic()
        handles = [
            running.client.enqueue_reservation_sync("R1", 2, idempotency_key=f"truth-no-results-{i}")
            for i in range(3)
        ]
        published = time.monotonic() - started
        ended = [handle.result_sync(timeout=OUTCOME_TIMEOUT) for handle in handles]
    # Celery's result-backend retries take about 19 s before failing a publish or a task's STARTED write.
    print(f"\n3 requests published in {published:.3f}s with the result backend down")
    assert published < 5.0, published
    assert sorted(outcome.status for outcome in ended) == ["insufficient_stock", "reserved", "reserved"]


def test_frozen_transaction_holds_its_sku_for_about_a_ttl_and_then_loses_ownership(truth: Stack) -> None:
    truth.inventory.add_sku("T5", on_hand=10)
    truth.cluster.arm("in_write")
    frozen = truth.client.enqueue_reservation_sync("T5", 2, idempotency_key="truth-frozen")
    stopped = None
    try:
        _, child = wait_until(
            truth.cluster.worker_with_stopped_child, timeout=OUTCOME_TIMEOUT, what="a worker to freeze"
        )
        stopped = child
        # The frozen worker holds the SKU's row lock inside its open transaction. The other worker takes
        # the lease once it expires and must get the row within about a ttl, not at the end of the pause.
        started = time.monotonic()
        written = truth.client.enqueue_reservation_sync("T5", 3, idempotency_key="truth-after-frozen")
        ended = written.result_sync(timeout=OUTCOME_TIMEOUT)
        waited = time.monotonic() - started
        print(f"\nnext holder got the frozen holder's SKU after {waited:.2f}s (lease ttl {TTL}s)")
        assert ended.status == "reserved"
        assert waited < 6 * TTL, waited
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
    late = frozen.result_sync(timeout=OUTCOME_TIMEOUT)
    assert late.status == "reserved" and late.epochs >= 1
    attempts = truth.inventory.attempts("truth-frozen")
    assert [a.worker for a in attempts if a.result == "lost_ownership"] == [identity(child)], attempts
    level = truth.inventory.stock("T5")
    assert (level.on_hand, level.reserved) == (10, 5)
    assert truth.inventory.invariant_violations() == []
