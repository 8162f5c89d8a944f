"""The reservation tasks: take the SKU leases, run the fenced operation, give every request one outcome.

Per attempt: a request that already has a final outcome returns it; a busy lease retries later with
jittered backoff (never blocking the worker); lost ownership ends the attempt and its lease for good and
drives the request again in a new epoch, a bounded number of times, then dead-letters it; an unreachable
Redis or database retries with backoff. Only the final outcome is written once, by idempotency key.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from celery import Task

from fencing import (
    BackendUnavailable,
    FencingError,
    InvalidLeaseRequest,
    Lease,
    LeaseBusy,
    LostOwnership,
    StaleToken,
)
from reservations import (
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    InvalidTransition,
    Inventory,
    Outcome,
    UnknownReservation,
    UnknownSku,
)
from reservations import validation as valid
from reservations.requests import RequestResult, task_name
from tasks.app import app, settings_of
from tasks.failpoints import failpoint
from tasks.worker import Resources, resources, worker_identity

log = logging.getLogger("tasks")

FINAL_STATUS = {
    "reserve": "reserved",
    "reserve_many": "reserved",
    "confirm": "confirmed",
    "release": "released",
    "restock": "restocked",
}
_INVALID = (
    InvalidRequest,
    UnknownSku,
    UnknownReservation,
    InvalidTransition,
    IdempotencyConflict,
    InvalidLeaseRequest,
)

Apply = Callable[[Inventory, dict[str, Lease]], Outcome]


def _jitter(retry_after: float, attempt: int) -> float:
    """Full-jitter exponential backoff, capped by the time the current lease can still last.

    The holder usually releases long before its ttl runs out, so ``retry_after`` is a ceiling, not a wait.
    """
    ceiling = min(1.0, 0.01 * 2 ** min(attempt, 10))
    return min(max(retry_after, 0.005), random.uniform(0.005, ceiling))


def _as_result(result: RequestResult) -> dict[str, Any]:
    return {
        "key": result.key,
        "operation": result.operation,
        "status": result.status,
        "detail": result.detail,
        "epochs": result.epochs,
    }


def _detail(outcome: Outcome) -> dict[str, Any]:
    return {
        "reservation_ids": list(outcome.reservation_ids),
        "token": outcome.token,
        "quantity": outcome.quantity,
        "stock": [
            {"sku": s.sku, "on_hand": s.on_hand, "reserved": s.reserved, "available": s.available}
            for s in outcome.stock
        ],
    }


def run_request(
    task: Task, operation: str, key: str, skus: Callable[[Resources], list[str]], apply: Apply, epoch: int
) -> dict[str, Any]:
    """One attempt at a request; returns its final outcome or raises Celery's Retry."""
    res = resources(settings_of(app))
    settings = res.settings
    worker = worker_identity()
    task_id = task.request.id
    who = {"task_id": task_id, "worker": worker}

    def final(status: str, detail: dict[str, Any]) -> dict[str, Any]:
        stored = res.inventory.record_outcome(key, operation, status, detail, epochs=epoch, **who)
        return _as_result(stored)

    try:
        valid.idempotency_key(key)
    except InvalidRequest as exc:  # nowhere to record it by key: the Celery result carries it
        return {
            "key": None,
            "operation": operation,
            "status": "invalid",
            "detail": {"error": str(exc)},
            "epochs": epoch,
        }

    lease_token: int | None = None
    try:
        done = res.inventory.request_outcome(key)
        if done is not None:
            return _as_result(done)
        with res.inventory.hold_many(
            res.leases, skus(res), ttl=settings.lease_ttl, holder=f"{worker}:{task_id}"
        ) as leases:
            lease_token = max((lease.token for lease in leases.values()), default=None)
            failpoint("before_write")
            outcome = apply(res.inventory, leases)
            failpoint("after_write")
        res.inventory.record_attempt(
            key, operation, "replayed" if outcome.replayed else "applied", token=outcome.token, **who
        )
        return final(FINAL_STATUS[operation], _detail(outcome))
    except InsufficientStock as exc:
        return final(
            "insufficient_stock", {"sku": exc.sku, "requested": exc.requested, "available": exc.available}
        )
    except _INVALID as exc:
        return final("invalid", {"error": type(exc).__name__, "message": str(exc)})
    except LeaseBusy as busy:
        if task.request.retries >= settings.max_retries:
            return final("dead_lettered", {"reason": "lease busy", "holder": busy.holder})
        raise task.retry(countdown=_jitter(busy.retry_after, task.request.retries)) from None
    except LostOwnership as lost:
        # Terminal for this attempt and its lease: nothing more happens under it. The request itself
        # goes back to coordination: a new task run takes a new lease, and the idempotency key keeps an
        # effect that already landed from being applied twice.
        kind = "stale token" if isinstance(lost, StaleToken) else "lease lost"
        log.warning(
            "lost ownership of %s (token %s) in task %s on %s: %s",
            lost.scope,
            lost.token,
            task_id,
            worker,
            lost,
        )
        res.inventory.record_attempt(
            key, operation, "lost_ownership", token=lost.token or lease_token, detail=f"{kind}: {lost}", **who
        )
        if epoch + 1 >= settings.max_epochs:
            return final("dead_lettered", {"reason": f"lost ownership {epoch + 1} times", "last": str(lost)})
        kwargs = {**(task.request.kwargs or {}), "epoch": epoch + 1}
        raise task.retry(kwargs=kwargs, countdown=_jitter(0.01, epoch)) from None
    except (BackendUnavailable, FencingError) as exc:
        if task.request.retries >= min(settings.max_retries, 20):
            log.error("giving up on %s after %d retries: %s", key, task.request.retries, exc)
            try:
                return final("dead_lettered", {"reason": "backend unavailable", "last": str(exc)})
            except BackendUnavailable:
                raise exc from None
        raise task.retry(countdown=_jitter(0.1, task.request.retries)) from None


