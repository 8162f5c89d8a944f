"""The reservation tasks: take the SKU leases, run the fenced operation, give every request one outcome.

A request that already has a final outcome returns it (for a single-SKU reserve, the reservation
statement itself answers that); what each error leads to is the table in :mod:`tasks.policy`. The final
outcome is written once, by idempotency key, with the request's fingerprint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from celery import Task
from celery.exceptions import Retry

from fencing import (
    BackendUnavailable,
    Lease,
    LeaseBusy,
    LostOwnership,
)
from reservations import (
    InsufficientStock,
    InvalidRequest,
    messages,
)
from reservations import validation as valid
from reservations.messages import Message
from reservations.partitions import prepare_partitions
from reservations.redrives import carried_request
from reservations.requests import AlreadyApplied, task_name
from reservations.statuses import SUCCEEDED, AttemptResult, RequestStatus
from tasks import deadlines, failpoints, logs, metrics, observe, policy
from tasks.answers import answer, as_result, reply
from tasks.app import app, settings_of
from tasks.failpoints import failpoint
from tasks.serving import Batchable, serve_pending, serve_quietly, then_serve, wait_for_holder
from tasks.states import Redriven, RequestTask, announce_lost
from tasks.work import Work, work_of
from tasks.worker import Resources, Unbuildable, resources, worker_identity

log = logging.getLogger("tasks")


def run_request(task: Task, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    # Every line logged while it runs (in fencing too) names the task, its worker, the key and epoch.
    with logs.bound(task_id=task.request.id, worker=worker_identity()):
        result = _run_request(task, name, args, kwargs)
    observe.finished(task.request, result)
    return result


def _run_request(task: Task, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One attempt at a request; returns its final outcome (or "queued", not stored, for a request queued
    for its SKU's lease holder: the server of its batch writes its result) or raises Celery's Retry.

    The message is checked before anything else; a message that can never succeed ends ``invalid``.
    Three separate counters travel with the message: ``epoch`` (attempts that lost ownership), ``busy``
    (lease-busy retries) and ``transient`` (unreachable backend), so one kind of retry never uses up
    another's budget. Every way out but a retry records the request's final outcome.
    """
    sent = dict(task.request.kwargs or {})
    res = _resources_or_keep(task, sent)
    settings = res.settings
    transient = policy.counter(sent, "transient")
    who = {"task_id": task.request.id, "worker": worker_identity()}
    operation = messages.SHAPES[name].operation

    def again(counter: str, countdown: float, reason: Exception | None = None) -> Exception:
        kwargs = {**sent, counter: policy.counter(sent, counter) + 1}
        return task.retry(kwargs=kwargs, countdown=countdown, exc=reason)  # type: ignore[no-any-return]

    message: Message | None = None
    try:
        try:
            message = messages.parse(name, args, kwargs)
        except messages.InvalidMessage as exc:
            if exc.key is None:  # nowhere to record it by key: the Celery result carries it
                invalid = {"error": "InvalidRequest", "message": str(exc)}
                return reply(RequestStatus.INVALID, 0, None, operation, invalid)
            stored = res.inventory.record_outcome(
                exc.key,
                operation,
                RequestStatus.INVALID,
                {"error": "InvalidRequest", "message": str(exc)},
                fingerprint=exc.fingerprint,
                **who,
            )
            return as_result(stored)
        logs.note(key=message.key, operation=message.operation, epoch=message.counts["epoch"])
        if transient > settings.max_transient_retries:
            return _give_up(task, res, message, who, "backend unavailable", "the backend stayed unreachable")
        # Past its deadline it ends expired, unattempted (a reservation queued for its SKU's lease holder
        # is later served without this check).
        expired = _past_deadline(task, res, message, who)
        work = work_of(message)
        batch = work.batch if settings.batching else None
        return expired if expired is not None else _attempt(task, res, message, work, batch, again, who)
    except AlreadyApplied:
        # A copy of this request (or another request under its key) decided it while this one was giving
        # up: look again and report that.
        raise task.retry(kwargs=sent, countdown=0.01) from None
    except Unbuildable as exc:
        # The lease client cannot be built in this process although the settings passed at start: no
        # attempt can take a lease, so the request ends with the reason rather than without an outcome.
        if message is None:
            raise
        return _give_up(task, res, message, who, f"{exc.backend} client cannot be built", str(exc))
    except BackendUnavailable as exc:
        # Also covers an outcome or attempt that could not be recorded: nothing is final until it is.
        if message is None:
            # A refusal that could not be recorded yet: the same message comes back (its counters are not
            # trusted, so none is touched) until the database answers.
            raise task.retry(kwargs=sent, countdown=policy.rng.uniform(1.0, 30.0)) from None
        if transient >= settings.max_transient_retries:
            log.error("giving up on %s after %d transient failures: %s", message.key, transient, exc)
            try:
                return _give_up(task, res, message, who, "backend unavailable", str(exc))
            except BackendUnavailable:
                # Not even the dead letter can be written: keep coming back at the slowest pace until it
                # can, so the request still ends with an outcome once the database answers.
                sent["transient"] = settings.max_transient_retries + 1
                raise task.retry(kwargs=sent, countdown=policy.rng.uniform(15.0, 30.0)) from None
        metrics.current.transient(exc.backend)
        # Its own backoff, growing to half a minute: a database restart or a Redis failover takes that long.
        ceiling = min(30.0, 0.2 * 2**transient)
        raise again("transient", policy.rng.uniform(ceiling / 2, ceiling), None) from None
    except Exception as exc:
        if isinstance(exc, Retry):
            raise
        # A bug or an unforeseen input must still end the request, or its caller waits forever.
        key = message.key if message is not None else sent.get("idempotency_key")
        log.exception("request %s failed unexpectedly", key, extra={"event": "unexpected_error", "key": key})
        if message is not None:
            with suppress(Exception):
                res.inventory.record_outcome(
                    message.key,
                    message.operation,
                    RequestStatus.DEAD_LETTERED,
                    _dead_letter(message, {"reason": "unexpected error", "error": repr(exc)[:500]}),
                    epochs=message.counts["epoch"],
                    fingerprint=message.fingerprint,
                    **who,
                )
        raise


