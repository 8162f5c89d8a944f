"""The retry and terminal policy of a request task (tasks.policy.decide), one test per row of its table,
without a worker, a broker or a database: the decision is a pure function of the error, the counters the
message carries and the budgets. The real-worker tests (test_tasks_e2e, test_redis_faults) prove that an
attempt acts on it.
"""

from __future__ import annotations

import logging
import random

import pytest

from fencing import BackendUnavailable, InvalidLeaseRequest, LeaseBusy, LeaseLost, StaleToken
from reservations import (
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    InvalidTransition,
    RequestClosed,
    UnknownReservation,
    UnknownSku,
)
from reservations.statuses import RequestStatus
from tasks import metrics
from tasks.messages import parse
from tasks.policy import TRANSIENT_CEILING, Again, Final, HandOff, Limits, decide

LIMITS = Limits(busy=3, epochs=5, transient=4)
BUSY = LeaseBusy(scope="sku:A", holder="w1:7:t", token=9, retry_after=0.2)
STALE = StaleToken(scope="sku:A", presented=3, highest=4)
LOST = LeaseLost(scope="sku:A", token=3, reason="the lease ran out")
DOWN = BackendUnavailable(backend="leases", operation="acquire", detail="connection refused")


def counts(busy: int = 0, epoch: int = 0, transient: int = 0) -> dict[str, int]:
    return {"busy": busy, "epoch": epoch, "transient": transient}


def test_insufficient_stock_is_final_with_what_was_short() -> None:
    short = InsufficientStock(sku="A", requested=5, available=2)
    assert decide(short, counts(), LIMITS) == Final(RequestStatus.INSUFFICIENT_STOCK, short.summary())


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequest("quantity must be positive"),
        UnknownSku("NOPE"),
        UnknownReservation("r-1"),
        InvalidTransition(reservation_id="r-1", status="released", operation="confirm"),
        IdempotencyConflict(key="k", operation="reserve", stored_operation="restock"),
        RequestClosed(key="k", status="expired"),
        InvalidLeaseRequest("ttl must be positive"),
    ],
    ids=type,
)
def test_an_error_no_retry_can_mend_is_final_invalid_naming_it(error: Exception) -> None:
    decision = decide(error, counts(busy=1, epoch=1, transient=1), LIMITS)
    assert decision == Final(RequestStatus.INVALID, {"error": type(error).__name__, "message": str(error)})


def test_a_busy_lease_hands_a_request_that_can_wait_to_its_holder_whatever_its_count() -> None:
    assert decide(BUSY, counts(busy=LIMITS.busy), LIMITS, can_wait=True) == HandOff()


def test_a_busy_lease_retries_under_the_busy_counter_with_a_jittered_backoff() -> None:
    delays = {decide(BUSY, counts(busy=1), LIMITS, draw=random.Random(seed)) for seed in range(20)}
    assert all(isinstance(d, Again) and d.counter == "busy" for d in delays)
    assert len(delays) > 1  # jittered: workers that met the same holder do not come back together
    assert all(0.005 <= d.delay <= 1.0 for d in delays if isinstance(d, Again))


def test_a_busy_lease_past_the_busy_budget_is_a_dead_letter_naming_the_holder() -> None:
    assert decide(BUSY, counts(busy=LIMITS.busy), LIMITS) == Final(
        RequestStatus.DEAD_LETTERED, {"reason": "lease busy", "holder": "w1:7:t"}
    )


@pytest.mark.parametrize("lost", [STALE, LOST], ids=type)
def test_lost_ownership_runs_the_request_again_in_a_new_epoch(lost: Exception) -> None:
    decision = decide(lost, counts(epoch=LIMITS.epochs - 2), LIMITS)
    assert isinstance(decision, Again) and decision.counter == "epoch", decision


@pytest.mark.parametrize("lost", [STALE, LOST], ids=type)
def test_lost_ownership_in_the_last_epoch_is_a_dead_letter_with_the_last_loss(lost: Exception) -> None:
    assert decide(lost, counts(epoch=LIMITS.epochs - 1), LIMITS) == Final(
        RequestStatus.DEAD_LETTERED, {"reason": f"lost ownership {LIMITS.epochs} times", "last": str(lost)}
    )


def test_an_unreachable_backend_retries_with_a_backoff_growing_to_half_a_minute() -> None:
    ceilings = []
    for transient in range(LIMITS.transient):
        decision = decide(DOWN, counts(transient=transient), LIMITS, draw=random.Random(transient))
        assert isinstance(decision, Again) and decision.counter == "transient", decision
        ceiling = min(TRANSIENT_CEILING, 0.2 * 2**transient)
        assert ceiling / 2 <= decision.delay <= ceiling
        ceilings.append(ceiling)
    assert ceilings == sorted(ceilings)
    far = decide(DOWN, counts(transient=20), Limits(busy=3, epochs=5, transient=30))
    assert isinstance(far, Again) and TRANSIENT_CEILING / 2 <= far.delay <= TRANSIENT_CEILING


def test_an_unreachable_backend_past_the_transient_budget_is_a_dead_letter() -> None:
    assert decide(DOWN, counts(transient=LIMITS.transient), LIMITS) == Final(
        RequestStatus.DEAD_LETTERED, {"reason": "backend unavailable", "error": str(DOWN)}
    )


def test_each_counter_spends_only_its_own_budget() -> None:
    spent = counts(busy=LIMITS.busy, epoch=LIMITS.epochs, transient=LIMITS.transient)
    assert isinstance(decide(BUSY, counts(epoch=LIMITS.epochs, transient=LIMITS.transient), LIMITS), Again)
    assert isinstance(decide(STALE, counts(busy=LIMITS.busy, transient=LIMITS.transient), LIMITS), Again)
    assert isinstance(decide(DOWN, counts(busy=LIMITS.busy, epoch=LIMITS.epochs), LIMITS), Again)
    assert all(isinstance(decide(e, spent, LIMITS), Final) for e in (BUSY, STALE, DOWN))


def test_anything_else_is_a_bug_and_still_ends_the_request_dead_lettered() -> None:
    bug = ZeroDivisionError("division by zero")
    assert decide(bug, counts(), LIMITS) == Final(
        RequestStatus.DEAD_LETTERED, {"reason": "unexpected error", "error": repr(bug)}
    )


def test_a_dead_letter_without_a_lease_still_names_its_sku(caplog: pytest.LogCaptureFixture) -> None:
    """A request dead-lettered before any lease was taken (its backend stayed down) logs the SKU its
    message names, so that a log query by SKU finds it; one that met a lease logs the lease's."""
    restock = parse("restock", (), {"sku": "W-1", "quantity": 1, "idempotency_key": "k"})
    with caplog.at_level(logging.WARNING, logger="tasks"):
        metrics.dead_lettered(restock, "backend unavailable: refused", {"task_id": "t", "worker": "w"})
        metrics.dead_lettered(restock, "lease busy", {"task_id": "t"}, scope="sku:W-2", token=3)
    assert [record.sku for record in caplog.records] == ["W-1", "W-2"]  # type: ignore[attr-defined]