@app.task(bind=True, max_retries=None, name=task_name("reserve"))
def reserve(
    self: Task, sku: str, quantity: int, idempotency_key: str, hold_for: float | None = None, epoch: int = 0
) -> dict[str, Any]:
    return run_request(
        self,
        "reserve",
        idempotency_key,
        lambda _: [valid.sku(sku)],
        lambda inv, leases: inv.reserve(leases[sku], sku, quantity, key=idempotency_key, hold_for=hold_for),
        epoch,
    )


@app.task(bind=True, max_retries=None, name=task_name("reserve_order"))
def reserve_order(
    self: Task, lines: list[list[Any]], idempotency_key: str, hold_for: float | None = None, epoch: int = 0
) -> dict[str, Any]:
    def skus(_: Resources) -> list[str]:
        return [sku for sku, _ in valid.order_lines([tuple(line) for line in lines])]

    return run_request(
        self,
        "reserve_many",
        idempotency_key,
        skus,
        lambda inv, leases: inv.reserve_many(
            leases, [(line[0], line[1]) for line in lines], key=idempotency_key, hold_for=hold_for
        ),
        epoch,
    )


def _finish(task: Task, operation: str, reservation_id: str, key: str, epoch: int) -> dict[str, Any]:
    def skus(res: Resources) -> list[str]:
        return [res.inventory.reservation(valid.reservation_id(reservation_id)).sku]

    def apply(inv: Inventory, leases: dict[str, Lease]) -> Outcome:
        (lease,) = leases.values()
        finish = inv.confirm if operation == "confirm" else inv.release
        return finish(lease, reservation_id, key=key)

    return run_request(task, operation, key, skus, apply, epoch)


@app.task(bind=True, max_retries=None, name=task_name("confirm"))
def confirm(self: Task, reservation_id: str, idempotency_key: str, epoch: int = 0) -> dict[str, Any]:
    return _finish(self, "confirm", reservation_id, idempotency_key, epoch)


@app.task(bind=True, max_retries=None, name=task_name("release"))
def release(self: Task, reservation_id: str, idempotency_key: str, epoch: int = 0) -> dict[str, Any]:
    return _finish(self, "release", reservation_id, idempotency_key, epoch)


@app.task(bind=True, max_retries=None, name=task_name("restock"))
def restock(self: Task, sku: str, quantity: int, idempotency_key: str, epoch: int = 0) -> dict[str, Any]:
    return run_request(
        self,
        "restock",
        idempotency_key,
        lambda _: [valid.sku(sku)],
        lambda inv, leases: inv.restock(leases[sku], sku, quantity, key=idempotency_key),
        epoch,
    )


@app.task(name=task_name("expire_holds"))
def expire_holds() -> dict[str, int]:
    """Beat: return expired holds to stock, SKU by SKU; a SKU whose lease is busy waits for the next sweep."""
    res = resources(settings_of(app))
    expired, busy = 0, 0
    for sku in res.inventory.skus_with_due_holds():
        try:
            with res.leases.hold(
                valid.scope_of(sku), ttl=res.settings.lease_ttl, holder=f"{worker_identity()}:expiry"
            ) as lease:
                expired += len(res.inventory.expire_due(lease, sku).reservation_ids)
        except (LeaseBusy, LostOwnership) as exc:
            busy += 1
            log.info("expiry of %s skipped: %s", sku, exc)
    return {"expired": expired, "skipped": busy}


@app.task(name=task_name("noop"))
def noop(value: int = 0) -> int:
    """A task that does nothing: the baseline for end-to-end throughput benchmarks."""
    return value