def _resources_or_keep(task: Task, sent: dict[str, Any]) -> Resources:
    """This process's clients; when the database's cannot be built no outcome can be recorded, so the
    request stays a message and comes back to this or another worker until one can record it (acking it
    now would lose it unanswered)."""
    try:
        return resources(settings_of(app))
    except Unbuildable as exc:
        key = sent.get("idempotency_key")
        log.error("%s; request %s kept for a later attempt", exc, key, extra={"event": "client_unbuildable"})
        raise task.retry(kwargs=sent, countdown=policy.rng.uniform(1.0, 5.0)) from None


def _give_up(
    task: Task, res: Resources, message: Message, who: dict[str, Any], reason: str, error: str
) -> dict[str, Any]:
    """Dead-letter a request that cannot be carried out: its backend stayed unreachable through every
    transient retry, or its lease client cannot be built."""
    observe.dead_lettered(message, f"{reason}: {error[:200]}", who)
    stored = res.inventory.record_outcome(
        message.key,
        message.operation,
        RequestStatus.DEAD_LETTERED,
        _dead_letter(message, {"reason": reason, "error": error[:500]}),
        epochs=message.counts["epoch"],
        fingerprint=message.fingerprint,
        **who,
    )
    return answer(task, message, stored)


def _past_deadline(
    task: Task, res: Resources, message: Message, who: dict[str, Any]
) -> dict[str, Any] | None:
    """End a request taken up after its deadline ``expired``, taking no lease and touching no stock; the
    answer is the key's stored outcome (a copy may have decided it first). None: carry it out. A
    reservation handed to its SKU's lease holder (hot-SKU batching) is served without this check."""
    late = deadlines.late(getattr(task.request, deadlines.DEADLINE, None), key=message.key)
    if late is None:
        return None
    key, op, print_ = message.key, message.operation, message.fingerprint
    try:
        stored = res.inventory.record_outcome(
            key,
            op,
            RequestStatus.EXPIRED,
            late.detail(),
            epochs=message.counts["epoch"],
            fingerprint=print_,
            **who,
        )
    except AlreadyApplied:  # a copy applied it and stopped before its outcome: the attempt replays it
        return None
    if stored.status == RequestStatus.EXPIRED and stored.belongs_to(op, print_):
        res.inventory.record_attempt(key, op, AttemptResult.EXPIRED, detail=late.describe(), **who)
    return answer(task, message, stored)


