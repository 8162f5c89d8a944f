"""The hot-SKU protocol on the worker's side: a request that finds its SKU's lease busy queues itself for
the holder; whoever holds the lease serves the queue in batches, publishes each served request's result,
and looks again after releasing only when someone was turned away meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task, current_task, states
from celery.backends.redis import RedisBackend

from fencing import Lease, LeaseBusy, LostOwnership
from reservations import pending
from reservations import validation as valid
from reservations.batch_statement import InHand
from reservations.operations import hold_ms_of
from reservations.request_outcomes import RequestResult
from tasks import failpoints, metrics
from tasks.answers import QUEUED, announce, answer, as_result, conflict, reply
from tasks.app import app
from tasks.failpoints import failpoint
from tasks.local_servers import Joined, local_servers
from tasks.messages import Message, task_name
from tasks.settings import stores_request_results
from tasks.worker import Resources

log = logging.getLogger("tasks")

# A task serving a SKU's pending reservations gives up the lease after this many batches and takes it
# again (a new token) if the list is still not empty, at most this many times; the SKU's watch and the
# beat sweep look again, so a bound here never strands one.
BATCHES_PER_LEASE = 50
SERVE_ROUNDS = 20


def beside_local_server(
    task: Task, res: Resources, message: Message, who: dict[str, Any]
) -> dict[str, Any] | None:
    """A thread of this process serves the SKU: hand the request to it in memory (tasks.local_servers)
    and answer what its batch wrote. None: no thread serves the SKU, or the request came back unserved
    (its key had ended elsewhere, or the batch failed); it takes the usual way then."""
    args = message.args
    hold_ms = hold_ms_of(args["hold_for"])
    request = InHand(
        message.key, args["sku"], args["quantity"], hold_ms, who["task_id"], message.counts["epoch"]
    )
    joined = local_servers.join(request)
    if joined is None:
        return None
    # A batch answers within a round of statements; the bound is for a server that stopped taking its
    # queue, whose requests then take the usual way (a batch that has one answers it either way).
    wait = res.settings.lease_ttl
    if not joined.wait(wait) and (local_servers.withdraw(joined) or not joined.wait(wait)):
        return None
    if joined.result is None:
        return None
    if joined.stored:  # its batch stored its Celery result with the others'
        task.request.ignore_result = True
    return answer(task, message, joined.result)


def wait_for_holder(task: Task, res: Resources, message: Message, who: dict[str, Any]) -> dict[str, Any]:
    """The lease is busy: queue the request for the holder instead of spinning on the lease, schedule the
    SKU's watch if it is the first to wait, and end the task at once, returning "queued" without storing
    it (docs/architecture.md, "A hot SKU", steps 1, 4 and 6)."""
    settings = res.settings
    key, epoch, sku = message.key, message.counts["epoch"], message.args["sku"]
    queued = res.inventory.hand_off(
        sku, message.args["quantity"], key=key, hold_for=message.args["hold_for"], task_id=who["task_id"],
        epochs=epoch,
    )  # fmt: skip
    match queued:
        case pending.Ended(result):
            return answer(task, message, result)
        case pending.Conflicting():
            # Its key waits in the queue as a different request: that one is served, this one conflicts.
            return conflict(task, message, "reserve", "is queued for")
        case pending.Queued(first=True):
            try:
                app.send_task(
                    task_name("watch_waiting"),
                    args=[sku],
                    countdown=settings.handoff_check,
                    ignore_result=True,  # as the task itself: no result is awaited, none is subscribed to
                )
            except Exception as exc:  # the request is queued: the holder or the beat sweep still serve it
                log.warning("could not schedule the watch of %s: %s", sku, exc)
    # Served nothing: the lease is busy, and its holder looks at the queue again after releasing. A
    # thread of this process serving the SKU now serves this request before it stops (LocalServers);
    # otherwise the lease is tried once more, in case its holder released before the request was queued.
    if not local_servers.handed_off(sku) and serve_quietly(res, sku, known_waiting=True, **who):
        done = res.inventory.request_outcome(key)
        if done is not None:
            return answer(task, message, done)
    # Per-request ignore_result, read by Celery when it stores the return value: the server's result
    # for this task id must not be overwritten by "queued". (Raising Ignore does the same but costs a
    # formatted traceback per request.)
    task.request.ignore_result = True
    return reply(QUEUED, epoch, key, "reserve", {"sku": sku})


def serve_quietly(res: Resources, sku: str, **kwargs: Any) -> int:
    """:func:`serve_pending` for callers whose own work is done or queued: a failure is logged, never
    raised, because the SKU's holder, its watch or the beat sweep serve the queue anyway."""
    try:
        return serve_pending(res, sku, **kwargs)
    except Exception:
        log.exception("could not serve the queue of %s", sku)
        return 0


