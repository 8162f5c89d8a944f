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
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from celery import Task, states
from celery.exceptions import Retry

from fencing import (
    BackendUnavailable,
    InvalidLeaseRequest,
    Lease,
    LeaseBusy,
    LostOwnership,
)
from fencing.manager import backoff
from reservations import (
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    InvalidTransition,
    Inventory,
    Outcome,
    RequestClosed,
    UnknownReservation,
    UnknownSku,
)
from reservations import validation as valid
from reservations.requests import AlreadyApplied, RequestResult, task_name
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
    RequestClosed,
    InvalidRequest,
    UnknownSku,
    UnknownReservation,
    InvalidTransition,
    IdempotencyConflict,
    InvalidLeaseRequest,
)

Apply = Callable[[Inventory, dict[str, Lease]], Outcome]


_rng = random.Random()


def _jitter(retry_after: float, attempt: int) -> float:
    """Backoff between task retries: the lease backoff with a broker round trip's larger steps."""
    return backoff(attempt, retry_after, _rng, first=0.01, cap=1.0, floor=0.005)


def _as_result(result: RequestResult) -> dict[str, Any]:
    return {
        "key": result.key,
        "operation": result.operation,
        "status": result.status,
        "detail": result.detail,
        "epochs": result.epochs,
    }


# Transient failures (Redis or the database unreachable) retry this many times, with their own count.
MAX_TRANSIENT_RETRIES = 20
COUNTERS = ("epoch", "busy", "transient")
# A task serving a SKU's pending reservations gives up the lease after this many batches and takes it
# again (a new token) if the list is still not empty, at most this many times; the SKU's watch and the
# beat sweep look again, so a bound here never strands one.
BATCHES_PER_LEASE = 50
SERVE_ROUNDS = 20


@dataclass(frozen=True)
class Batchable:
    """A single-SKU reservation: what the holder of a busy lease can serve in a batch for its sender."""

    sku: str
    quantity: int
    hold_for: float | None


def run_request(
    task: Task,
    operation: str,
    key: str,
    skus: Callable[[Resources], list[str]],
    apply: Apply,
    batch: Batchable | None = None,
) -> dict[str, Any]:
    """One attempt at a request; returns its final outcome (or "queued", not stored, for a request queued
    for its SKU's lease holder: the server of its batch writes its result) or raises Celery's Retry.

    Three separate counters travel with the message: ``epoch`` (attempts that lost ownership), ``busy``
    (lease-busy retries) and ``transient`` (unreachable backend), so one kind of retry never uses up
    another's budget.
    """
    res = resources(settings_of(app))
    sent = dict(task.request.kwargs or {})
    counts = {name: int(sent.get(name) or 0) for name in COUNTERS}

    def again(counter: str, countdown: float) -> Exception:
        return task.retry(kwargs={**sent, counter: counts[counter] + 1}, countdown=countdown)  # type: ignore[no-any-return]

    try:
        valid.idempotency_key(key)
    except InvalidRequest as exc:  # nowhere to record it by key: the Celery result carries it
        return {
            "key": None,
            "operation": operation,
            "status": "invalid",
            "detail": {"error": str(exc)},
            "epochs": counts["epoch"],
        }
    try:
        if batch is not None and not res.settings.batching:
            batch = None
        return _attempt(task, res, operation, key, skus, apply, counts, again, batch)
    except AlreadyApplied:
        # A copy of this request applied it while this one was giving up: look again and report that.
        raise task.retry(kwargs=sent, countdown=0.01) from None
    except BackendUnavailable as exc:
        # Also covers an outcome or attempt that could not be recorded: nothing is final until it is.
        if counts["transient"] >= MAX_TRANSIENT_RETRIES:
            log.error("giving up on %s after %d transient failures: %s", key, counts["transient"], exc)
            raise
        # Its own backoff, growing to half a minute: a database restart or a Redis failover takes that long.
        ceiling = min(30.0, 0.2 * 2 ** counts["transient"])
        raise again("transient", _rng.uniform(ceiling / 2, ceiling)) from None
    except Exception as exc:
        if isinstance(exc, Retry):
            raise
        # A bug or an unforeseen input must still end the request, or its caller waits forever.
        log.exception("request %s failed unexpectedly", key)
        with suppress(Exception):
            res.inventory.record_outcome(
                key,
                operation,
                "dead_lettered",
                {"reason": "unexpected error", "error": repr(exc)[:500]},
                task_id=task.request.id,
                worker=worker_identity(),
                epochs=counts["epoch"],
            )
        raise


