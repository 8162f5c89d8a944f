"""The reservation tasks: take the SKU leases, run the fenced operation, give every request one outcome.

Per attempt: a malformed message ends invalid; a request that already has a final outcome returns it
(for a single-SKU reserve, the reservation statement itself answers that); a busy lease hands a
reservation to its holder or retries later with jittered backoff (never blocking the worker); lost
ownership ends the attempt and its lease for good and drives the request again in a new epoch, a bounded
number of times, then dead-letters it; an unreachable Redis or database retries with backoff, then
dead-letters. The final outcome is written once, by idempotency key, with the request's fingerprint.
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
    LeaseLost,
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
    messages,
)
from reservations import validation as valid
from reservations.messages import Message
from reservations.requests import AlreadyApplied, RequestReply, RequestResult, task_name
from reservations.statuses import SUCCEEDED, AttemptResult, RequestStatus
from tasks.app import app, settings_of
from tasks.failpoints import failpoint
from tasks.worker import Resources, resources, worker_identity

log = logging.getLogger("tasks")

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
Run = Callable[[Inventory, dict[str, Lease], dict[str, Any], int], RequestReply]


_rng = random.Random()


def _printable(error: BaseException, limit: int = 500) -> str:
    """An error as stored free text: a database's message may carry newlines or tabs, which the attempt
    log refuses (it is printed by the CLI)."""
    return "".join(ch if ch.isprintable() else " " for ch in str(error))[:limit]


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


def _answer(task: Task, message: Message, stored: RequestResult) -> dict[str, Any]:
    """What this message's sender is told about the outcome stored under its key: that outcome if it is
    this request's, else a conflict (and the key's Celery result is left to the request that owns it)."""
    if stored.belongs_to(message.operation, message.fingerprint):
        return _as_result(stored)
    return _conflict(task, message, stored.operation, "names")


def _conflict(task: Task, message: Message, other: str, how: str) -> dict[str, Any]:
    """The answer to a message whose key belongs to a different ``other`` request. Not stored as the
    key's Celery result, which stays the owning request's."""
    task.request.ignore_result = True
    return {
        "key": message.key,
        "operation": message.operation,
        "status": RequestStatus.INVALID,
        "epochs": message.counts["epoch"],
        "detail": {
            "error": "IdempotencyConflict",
            "message": f"idempotency key {message.key!r} {how} a different {other} request",
            "stored_operation": other,
        },
    }


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


@dataclass(frozen=True)
class Work:
    """What a checked message does: the SKUs whose leases it takes, the fenced operation under them, and
    (for a single-SKU reservation) how a busy lease's holder can serve it instead."""

    skus: Callable[[Resources], list[str]]
    apply: Apply
    batch: Batchable | None = None
    # A request whose run also writes its own attempt and outcome (one statement on PostgreSQL); it
    # answers a request that already ended too, so no separate look at the outcome comes first.
    run: Run | None = None


def _work_of(message: Message) -> Work:
    args, key = message.args, message.key
    if message.name == "reserve":
        sku, quantity, hold_for = args["sku"], args["quantity"], args["hold_for"]
        return Work(
            lambda _: [sku],
            lambda inv, leases: inv.reserve(leases[sku], sku, quantity, key=key, hold_for=hold_for),
            Batchable(sku, quantity, hold_for),
            lambda inv, leases, who, epochs: inv.reserve_request(
                leases[sku], sku, quantity, key=key, hold_for=hold_for, epochs=epochs, **who
            ),
        )
    if message.name == "reserve_order":
        lines = args["lines"]
        return Work(
            lambda _: [sku for sku, _ in lines],
            lambda inv, leases: inv.reserve_many(leases, lines, key=key, hold_for=args["hold_for"]),
        )
    if message.name == "restock":
        sku, quantity = args["sku"], args["quantity"]
        return Work(lambda _: [sku], lambda inv, leases: inv.restock(leases[sku], sku, quantity, key=key))
    reservation_id = args["reservation_id"]

    def apply(inv: Inventory, leases: dict[str, Lease]) -> Outcome:
        (lease,) = leases.values()
        finish = inv.confirm if message.name == "confirm" else inv.release
        return finish(lease, reservation_id, key=key)

    return Work(lambda res: [res.inventory.reservation(reservation_id).sku], apply)