def store_results(outcomes: list[RequestResult]) -> bool:
    """Store a batch's Celery results in two round trips on a Redis result backend instead of two per
    request: a batch server stores them between two batches, so each round trip here delays the next.

    Celery's own rule is kept: a task id whose stored state is already SUCCESS is not overwritten (a
    copy of the request may have stored its answer). Each result is published on its key as Celery does,
    for ``AsyncResult.get`` waiting on it. Other backends, and a pipeline that failed, store one result
    at a time through Celery, with its retries.
    """
    if not outcomes:
        return True
    backend = app.backend
    if isinstance(backend, RedisBackend):
        try:
            _store_pipelined(backend, outcomes)
            return True
        except Exception as exc:  # one at a time below, each with Celery's retries
            log.warning("could not store %d Celery results at once: %s", len(outcomes), exc)
    stored = True
    for outcome in outcomes:
        try:
            backend.store_result(outcome.task_id, as_result(outcome), states.SUCCESS)
        except Exception as exc:  # the result backend is a convenience here, never the record
            log.warning("could not store the Celery result of %s: %s", outcome.key, exc)
            stored = False
    return stored


def _store_pipelined(backend: RedisBackend, outcomes: list[RequestResult]) -> None:
    keys = [backend.get_key_for_task(outcome.task_id) for outcome in outcomes]
    stored = backend.client.mget(keys)
    with backend.client.pipeline(transaction=False) as pipe:
        for key, raw, outcome in zip(keys, stored, outcomes, strict=True):
            if raw is not None and backend.decode_result(raw).get("status") == states.SUCCESS:
                continue
            # The same meta Celery's store_result writes for a result stored outside its task.
            meta = backend._get_result_meta(
                result=as_result(outcome), state=states.SUCCESS, traceback=None, request=None
            )
            meta["task_id"] = outcome.task_id
            value = backend.encode(meta)
            if backend.expires:
                pipe.setex(key, backend.expires, value)
            else:
                pipe.set(key, value)
            pipe.publish(key, value)
        pipe.execute()


def _batch(
    res: Resources, lease: Lease, sku: str, joined: list[Joined], task_id: str | None, worker: str
) -> list[RequestResult]:
    """One batch: the listed requests and those ``joined`` in memory; each joined request is then answered
    with its outcome, or given back unserved (no outcome for it, or the batch failed), and its own task
    returns the answer.

    Each served request's own Celery task gets its result as if it had run the request itself (where
    request tasks store theirs, ``RESERVATIONS_RESULT_EXPIRES``): the outcome rows are committed already,
    so a result lost here leaves only ``AsyncResult`` waiting. Only the listed ones are announced: a
    request joined in memory ends in its own task, and Celery announces that."""
    outcomes: list[RequestResult] = []
    stored = False
    try:
        failpoint("before_write")
        outcomes = res.inventory.serve_pending(
            lease,
            sku,
            limit=res.settings.batch_size,
            task_id=task_id,
            worker=worker,
            in_hand=[request.request for request in joined],
        )
        failpoint("after_write")
        handed = {(request.request.key, request.request.task_id) for request in joined}
        listed = [outcome for outcome in outcomes if (outcome.key, outcome.task_id) not in handed]
        metrics.served(listed)
        stored = stores_request_results(app) and store_results([o for o in outcomes if o.task_id])
        try:
            announce(app, listed, getattr(current_task.request, "hostname", None) if current_task else None)
        except Exception as exc:  # monitoring events are a convenience too
            log.warning("could not send the events of %d served requests: %s", len(listed), exc)
    finally:
        by_key = {outcome.key: outcome for outcome in outcomes}
        for request in joined:
            result = by_key.get(request.request.key)
            # Stored as this task's result only if written for this task (not for a listed copy of it).
            request.answered(
                result, stored=stored and result is not None and result.task_id == request.request.task_id
            )
    return outcomes


