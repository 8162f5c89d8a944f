"""The reservation tasks: each request task checks its message, then makes one attempt at it
(:class:`tasks.attempt.Attempt`) and gives the request one outcome.

A request that already has a final outcome returns it (for a single-SKU reserve, the reservation
statement itself answers that); what each error leads to is the table in :mod:`tasks.policy`, applied by
the attempt's steps and, for what ends a request task whatever the attempt was doing, by :func:`_ended`.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from fencing import BackendUnavailable, LeaseBusy, LostOwnership
from reservations import InvalidRequest
from reservations import validation as valid
from reservations.archive import prepare_partitions
from reservations.request_outcomes import AlreadyApplied
from reservations.statuses import RequestStatus
from tasks import logs, messages, metrics, policy, tracing
from tasks.answers import RequestTask, as_result, reply
from tasks.app import app
from tasks.attempt import Attempt
from tasks.hot_sku import serve_pending, serve_quietly
from tasks.messages import task_name
from tasks.producer import request_of
from tasks.settings import settings_of
from tasks.worker import Resources, Unbuildable, resources, worker_identity

log = logging.getLogger("tasks")


def run_request(task: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The request task of every request type (its task's name says which): one attempt at the request
    the message carries, checked before anything else; returns its final outcome (or "queued", not stored,
    for a request queued for its SKU's lease holder: the server of its batch writes its result) or raises
    Celery's Retry. Every way out but a retry records the request's final outcome.
    """
    # Every line logged while it runs (in fencing too) names the task, its worker, the key and epoch, and
    # the trace its sender handed on (tasks.tracing): the worker's own span under the sender's.
    name = task.name.removeprefix(task_name(""))  # the request type
    sender = getattr(task.request, messages.TRACE, None)
    with (
        tracing.hop(task.name, sender, kind="consumer") as trace,
        logs.bound(task_id=task.request.id, worker=worker_identity(), **trace.fields()),
    ):
        sent = dict(task.request.kwargs or {})
        attempt: Attempt | None = None
        try:
            try:
                res = _resources_or_keep(task, sent)
                message_format = messages.format_of(task.request)
                try:  # a message that can never succeed (or never on this worker: a newer format) ends here
                    checked = messages.parse(name, args, kwargs, message_format=message_format)
                except messages.InvalidMessage as invalid:
                    result = _refused(task, res, invalid, messages.SHAPES[name].operation)
                else:
                    attempt = Attempt(task, res, checked, sent)
                    logs.note(key=checked.key, operation=checked.operation, epoch=checked.counts["epoch"])
                    result = attempt.carry_out()
            except (Retry, Reject, Ignore):
                raise
            except Exception as exc:
                result = _ended(task, sent, attempt, exc)
        except Reject as refused:  # a retry the broker refused to take, whichever step sent it
            if refused.requeue:
                raise
            _kept(task, name, refused)
    metrics.finished(task.request, result)
    return result


def _kept(task: Task, name: str, refused: Reject) -> NoReturn:
    """Celery could not publish this request's retry (the broker refused it: an ACL, ``maxmemory``, no
    connection) and raised ``Reject(requeue=False)``, which acks the message with no outcome. Instead the
    request's record is kept for the relay, which publishes it again once the broker takes it (or ends
    it at its deadline or its publication cap), and only then is the message let go. Where even that
    cannot be written, the message is handed back to the broker (requeued), or left unacknowledged for
    the visibility timeout where the broker refuses that too."""
    sent = dict(task.request.kwargs or {})
    try:
        key = sent.get("idempotency_key")
        deadline = messages.deadline_of(getattr(task.request, messages.DEADLINE, None), key=key)
        request = request_of(
            name, valid.idempotency_key(key), messages.request_arguments(sent), deadline=deadline
        )
        res = resources(settings_of(app))
        res.inventory.keep(request, res.settings.republish_after)
    except Exception as exc:
        log.error(
            "the retry of %s was refused (%s) and its record could not be kept: %s; handing it back",
            sent.get("idempotency_key"), refused.reason, exc, extra={"event": "retry_refused"},
        )
        raise Reject(exc, requeue=True) from exc
    log.warning(
        "the retry of %s was refused (%s): its record is kept, the relay publishes it again",
        request.key, refused.reason, extra={"event": "retry_refused", "key": request.key},
    )
    raise Ignore()


def _refused(task: Task, res: Resources, exc: messages.InvalidMessage, operation: str) -> dict[str, Any]:
    """A message that can never succeed ends ``invalid`` (one of a format this worker does not know ends
    dead-lettered, to be driven again), recorded under its key when it has one."""
    refusal = exc.detail()
    if exc.status == RequestStatus.DEAD_LETTERED:
        log.warning(
            "request %s dead-lettered: %s", exc.key, exc, extra={"event": "unknown_format", "key": exc.key}
        )
    if exc.key is None:  # nowhere to record it by key: the Celery result carries it
        return reply(exc.status, 0, None, operation, refusal)
    who = {"task_id": task.request.id, "worker": worker_identity()}
    stored = res.inventory.record_outcome(
        exc.key, operation, exc.status, refusal, fingerprint=exc.fingerprint, **who
    )
    return as_result(stored)


def _ended(task: Task, sent: dict[str, Any], attempt: Attempt | None, exc: Exception) -> dict[str, Any]:
    """Where every error that escaped a request task's steps leads: a retry, a final outcome, or (a bug)
    a dead letter and the error raised. ``attempt`` is None while the message is not checked yet."""
    if isinstance(exc, AlreadyApplied):
        # A copy of this request (or another request under its key) decided it while this one was giving
        # up: look again and report that.
        raise task.retry(kwargs=sent, countdown=0.01) from None
    if isinstance(exc, Unbuildable):
        if attempt is None:
            raise exc
        # The lease client cannot be built in this process although the settings passed at start: no
        # attempt can take a lease, so the request ends with the reason rather than without an outcome.
        return attempt.give_up({"reason": f"{exc.backend} client cannot be built", "error": str(exc)[:500]})
    if isinstance(exc, BackendUnavailable):
        if attempt is None:
            # A refusal that could not be recorded yet: the same message comes back (its counters are not
            # trusted, so none is touched) until the database answers.
            raise task.retry(kwargs=sent, countdown=policy.rng.uniform(1.0, 30.0)) from None
        return attempt.after(exc)
    # A bug or an unforeseen input must still end the request, or its caller waits forever.
    key = attempt.message.key if attempt is not None else sent.get("idempotency_key")
    log.exception("request %s failed unexpectedly", key, extra={"event": "unexpected_error", "key": key})
    if attempt is not None:
        attempt.failed(exc)
    raise exc


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


# The request tasks take their arguments as sent and check them in :func:`messages.parse`, so that a
# malformed message (a missing or unknown argument, a bad retry counter) still ends with a recorded
# outcome instead of a TypeError before any code of ours runs. Each is :func:`run_request` itself, under
# its request type's name; :data:`messages.SHAPES` lists each one's parameters in positional order.


def _request_task(name: str) -> Task:
    return app.task(bind=True, max_retries=None, typing=False, name=task_name(name), base=RequestTask)(
        run_request
    )


reserve = _request_task("reserve")
reserve_order = _request_task("reserve_order")
confirm = _request_task("confirm")
release = _request_task("release")
restock = _request_task("restock")
count = _request_task("count")
replenish = _request_task("replenish")


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