def _counter(kwargs: dict[str, Any], name: str) -> int:
    value = kwargs.get(name, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def run_request(task: Task, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One attempt at a request; returns its final outcome (or "queued", not stored, for a request queued
    for its SKU's lease holder: the server of its batch writes its result) or raises Celery's Retry.

    The message is checked before anything else; a message that can never succeed ends ``invalid``.
    Three separate counters travel with the message: ``epoch`` (attempts that lost ownership), ``busy``
    (lease-busy retries) and ``transient`` (unreachable backend), so one kind of retry never uses up
    another's budget. Every way out but a retry records the request's final outcome.
    """
    res = resources(settings_of(app))
    settings = res.settings
    sent = dict(task.request.kwargs or {})
    transient = _counter(sent, "transient")
    who = {"task_id": task.request.id, "worker": worker_identity()}
    operation = messages.SHAPES[name].operation

    def again(counter: str, countdown: float) -> Exception:
        return task.retry(kwargs={**sent, counter: _counter(sent, counter) + 1}, countdown=countdown)  # type: ignore[no-any-return]

    message: Message | None = None
    try:
        try:
            message = messages.parse(name, args, kwargs)
        except messages.InvalidMessage as exc:
            if exc.key is None:  # nowhere to record it by key: the Celery result carries it
                return {
                    "key": None,
                    "operation": operation,
                    "status": RequestStatus.INVALID,
                    "detail": {"error": "InvalidRequest", "message": str(exc)},
                    "epochs": 0,
                }
            stored = res.inventory.record_outcome(
                exc.key,
                operation,
                RequestStatus.INVALID,
                {"error": "InvalidRequest", "message": str(exc)},
                fingerprint=exc.fingerprint,
                **who,
            )
            return _as_result(stored)
        if transient > settings.max_transient_retries:
            return _give_up(task, res, message, who, "the backend stayed unreachable")
        work = _work_of(message)
        return _attempt(task, res, message, work, work.batch if settings.batching else None, again, who)
    except AlreadyApplied:
        # A copy of this request (or another request under its key) decided it while this one was giving
        # up: look again and report that.
        raise task.retry(kwargs=sent, countdown=0.01) from None
    except BackendUnavailable as exc:
        # Also covers an outcome or attempt that could not be recorded: nothing is final until it is.
        if message is None:
            # A refusal that could not be recorded yet: the same message comes back (its counters are not
            # trusted, so none is touched) until the database answers.
            raise task.retry(kwargs=sent, countdown=_rng.uniform(1.0, 30.0)) from None
        if transient >= settings.max_transient_retries:
            log.error("giving up on %s after %d transient failures: %s", message.key, transient, exc)
            try:
                return _give_up(task, res, message, who, str(exc))
            except BackendUnavailable:
                # Not even the dead letter can be written: keep coming back at the slowest pace until it
                # can, so the request still ends with an outcome once the database answers.
                sent["transient"] = settings.max_transient_retries + 1
                raise task.retry(kwargs=sent, countdown=_rng.uniform(15.0, 30.0)) from None
        # Its own backoff, growing to half a minute: a database restart or a Redis failover takes that long.
        ceiling = min(30.0, 0.2 * 2**transient)
        raise again("transient", _rng.uniform(ceiling / 2, ceiling)) from None
    except Exception as exc:
        if isinstance(exc, Retry):
            raise
        # A bug or an unforeseen input must still end the request, or its caller waits forever.
        key = message.key if message is not None else sent.get("idempotency_key")
        log.exception("request %s failed unexpectedly", key)
        if message is not None:
            with suppress(Exception):
                res.inventory.record_outcome(
                    message.key,
                    message.operation,
                    RequestStatus.DEAD_LETTERED,
                    {"reason": "unexpected error", "error": repr(exc)[:500]},
                    epochs=message.counts["epoch"],
                    fingerprint=message.fingerprint,
                    **who,
                )
        raise


def _give_up(
    task: Task, res: Resources, message: Message, who: dict[str, Any], error: str
) -> dict[str, Any]:
    """Dead-letter a request whose backend stayed unreachable through every transient retry."""
    stored = res.inventory.record_outcome(
        message.key,
        message.operation,
        RequestStatus.DEAD_LETTERED,
        {"reason": "backend unavailable", "error": error[:500]},
        epochs=message.counts["epoch"],
        fingerprint=message.fingerprint,
        **who,
    )
    return _answer(task, message, stored)


def _lost_with_the_lease(leases: dict[str, Lease], exc: BackendUnavailable) -> LeaseLost | None:
    """A database error after the lease ran out is lost ownership, not a passing outage: the database
    ends a transaction left idle past the lease ttl (a frozen or cut-off worker), so the rows it locked
    go to the next holder instead of waiting for the pause to end."""
    for lease in leases.values():
        if lease.lost or lease.time_left() <= 0:
            return LeaseLost(
                scope=lease.scope,
                token=lease.token,
                lease_id=lease.lease_id,
                reason=f"the database ended the transaction after the lease ran out: {exc}",
            )
    return None


def _attempt(
    task: Task,
    res: Resources,
    message: Message,
    work: Work,
    batch: Batchable | None,
    again: Callable[[str, float], Exception],
    who: dict[str, Any],
) -> dict[str, Any]:
    settings = res.settings
    key, operation = message.key, message.operation
    epoch = message.counts["epoch"]

    def final(status: str, detail: dict[str, Any]) -> dict[str, Any]:
        stored = res.inventory.record_outcome(
            key, operation, status, detail, epochs=epoch, fingerprint=message.fingerprint, **who
        )
        return _answer(task, message, stored)

    lease_token: int | None = None
    leases: dict[str, Lease] = {}
    try:
        if work.run is None:
            done = res.inventory.request_outcome(key)
            if done is not None:
                return _answer(task, message, done)
        with res.inventory.hold_many(
            res.leases,
            work.skus(res),
            ttl=settings.lease_ttl,
            holder=f"{who['worker']}:{who['task_id']}",
            renew_every=settings.lease_renew_every,
        ) as leases:
            lease_token = max((lease.token for lease in leases.values()), default=None)
            failpoint("before_write")
            try:
                if work.run is not None:
                    reply = work.run(res.inventory, leases, who, epoch)
                else:
                    outcome = work.apply(res.inventory, leases)
            except BackendUnavailable as exc:
                lost = _lost_with_the_lease(leases, exc)
                if lost is None:
                    raise
                raise lost from exc
            failpoint("after_write")
        if work.run is not None:
            return _then_serve(res, batch, leases, who, _answer(task, message, reply.result))
        res.inventory.record_attempt(
            key, operation, AttemptResult.REPLAYED if outcome.replayed else AttemptResult.APPLIED,
            token=outcome.token, **who,
        )  # fmt: skip
        return _then_serve(res, batch, leases, who, final(SUCCEEDED[operation], outcome.summary()))
    except InsufficientStock as exc:
        return _then_serve(res, batch, leases, who, final(RequestStatus.INSUFFICIENT_STOCK, exc.summary()))
    except _INVALID as exc:
        # A conflict is recorded only where the key has no outcome yet (its record was purged); otherwise
        # the stored outcome, which belongs to the other request, comes back and the answer says so.
        return final(RequestStatus.INVALID, {"error": type(exc).__name__, "message": str(exc)})
    except LeaseBusy as busy:
        if batch is not None:
            return _wait_for_holder(task, res, message, batch, who)
        if work.run is not None:  # it did not look before taking the lease: a copy may have ended it
            done = res.inventory.request_outcome(key)
            if done is not None:
                return _answer(task, message, done)
        if message.counts["busy"] >= settings.max_retries:
            return final(RequestStatus.DEAD_LETTERED, {"reason": "lease busy", "holder": busy.holder})
        raise again("busy", _jitter(busy.retry_after, message.counts["busy"])) from None
    except LostOwnership as lost:
        # Terminal for this attempt and its lease: nothing more happens under it. The request itself
        # goes back to coordination: a new task run takes a new lease, and the idempotency key keeps an
        # effect that already landed from being applied twice.
        log.warning(
            "lost ownership of %s (token %s) in task %s on %s: %s",
            lost.scope,
            lost.token,
            who["task_id"],
            who["worker"],
            lost,
        )
        res.inventory.record_attempt(
            key, operation, AttemptResult.LOST_OWNERSHIP,
            token=lost.token or lease_token, detail=_printable(lost), **who,
        )  # fmt: skip
        if epoch + 1 >= settings.max_epochs:
            reason = f"lost ownership {epoch + 1} times"
            return final(RequestStatus.DEAD_LETTERED, {"reason": reason, "last": str(lost)})
        raise again("epoch", _jitter(0.01, epoch)) from None


def _wait_for_holder(
    task: Task, res: Resources, message: Message, batch: Batchable, who: dict[str, Any]
) -> dict[str, Any]:
    """The lease is busy: queue the request for the holder instead of spinning on the lease.

    The task then ends at once, returning "queued" without storing it: whoever serves the request writes
    its outcome row and its Celery result. The first request to wait on the SKU also schedules a watch
    of the SKU's queue, which serves it once the lease is free if the holder died.
    """
    settings = res.settings
    key, epoch = message.key, message.counts["epoch"]
    queued = res.inventory.hand_off(
        batch.sku, batch.quantity, key=key, hold_for=batch.hold_for, task_id=who["task_id"], epochs=epoch
    )
    if queued.outcome is not None:
        return _answer(task, message, queued.outcome)
    if queued.conflict:
        # Its key waits in the queue as a different request: that one is served, this one conflicts.
        return _conflict(task, message, "reserve", "is queued for")
    if queued.first:
        try:
            watch_waiting.apply_async(args=[batch.sku], countdown=settings.handoff_check)
        except Exception as exc:  # the request is queued: the holder or the beat sweep still serve it
            log.warning("could not schedule the watch of %s: %s", batch.sku, exc)
    # Served nothing: the lease is busy, and its holder looks at the queue again after releasing.
    if _serve_quietly(res, batch.sku, known_waiting=True, **who):
        done = res.inventory.request_outcome(key)
        if done is not None:
            return _answer(task, message, done)
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
    res: Resources,
    batch: Batchable | None,
    leases: dict[str, Lease],
    who: dict[str, Any],
    result: dict[str, Any],
) -> dict[str, Any]:
    """After a batchable request ran under its own lease: serve whatever queued up meanwhile.

    A request queues itself only after finding the lease busy, and then tries the lease once more, so
    a release that reports nobody turned away (``contended`` False) means nobody queued behind it: the
    look at the queue, a round trip per task, is skipped. Any doubt (a lost lease, an older lease
    record) looks.
    """
    wanted = not leases or any(lease.contended is not False for lease in leases.values())
    if batch is not None and wanted:
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
    A queue emptied under a lease that nobody was turned away from needs no second look.
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
                drained = False
                for _ in range(BATCHES_PER_LEASE):
                    failpoint("before_write")
                    outcomes = res.inventory.serve_pending(
                        lease, sku, limit=settings.batch_size, task_id=task_id, worker=worker
                    )
                    failpoint("after_write")
                    _publish(outcomes)
                    served += len(outcomes)
                    if not outcomes:
                        drained = True
                        break
            if drained and lease.contended is False:
                break  # emptied under the lease, and nobody was turned away from it since
        except LeaseBusy:
            break  # its holder looks again after releasing
        except LostOwnership as lost:
            # Terminal for this lease: the batch rolled back and its requests stay queued for the next
            # holder or the watch.
            log.warning("lost ownership of %s while serving pending reservations: %s", sku, lost)
            break
    return served


# The request tasks take their arguments as sent and check them in :func:`messages.parse`, so that a
# malformed message (a missing or unknown argument, a bad retry counter) still ends with a recorded
# outcome instead of a TypeError before any code of ours runs. Parameters, in positional order:
# reserve(sku, quantity, idempotency_key, hold_for=None); reserve_order(lines, idempotency_key,
# hold_for=None); confirm / release(reservation_id, idempotency_key); restock(sku, quantity,
# idempotency_key).


@app.task(bind=True, max_retries=None, typing=False, name=task_name("reserve"))
def reserve(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "reserve", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("reserve_order"))
def reserve_order(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "reserve_order", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("confirm"))
def confirm(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "confirm", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("release"))
def release(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "release", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("restock"))
def restock(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "restock", args, kwargs)


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


@app.task(bind=True, ignore_result=True, typing=False, name=task_name("watch_waiting"))
def watch_waiting(self: Task, sku: object, round_: object = 0) -> None:
    """Looks after one SKU's queue until it is empty, sooner first, then up to a lease ttl apart: serves it
    whenever the lease is free. The request that found the queue empty scheduled it; it is what serves a
    queue whose holder died when no new request of the SKU comes along."""
    res = resources(settings_of(app))
    settings = res.settings
    try:
        sku = valid.sku(sku)
    except InvalidRequest as exc:  # no queue can exist for it: watching again would fail the same way
        log.error("not watching a queue for a malformed SKU: %s", exc)
        return
    if isinstance(round_, bool) or not isinstance(round_, int) or not 0 <= round_ <= settings.max_retries:
        log.error("not watching the queue of %s: round %r is not a whole number from 0", sku, round_)
        return
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