def _attempt(
    task: Task,
    res: Resources,
    operation: str,
    key: str,
    skus: Callable[[Resources], list[str]],
    apply: Apply,
    counts: dict[str, int],
    again: Callable[[str, float], Exception],
    batch: Batchable | None,
) -> dict[str, Any]:
    settings = res.settings
    worker = worker_identity()
    task_id = task.request.id
    who = {"task_id": task_id, "worker": worker}
    epoch = counts["epoch"]

    def final(status: str, detail: dict[str, Any]) -> dict[str, Any]:
        stored = res.inventory.record_outcome(key, operation, status, detail, epochs=epoch, **who)
        return _as_result(stored)

    lease_token: int | None = None
    try:
        done = res.inventory.request_outcome(key)
        if done is not None and done.operation != operation:
            # The key belongs to another request: report the conflict, store nothing under it.
            return {
                "key": key,
                "operation": operation,
                "status": "invalid",
                "epochs": epoch,
                "detail": {"error": "IdempotencyConflict", "stored_operation": done.operation},
            }
        if done is not None:
            return _as_result(done)
        with res.inventory.hold_many(
            res.leases,
            skus(res),
            ttl=settings.lease_ttl,
            holder=f"{worker}:{task_id}",
            renew_every=settings.lease_renew_every,
        ) as leases:
            lease_token = max((lease.token for lease in leases.values()), default=None)
            failpoint("before_write")
            outcome = apply(res.inventory, leases)
            failpoint("after_write")
        res.inventory.record_attempt(
            key, operation, "replayed" if outcome.replayed else "applied", token=outcome.token, **who
        )
        return _then_serve(res, batch, who, final(FINAL_STATUS[operation], outcome.summary()))
    except InsufficientStock as exc:
        return _then_serve(res, batch, who, final("insufficient_stock", exc.summary()))
    except _INVALID as exc:
        return final("invalid", {"error": type(exc).__name__, "message": str(exc)})
    except LeaseBusy as busy:
        if batch is not None:
            return _wait_for_holder(task, res, key, batch, counts["epoch"], who)
        if counts["busy"] >= settings.max_retries:
            return final("dead_lettered", {"reason": "lease busy", "holder": busy.holder})
        raise again("busy", _jitter(busy.retry_after, counts["busy"])) from None
    except LostOwnership as lost:
        # Terminal for this attempt and its lease: nothing more happens under it. The request itself
        # goes back to coordination: a new task run takes a new lease, and the idempotency key keeps an
        # effect that already landed from being applied twice.
        log.warning(
            "lost ownership of %s (token %s) in task %s on %s: %s",
            lost.scope,
            lost.token,
            task_id,
            worker,
            lost,
        )
        res.inventory.record_attempt(
            key, operation, "lost_ownership", token=lost.token or lease_token, detail=str(lost), **who
        )
        if epoch + 1 >= settings.max_epochs:
            return final("dead_lettered", {"reason": f"lost ownership {epoch + 1} times", "last": str(lost)})
        raise again("epoch", _jitter(0.01, epoch)) from None


def _wait_for_holder(
    task: Task, res: Resources, key: str, batch: Batchable, epoch: int, who: dict[str, Any]
) -> dict[str, Any]:
    """The lease is busy: queue the request for the holder instead of spinning on the lease.

    The task then ends at once, returning "queued" without storing it: whoever serves the request writes
    its outcome row and its Celery result. The first request to wait on the SKU also schedules a watch
    of the SKU's queue, which serves it once the lease is free if the holder died.
    """
    settings = res.settings
    queued = res.inventory.hand_off(
        batch.sku, batch.quantity, key=key, hold_for=batch.hold_for, task_id=who["task_id"], epochs=epoch
    )
    if queued.outcome is not None:
        return _as_result(queued.outcome)
    if queued.first:
        try:
            watch_waiting.apply_async(args=[valid.sku(batch.sku)], countdown=settings.handoff_check)
        except Exception as exc:  # the request is queued: the holder or the beat sweep still serve it
            log.warning("could not schedule the watch of %s: %s", batch.sku, exc)
    # Served nothing: the lease is busy, and its holder looks at the queue again after releasing.
    if _serve_quietly(res, batch.sku, known_waiting=True, **who):
        done = res.inventory.request_outcome(key)
        if done is not None:
            return _as_result(done)
    # Per-request ignore_result, read by Celery when it stores the return value: the server's result
    # for this task id must not be overwritten by "queued". (Raising Ignore does the same but costs a
    # formatted traceback per request.)
    task.request.ignore_result = True
    return {
        "key": key,
        "operation": "reserve",
        "status": "queued",
        "detail": {"sku": batch.sku},
        "epochs": epoch,
    }


