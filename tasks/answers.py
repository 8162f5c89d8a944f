"""What a request's sender is told, and the Celery task states and events that name it (the table and the
reasons: docs/operations.md, "Task states in Flower and `celery events`"). An answer (:func:`reply`) is a
plain dict, as the result backend stores it: ``status``, ``epochs``, ``key``, ``operation``, ``detail``;
a key naming a different request answers a conflict and keeps the owning request's Celery result. The
final event comes from the worker's main process, which Celery hands only the repr of what the task
returned, so the pool child hands it an :class:`Answered` (:meth:`RequestTask.__trace__`).
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from billiard.exceptions import WorkerLostError
from celery import Celery, Task
from celery.app.task import get_actual_ignore_result
from celery.exceptions import Retry
from celery.utils.saferepr import saferepr
from celery.worker.request import Request
from celery.worker.state import task_ready

from reservations.request_outcomes import RequestResult
from reservations.statuses import RequestStatus
from tasks.errors import TasksError
from tasks.messages import Message
from tasks.settings import stores_request_results

log = logging.getLogger("tasks")

QUEUED = "queued"
LOST_OWNERSHIP = "task-lost_ownership"

# Whether this worker sends task events (-E or RESERVATIONS_TASK_EVENTS): set in the main process before
# the pool forks, so a pool child that serves queued requests knows whether to announce them.
_task_events = {"on": False}


def reply(
    status: str, epochs: int, key: str | None, operation: str, detail: dict[str, Any]
) -> dict[str, Any]:
    return {"status": str(status), "epochs": epochs, "key": key, "operation": operation, "detail": detail}


def as_result(result: RequestResult) -> dict[str, Any]:
    return reply(result.status, result.epochs, result.key, result.operation, result.detail)


def answer(task: Task, message: Message, stored: RequestResult) -> dict[str, Any]:
    """What this message's sender is told about the outcome stored under its key: that outcome if it is
    this request's, else a conflict (and the key's Celery result is left to the request that owns it)."""
    if stored.belongs_to(message.operation, message.fingerprint):
        return as_result(stored)
    return conflict(task, message, stored.operation, "names")


def conflict(task: Task, message: Message, other: str, how: str) -> dict[str, Any]:
    """The answer to a message whose key belongs to a different ``other`` request. Not stored as the
    key's Celery result, which stays the owning request's."""
    task.request.ignore_result = True
    detail = {
        "error": "IdempotencyConflict",
        "message": f"idempotency key {message.key!r} {how} a different {other} request",
        "stored_operation": other,
    }
    return reply(RequestStatus.INVALID, message.counts["epoch"], message.key, message.operation, detail)


class Redriven(TasksError):
    """The reason a request is retried after an attempt lost ownership: it runs again in a new epoch.

    Crosses from the pool child to the worker's main process by pickle and into the result backend as
    JSON (its message only), so its fields ride in ``__reduce__``.
    """

    def __init__(self, message: str, fields: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.fields = dict(fields or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.fields))


class Answered(NamedTuple):
    """What a request task's pool child hands the worker's main process when the task returned an
    answer (:func:`reply`): its status and epochs, and Celery's repr of it (the event's
    ``result``). Crosses the process boundary by pickle."""

    status: str
    epochs: int
    text: str | None

    @classmethod
    def of(cls, answer: object, text: str | None) -> Answered | None:
        """``answer``'s status and epochs; None for a return value that is no answer."""
        if not isinstance(answer, dict):
            return None
        status, epochs = answer.get("status"), answer.get("epochs")
        if not isinstance(status, str) or isinstance(epochs, bool) or not isinstance(epochs, int):
            return None
        return cls(status, epochs, text)

    def event(self) -> tuple[str, dict[str, Any]] | None:
        """The final event this answer calls for, its type and fields; None for a queued request (the
        server of its batch announces the outcome)."""
        if self.status == QUEUED:
            return None
        return f"task-{self.status}", {"result": self.text, "outcome": self.status, "epochs": self.epochs}


Tracer = Callable[..., Any]


def _answering(tracer: Tracer) -> Tracer:
    """A request task's Celery tracer, whose successful traces hand the main process an
    :class:`Answered` where Celery hands it the repr of the return value."""

    def trace(*args: Any, **kwargs: Any) -> Any:
        traced = tracer(*args, **kwargs)  # celery.app.trace.trace_ok_t
        answered = Answered.of(traced.retval, traced.retstr) if traced.info is None else None
        return traced if answered is None else traced._replace(retstr=answered)

    return trace