def _dead_letter(message: Message, detail: dict[str, Any]) -> dict[str, Any]:
    """A dead letter's detail: why, and the request it carried (its type and checked arguments), so an
    operator can drive it again once the cause is gone (reservations.redrives)."""
    return {**detail, "request": carried_request(message.name, message.args)}


def _attempt(
    task: Task,
    res: Resources,
    message: Message,
    work: Work,
    batch: Batchable | None,
    again: Again,
    who: dict[str, Any],
) -> dict[str, Any]:
    settings = res.settings
    key, operation = message.key, message.operation
    epoch = message.counts["epoch"]

    def final(status: str, detail: dict[str, Any]) -> dict[str, Any]:
        stored = res.inventory.record_outcome(
            key, operation, status, detail, epochs=epoch, fingerprint=message.fingerprint, **who
        )
        return answer(task, message, stored)

    lease_token: int | None = None
    leases: dict[str, Lease] = {}
    try:
        if work.run is None:
            done = res.inventory.request_outcome(key)
            if done is not None:
                return answer(task, message, done)
        with res.inventory.hold_many(
            res.leases,
            work.skus(res),
            ttl=settings.lease_ttl,
            holder=f"{who['worker']}:{who['task_id']}",
            renew_every=failpoints.renew_every(settings.lease_renew_every),
        ) as leases:
            lease_token = max((lease.token for lease in leases.values()), default=None)
            metrics.current.lease("acquired", len(leases))
            try:
                # A count or a replenishment reads under its leases here and decides its write, so a
                # worker paused at the failpoint writes a figure decided before its pause.
                apply = work.decided(res.inventory, leases)
                failpoint("before_write")
                if work.run is not None:
                    reply = work.run(res.inventory, leases, who, epoch)
                else:
                    outcome = apply(res.inventory, leases)
            except BackendUnavailable as exc:
                lost = policy.lost_with_the_lease(leases, exc)
                if lost is None:
                    raise
                raise lost from exc
            failpoint("after_write")
        if work.run is not None:
            return then_serve(res, batch, leases, who, answer(task, message, reply.result))
        res.inventory.record_attempt(
            key, operation, AttemptResult.REPLAYED if outcome.replayed else AttemptResult.APPLIED,
            token=outcome.token, **who,
        )  # fmt: skip
        return then_serve(res, batch, leases, who, final(SUCCEEDED[operation], outcome.summary()))
    except InsufficientStock as exc:
        return then_serve(res, batch, leases, who, final(RequestStatus.INSUFFICIENT_STOCK, exc.summary()))
    except policy.INVALID as exc:
        # A conflict is recorded only where the key has no outcome yet (its record was purged); otherwise
        # the stored outcome, which belongs to the other request, comes back and the answer says so.
        return final(RequestStatus.INVALID, {"error": type(exc).__name__, "message": str(exc)})
    except LeaseBusy as busy:
        metrics.current.lease("busy")
        if batch is not None:
            return wait_for_holder(task, res, message, batch, who)
        return _busy(task, res, message, work, busy, final, again, who)
    except LostOwnership as lost:
        return _lost(task, res, message, lost, lease_token, final, again, who)


Final = Callable[[str, dict[str, Any]], dict[str, Any]]
Again = Callable[[str, float, Exception | None], Exception]


def _busy(
    task: Task,
    res: Resources,
    message: Message,
    work: Work,
    busy: LeaseBusy,
    final: Final,
    again: Again,
    who: dict[str, Any],
) -> dict[str, Any]:
    """A lease found busy by a request that cannot wait for its holder: retry later, within a budget."""
    if work.run is not None:  # it did not look before taking the lease: a copy may have ended it
        done = res.inventory.request_outcome(message.key)
        if done is not None:
            return answer(task, message, done)
    if message.counts["busy"] >= res.settings.max_retries:
        observe.dead_lettered(message, "lease busy", who, **observe.busy_facts(busy))
        return final(
            RequestStatus.DEAD_LETTERED,
            _dead_letter(message, {"reason": "lease busy", "holder": busy.holder}),
        )
    raise again("busy", policy.jitter(busy.retry_after, message.counts["busy"]), None) from None