def _then_serve(
    res: Resources, batch: Batchable | None, who: dict[str, Any], result: dict[str, Any]
) -> dict[str, Any]:
    """After a batchable request ran under its own lease: serve whatever queued up meanwhile."""
    if batch is not None:
        _serve_quietly(res, batch.sku, **who)
    return result


def _serve_quietly(res: Resources, sku: str, **kwargs: Any) -> int:
    """:func:`serve_pending` for callers whose own work is done or queued: a failure is logged, never
    raised, because the SKU's holder, its watch or the beat sweep serve the queue anyway."""
    try:
        return serve_pending(res, sku, **kwargs)
    except Exception:
        log.exception("could not serve the queue of %s", sku)
        return 0


def _publish(outcomes: list[RequestResult]) -> None:
    """Give each served request's own Celery task its result, as if it had run the request itself.

    The outcome rows are already committed and are what callers wait on; a result lost here (the server
    died in between) leaves only ``AsyncResult`` of that request waiting.
    """
    for outcome in outcomes:
        if outcome.task_id:
            try:
                app.backend.store_result(outcome.task_id, _as_result(outcome), states.SUCCESS)
            except Exception as exc:  # the result backend is a convenience here, never the record
                log.warning("could not store the Celery result of %s: %s", outcome.key, exc)


def serve_pending(
    res: Resources, sku: str, *, task_id: str | None, worker: str, known_waiting: bool = False
) -> int:
    """Serve the SKU's pending reservations unless its lease is busy; returns how many got an outcome.

    After releasing the lease it looks again: a request may have queued itself after the last batch
    while still finding the lease held, and then nobody else would serve it until its SKU's watch looks.
    ``known_waiting`` skips the first look (the caller has just queued a request).
    """
    settings = res.settings
    served = 0
    for round_ in range(SERVE_ROUNDS):
        if not (known_waiting and round_ == 0) and not res.inventory.has_pending(sku):
            break
        try:
            with res.leases.hold(
                valid.scope_of(sku),
                ttl=settings.lease_ttl,
                holder=f"{worker}:{task_id}",
                renew_every=settings.lease_renew_every,
            ) as lease:
                for _ in range(BATCHES_PER_LEASE):
                    failpoint("before_write")
                    outcomes = res.inventory.serve_pending(
                        lease, sku, limit=settings.batch_size, task_id=task_id, worker=worker
                    )
                    failpoint("after_write")
                    _publish(outcomes)
                    served += len(outcomes)
                    if not outcomes:
                        break
        except LeaseBusy:
            break  # its holder looks again after releasing
        except LostOwnership as lost:
            # Terminal for this lease: the batch rolled back and its requests stay queued for the next
            # holder or the watch.
            log.warning("lost ownership of %s while serving pending reservations: %s", sku, lost)
            break
    return served


@app.task(bind=True, max_retries=None, name=task_name("reserve"))
def reserve(
    self: Task, sku: str, quantity: int, idempotency_key: str, hold_for: float | None = None, **_counts: int
) -> dict[str, Any]:
    return run_request(
        self,
        "reserve",
        idempotency_key,
        lambda _: [valid.sku(sku)],
        lambda inv, leases: inv.reserve(leases[sku], sku, quantity, key=idempotency_key, hold_for=hold_for),
        Batchable(sku, quantity, hold_for),
    )


@app.task(bind=True, max_retries=None, name=task_name("reserve_order"))
def reserve_order(
    self: Task, lines: list[list[Any]], idempotency_key: str, hold_for: float | None = None, **_counts: int
) -> dict[str, Any]:
    def skus(_: Resources) -> list[str]:
        return [sku for sku, _ in valid.order_lines(lines)]

    return run_request(
        self,
        "reserve_many",
        idempotency_key,
        skus,
        lambda inv, leases: inv.reserve_many(
            leases, [(line[0], line[1]) for line in lines], key=idempotency_key, hold_for=hold_for
        ),
    )