class OutcomeRequest(Request):  # type: ignore[misc]
    """The worker's request of a reservation task: its events name the outcome (module docstring)."""

    _stored: Answered | None = None

    def send_event(self, type: str, **fields: Any) -> None:
        if type == "task-succeeded":
            answered = fields.get("result")
            if not isinstance(answered, Answered):
                answered = self._stored
            if answered is not None:
                final = answered.event()
                if final is None:
                    return
                type, extra = final
                fields.update(extra)
        super().send_event(type, **fields)

    def _success_was_stored(self) -> Any:
        """Celery's look for the SUCCESS a pool child stored before it was lost: Celery then sends
        ``task-succeeded`` with the repr of the stored result; :meth:`send_event` names its answer."""
        meta = super()._success_was_stored()
        if meta:
            stored = meta.get("result")
            self._stored = Answered.of(stored, saferepr(stored, self.task.resultrepr_maxsize))
        return meta

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        """A pool child lost on a redelivered message acknowledges it instead of requeueing it again: a
        message that kills every worker that takes it would come back forever. Its request is the relay's,
        which caps its publications (docs/architecture.md, "The relay"). A first loss is still requeued."""
        exc = getattr(exc_info.exception, "exc", exc_info.exception)
        if isinstance(exc, WorkerLostError) and self.task.acks_late and self.delivery_info.get("redelivered"):
            task_ready(self)
            log.error(
                "request %s lost its worker again on a redelivered message: not requeued, the relay "
                "carries it (%s)",
                self.id,
                exc,
                extra={"event": "worker_lost_again", "task_id": self.id},
            )
            self.acknowledge()
            return
        super().on_failure(exc_info, send_failed_event, return_ok)

    def on_retry(self, exc_info: Any) -> None:
        if not isinstance(getattr(exc_info.exception, "exc", None), Redriven):
            super().on_retry(exc_info)
            return
        # No task-retried: the pool child sent task-lost_ownership before publishing the retry. Sent from
        # here it could arrive after the next attempt's final event (another worker may run that attempt
        # at once), and would then stand as the task's state for good.
        if self.task.acks_late:
            self.acknowledge()


class RequestTask(Task):  # type: ignore[misc]
    """The class of the request tasks: their worker requests name the outcome (:class:`OutcomeRequest`),
    they store a Celery result only when ``RESERVATIONS_RESULT_EXPIRES`` keeps one, and a retry's RETRY
    state is stored before the retry is published.

    Celery publishes a retry, then stores RETRY as the attempt ends. Meanwhile another worker may have run
    the retry to its end (a lost attempt is driven again at once), and a RETRY that lands after that
    SUCCESS replaces it for good: the result backend looks for a SUCCESS and writes in two commands, and
    ``AsyncResult.get()`` waits for a ready state that never comes. Stored before the retry exists, RETRY
    is older than anything the retry stores.
    """

    Request = OutcomeRequest

    # Celery renders every result for its success log line, whether or not that line is logged, walking
    # the whole answer up to this many characters: about a fifth of a reservation task's CPU at Celery's
    # 1024. An answer puts its status, epochs, key and operation first, so the line still names them;
    # the detail is the request's outcome row.
    resultrepr_maxsize = 96

    _tracer: Tracer | None = None

    @property
    def __trace__(self) -> Tracer | None:
        """The tracer the worker runs this task with (Celery builds and assigns it, in every pool child and
        in the main process): Celery's, handing the main process an :class:`Answered`."""
        return self._tracer

    @__trace__.setter
    def __trace__(self, tracer: Tracer | None) -> None:
        self._tracer = None if tracer is None else _answering(tracer)

    @property
    def ignore_result(self) -> bool:
        """Celery's per-task default (a message's own ``ignore_result`` still wins), read from the settings
        of the app this task is bound to. By default a request stores no result: the outcome row is the
        record, and a result kept per request grows the result backend with the traffic."""
        return not stores_request_results(self.app)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Retry:
        request = self.request
        # Where Celery would store nothing for the retry (no worker, or the result ignored), neither do we.
        stores = not (request.called_directly or request.is_eager or get_actual_ignore_result(self, request))
        if stores:
            handling = traceback.format_exc() if sys.exc_info()[1] is not None else None
            try:
                self.backend.mark_as_retry(request.id, exc, handling, request=request)
            except Exception as failed:  # the Celery result is a convenience, never the record: retry anyway
                log.warning("could not store the RETRY state of %s: %s", request.id, failed)
        try:
            published: Retry = super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        finally:
            # The retry is published with the request's own ignore_result; from now on the per-request
            # one, read by Celery as the attempt ends, keeps it from storing RETRY a second time, late.
            if stores:
                request.ignore_result = True
        return published  # throw=False: the caller raises it


def announce_lost(task: Task, reason: Redriven) -> None:
    """From the pool child, before the retry is published: the attempt lost ownership (module docstring).
    Sent only when this worker sends task events; a failure to send is logged, never raised."""
    if not _task_events["on"]:
        return
    # A task event's ``worker`` is Celery's (the node): the process that lost goes as ``process``.
    fields = {("process" if name == "worker" else name): v for name, v in reason.fields.items()}
    try:
        task.send_event(LOST_OWNERSHIP, retry=False, exception=saferepr(reason), **fields)
    except Exception as exc:
        log.warning("could not send the lost-ownership event of %s: %s", task.request.id, exc)


def note_task_events(instance: Any = None, **_: Any) -> None:
    """Connected to ``celeryd_after_setup`` by tasks.worker: notes the worker's ``task_events`` (above)."""
    _task_events["on"] = bool(getattr(instance, "task_events", False))


def announce(app: Celery, outcomes: list[RequestResult], hostname: str | None) -> None:
    """Send the final event of requests served for others in a batch, when this worker sends task events.
    Their own tasks ended without one (queued), so this is what moves them on in Flower."""
    served = [outcome for outcome in outcomes if outcome.task_id]
    if not _task_events["on"] or not served:
        return
    with app.events.default_dispatcher(hostname=hostname) as dispatcher:
        for outcome in served:
            dispatcher.send(
                f"task-{outcome.status}",
                uuid=outcome.task_id,
                result=saferepr(as_result(outcome)),
                outcome=outcome.status,
                epochs=outcome.epochs,
            )