class Server:
    """This thread serving ``sku`` under a lease it holds: from construction until it exits, requests
    of this process for the SKU join it in memory (tasks.local_servers) instead of taking the lease's
    way; :meth:`drain` serves them and the listed ones in batches."""

    def __init__(self, res: Resources, sku: str, task_id: str | None, worker: str) -> None:
        self.res, self.sku, self.task_id, self.worker = res, sku, task_id, worker
        local_servers.enter(sku)
        self.stopped = False

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop serving; the requests still joined are given back unserved (they take the usual way)."""
        if not self.stopped:
            self.stopped = True
            local_servers.leave(self.sku)

    def drain(self, lease: Lease) -> tuple[int, bool]:
        """Serve batches until one is empty and nobody of this process queued or joined since its read
        (then stop serving: True), or until :data:`BATCHES_PER_LEASE`. Returns how many were served."""
        served = 0
        for _ in range(BATCHES_PER_LEASE):
            seen = local_servers.handoffs(self.sku)
            joined = local_servers.take(self.sku, self.res.settings.batch_size)
            outcomes = _batch(self.res, lease, self.sku, joined, self.task_id, self.worker)
            served += len(outcomes)
            if not outcomes and local_servers.leave(self.sku, seen):
                self.stopped = True
                return served, True
        return served, False

    def drain_joined(self, lease: Lease) -> None:
        """After the holder's own write, under its lease: serve whoever joined meanwhile, if anyone did.
        A failure here is the batch's, not the holder's request's (whose write is made): it is logged,
        and the requests it held take the usual way or stay listed."""
        if not local_servers.joined(self.sku):
            return
        try:
            self.drain(lease)
        except LostOwnership as lost:
            metrics.lost_ownership(
                lost, None, None, "serving joined reservations", task_id=self.task_id, worker=self.worker
            )
        except Exception:
            log.exception("could not serve the requests joined for %s", self.sku)


def serve_pending(
    res: Resources, sku: str, *, task_id: str | None, worker: str, known_waiting: bool = False
) -> int:
    """Serve the SKU's pending reservations unless its lease is busy, looking again after releasing only
    when needed (docs/architecture.md, "A hot SKU", step 3); returns how many got an outcome.
    ``known_waiting`` skips the first look (the caller has just queued a request)."""
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
                renew_every=failpoints.renew_every(settings.lease_renew_every),
            ) as lease:
                metrics.current.lease("acquired")
                with Server(res, sku, task_id, worker) as server:
                    count, drained = server.drain(lease)
                served += count
            if drained and lease.contended is False:
                break  # emptied under the lease, and nobody was turned away from it since
        except LeaseBusy:
            metrics.current.lease("busy")
            break  # its holder looks again after releasing
        except LostOwnership as lost:
            # Terminal for this lease: the batch rolled back and its requests stay queued for the next
            # holder or the watch.
            metrics.lost_ownership(
                lost, None, None, "serving pending reservations", task_id=task_id, worker=worker
            )
            break
    return served