def _finish(task: Task, operation: str, reservation_id: str, key: str) -> dict[str, Any]:
    def skus(res: Resources) -> list[str]:
        return [res.inventory.reservation(valid.reservation_id(reservation_id)).sku]

    def apply(inv: Inventory, leases: dict[str, Lease]) -> Outcome:
        (lease,) = leases.values()
        finish = inv.confirm if operation == "confirm" else inv.release
        return finish(lease, reservation_id, key=key)

    return run_request(task, operation, key, skus, apply)


@app.task(bind=True, max_retries=None, name=task_name("confirm"))
def confirm(self: Task, reservation_id: str, idempotency_key: str, **_counts: int) -> dict[str, Any]:
    return _finish(self, "confirm", reservation_id, idempotency_key)


@app.task(bind=True, max_retries=None, name=task_name("release"))
def release(self: Task, reservation_id: str, idempotency_key: str, **_counts: int) -> dict[str, Any]:
    return _finish(self, "release", reservation_id, idempotency_key)


@app.task(bind=True, max_retries=None, name=task_name("restock"))
def restock(self: Task, sku: str, quantity: int, idempotency_key: str, **_counts: int) -> dict[str, Any]:
    return run_request(
        self,
        "restock",
        idempotency_key,
        lambda _: [valid.sku(sku)],
        lambda inv, leases: inv.restock(leases[sku], sku, quantity, key=idempotency_key),
    )


@app.task(name=task_name("expire_holds"))
def expire_holds() -> dict[str, int]:
    """Beat: return expired holds to stock SKU by SKU; a SKU whose lease is busy waits for the next sweep."""
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


@app.task(bind=True, ignore_result=True, name=task_name("watch_waiting"))
def watch_waiting(self: Task, sku: str, round_: int = 0) -> None:
    """Looks after one SKU's queue until it is empty, sooner first, then up to a lease ttl apart: serves it
    whenever the lease is free. The request that found the queue empty scheduled it; it is what serves a
    queue whose holder died when no new request of the SKU comes along."""
    res = resources(settings_of(app))
    settings = res.settings
    try:
        serve_pending(res, sku, task_id=self.request.id, worker=worker_identity())
        left = res.inventory.has_pending(sku)
    except Exception:  # whatever went wrong, the queue still needs looking after
        log.exception("watch of %s could not serve its queue", sku)
        left = True
    if not left:
        return
    if round_ >= settings.max_retries:
        log.error("stopped watching the queue of %s after %d rounds; the beat sweep takes over", sku, round_)
        return
    countdown = min(settings.lease_ttl, settings.handoff_check * 2**round_)
    self.apply_async(args=[sku], kwargs={"round_": round_ + 1}, countdown=countdown)


@app.task(bind=True, name=task_name("serve_waiting"))
def serve_waiting(self: Task) -> dict[str, int]:
    """Beat: serve SKUs whose requests have waited longer than a lease ttl. Their holder and their SKU's
    watch normally serve them within a ttl; a watch can be stuck in a frozen worker's prefetch."""
    res = resources(settings_of(app))
    served, skus = 0, 0
    for sku in res.inventory.skus_waiting(older_than=res.settings.lease_ttl):
        skus += 1
        # Quietly: one SKU that cannot be served must not hold up the others.
        served += _serve_quietly(
            res, sku, task_id=self.request.id, worker=worker_identity(), known_waiting=True
        )
    return {"skus": skus, "served": served}


@app.task(name=task_name("purge"))
def purge() -> dict[str, int]:
    """Beat: apply the retention of idempotency records (keep it far above the redelivery horizon) and of
    SQL lease events, and drop queued requests that ended elsewhere; Redis lease streams are capped
    instead."""
    res = resources(settings_of(app))
    return {
        "idempotency_records": res.inventory.purge_idempotency(),
        "request_outcomes": res.inventory.purge_requests(),
        "ended_waits": res.inventory.purge_ended_waits(),
        "lease_events": res.leases.purge_history(),
    }


@app.task(name=task_name("noop"))
def noop(value: int = 0) -> int:
    """A task that does nothing: the baseline for end-to-end throughput benchmarks."""
    return value