def _lost(
    task: Task,
    res: Resources,
    message: Message,
    lost: LostOwnership,
    lease_token: int | None,
    final: Final,
    again: Again,
    who: dict[str, Any],
) -> dict[str, Any]:
    """Terminal for this attempt and its lease: nothing more happens under it. The request itself goes
    back to coordination: a new task run takes a new lease, and the idempotency key keeps an effect that
    already landed from being applied twice."""
    key, operation, epoch = message.key, message.operation, message.counts["epoch"]
    fields = observe.lost_ownership(lost, lease_token, message, **who)
    res.inventory.record_attempt(
        key, operation, AttemptResult.LOST_OWNERSHIP,
        token=lost.token or lease_token, detail=policy.printable(lost), **who,
    )  # fmt: skip
    if epoch + 1 >= res.settings.max_epochs:
        reason = f"lost ownership {epoch + 1} times"
        observe.dead_lettered(message, reason, who, **_facts(fields))
        return final(
            RequestStatus.DEAD_LETTERED, _dead_letter(message, {"reason": reason, "last": str(lost)})
        )
    redriven = Redriven(f"{policy.printable(lost)}; driven again in epoch {epoch + 1}", fields)
    announce_lost(task, redriven)
    raise again("epoch", policy.jitter(0.01, epoch), redriven) from None


def _facts(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: fields[name] for name in ("scope", "token", "highest", "holder", "lease_id")}


# The request tasks take their arguments as sent and check them in :func:`messages.parse`, so that a
# malformed message (a missing or unknown argument, a bad retry counter) still ends with a recorded
# outcome instead of a TypeError before any code of ours runs. Parameters, in positional order:
# reserve(sku, quantity, idempotency_key, hold_for=None); reserve_order(lines, idempotency_key,
# hold_for=None); confirm / release(reservation_id, idempotency_key); restock(sku, quantity,
# idempotency_key); count(sku, counted, idempotency_key, shrinkage=None), with either counted or
# shrinkage; replenish(sku, par, idempotency_key).


@app.task(bind=True, max_retries=None, typing=False, name=task_name("reserve"), base=RequestTask)
def reserve(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "reserve", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("reserve_order"), base=RequestTask)
def reserve_order(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "reserve_order", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("confirm"), base=RequestTask)
def confirm(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "confirm", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("release"), base=RequestTask)
def release(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "release", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("restock"), base=RequestTask)
def restock(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return run_request(self, "restock", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("count"), base=RequestTask)
def count(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """A cycle count: reads the stock under the lease, then sets on hand to the counted figure (sent, or
    the figure read less the shrinkage sent)."""
    return run_request(self, "count", args, kwargs)


@app.task(bind=True, max_retries=None, typing=False, name=task_name("replenish"), base=RequestTask)
def replenish(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Replenishment to par: reads on hand under the lease, then books par minus what it read."""
    return run_request(self, "replenish", args, kwargs)


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
        served += serve_quietly(
            res, sku, task_id=self.request.id, worker=worker_identity(), known_waiting=True
        )
    return {"skus": skus, "served": served}


@app.task(name=task_name("purge"))
def purge() -> dict[str, int]:
    """Beat: apply the retention of idempotency records (keep it far above the redelivery horizon) and of
    SQL lease events, and drop queued requests that ended elsewhere; Redis lease streams are capped
    instead. On PostgreSQL, also make the history's day partitions of the coming week that are missing
    (hourly, so a day's partition exists days before its first write; one missed still only means rows
    in the DEFAULT partition)."""
    res = resources(settings_of(app))
    return {
        "history_partitions": len(prepare_partitions(res.inventory.executor.engine)),
        "idempotency_records": res.inventory.purge_idempotency(),
        "request_outcomes": res.inventory.purge_requests(),
        "ended_waits": res.inventory.purge_ended_waits(),
        "lease_events": res.leases.purge_history(),
    }


@app.task(name=task_name("noop"))
def noop(value: int = 0) -> int:
    """A task that does nothing: the baseline for end-to-end throughput benchmarks."""
    return value
