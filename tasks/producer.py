"""Record, then publish: how every producer hands a request to the workers, by task name, without
importing them (the CLI and the demo need not import the workers).

A request is recorded whole before its message is published, so a publish that fails after that loses
nothing: the caller hears ``BrokerUnavailable`` and the relay (tasks.relay) publishes it again from the
record under the same task id, derived from the idempotency key. A record that cannot be written means
nothing was published. Messages are plain JSON. Without a result backend (as :meth:`Producer.configured`
builds it), publishing never touches one: a result backend that is down does not stop enqueueing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery import Celery, current_task
from celery.app.amqp import AMQP
from celery.signals import before_task_publish
from kombu.messaging import Producer as KombuProducer

from reservations import Inventory
from reservations import validation as valid
from reservations.acceptance import Admission, Request
from reservations.redrives import Redrive
from reservations.request_outcomes import request_id
from tasks import messages
from tasks.messages import DEADLINE, ENQUEUED_AT, FORMAT, SHAPES, TRACE, request_fingerprint, task_name
from tasks.settings import Settings
from tasks.tracing import Trace, current


class _Publisher(KombuProducer):
    """kombu's producer, except that a queue this connection has declared already is not bound first.
    kombu's ``maybe_declare`` binds a copy of the routed queue to the channel on every message before it
    looks in the connection's record of what it declared (which kombu clears whenever it forgets its
    declarations, on a reconnect): about a tenth of publishing. The same record decides here, first."""

    def maybe_declare(self, entity: Any, retry: bool = False, **retry_policy: Any) -> Any:
        connection = getattr(self.channel, "connection", None)
        declared = () if connection is None else connection.client.declared_entities
        if entity and entity.can_cache_declaration and hash(entity) in declared:
            return False
        return super().maybe_declare(entity, retry, **retry_policy)  # type: ignore[no-untyped-call]


class _Messages(AMQP):  # type: ignore[misc]
    """Celery's messages, with the ``kwargsrepr`` header made by ``repr``: Celery's ``saferepr`` streams
    its text piece by piece (about a tenth of publishing), and a request's arguments are JSON values, which
    both show alike. A text longer than Celery's cut is left to ``saferepr``, which cuts it."""

    def as_task_v2(self, task_id: str, name: str, *args: Any, kwargsrepr: Any = None, **options: Any) -> Any:
        kwargs = options.get("kwargs", args[1] if len(args) > 1 else None)
        if kwargsrepr is None and isinstance(kwargs, dict):
            shown = repr(kwargs)
            kwargsrepr = shown if len(shown) <= self.kwargsrepr_maxsize else None
        return super().as_task_v2(task_id, name, *args, kwargsrepr=kwargsrepr, **options)

    @property
    def producer_pool(self) -> Any:
        """Celery's pool of kombu producers, whose producers are :class:`_Publisher`: set on every look,
        because Celery makes the pool anew after a fork."""
        pool = super().producer_pool
        pool.Producer = _Publisher
        return pool


class Producer:
    def __init__(
        self,
        broker_url: str,
        result_backend: str | None = None,
        *,
        transport_options: dict[str, Any] | None = None,
    ) -> None:
        self.app = Celery(
            "reservations-producer",
            broker=broker_url,
            backend=result_backend,
            set_as_current=False,
            amqp=_Messages,
        )
        self.app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            result_serializer="json",
            broker_transport_options=transport_options or {},
            broker_connection_retry_on_startup=True,
        )

    @classmethod
    def configured(cls, settings: Settings) -> Producer:
        """A producer on the settings' broker with the transport options the workers' app gives it (a
        sentinel:// broker cannot be reached without its service's name)."""
        options = settings.transport_options(settings.broker_url, broker=True)
        return cls(settings.broker_url, transport_options=options)

    def send(
        self,
        operation: str,
        key: str,
        kwargs: dict[str, Any],
        *,
        producer: Any = None,
        enqueued_at: float | None = None,
        deadline: float | None = None,
        message_format: int = messages.CURRENT_FORMAT,
        trace: Trace | None = None,
        task_id: str | None = None,
        sku_hint: str | None = None,
    ) -> str:
        """Publish ``operation`` for ``key``; returns the request's task id (the same for the same key).
        ``producer``: a kombu producer of this app held across many sends (:meth:`batch`); ``enqueued_at``:
        when a copy published again was first enqueued (else the time of publishing); ``deadline``: its
        header (:func:`tasks.messages.late`); ``message_format``: the format a recorded request was
        recorded in, when it is published again; ``trace``: the sender's span, the worker's parent;
        ``task_id``: the one a recorded request has already (a uuid5 of its key otherwise); ``sku_hint``:
        the SKU of the reservation a confirm or release names (:func:`tasks.messages.sku_hint`)."""
        if task_id is None:
            task_id = request_id(valid.idempotency_key(key))
        headers: dict[str, Any] = {
            FORMAT: message_format,
            **messages.deadline_header(deadline),
            **({} if enqueued_at is None else {ENQUEUED_AT: enqueued_at}),
            **({} if trace is None else {TRACE: trace.traceparent}),
            **({} if sku_hint is None else {messages.SKU_HINT: sku_hint}),
        }
        self.app.send_task(
            task_name(operation),
            kwargs={**kwargs, "idempotency_key": key},
            task_id=task_id,
            producer=producer,
            headers=headers,
        )
        return task_id

    def publish(
        self,
        request: Request,
        *,
        batch: Any = None,
        enqueued_at: float | None = None,
        trace: Trace | None = None,
    ) -> str:
        """Publish a recorded request as it was recorded (same task id, arguments, format and deadline);
        ``batch``: a kombu producer held across many publishes (:meth:`batch`); ``trace``: its sender's
        span (none for a copy the relay publishes again: the record keeps no trace)."""
        return self.send(
            request.request_type,
            request.key,
            dict(request.arguments),
            producer=batch,
            enqueued_at=enqueued_at,
            deadline=request.deadline,
            message_format=request.message_format,
            trace=trace,
            task_id=request.task_id,
            sku_hint=request.sku_hint,
        )

    def batch(self) -> Any:
        """A context manager holding one pooled producer (one broker connection) for many sends."""
        return self.app.producer_or_acquire()

    def close(self) -> None:
        self.app.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@before_task_publish.connect
def _stamp_enqueue_time(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Every task message carries when its request was first enqueued, so a worker can measure enqueue to
    final outcome (clocks of different hosts differ by their skew). A retry keeps its request's enqueue
    time, its deadline (retried past it, the request ends expired), its format (it is laid out as the
    message it retries) and its trace: its sender's span, or the span the worker started for a message
    that came without one, so that every attempt at a request is of one trace; and its SKU hint, or the SKU
    the attempt found in the hint's place (tasks.attempt)."""
    if headers is None:
        return
    retried = None
    if current_task and current_task.request.id == headers.get("id"):  # the proxy is false outside a task
        retried = current_task.request
        trace = current.get()
        if trace is not None and getattr(retried, TRACE, None) is None:
            headers.setdefault(TRACE, trace.traceparent)
    for kept in (DEADLINE, FORMAT, TRACE):
        value = getattr(retried, kept, None)
        if value is not None:
            headers.setdefault(kept, value)
    # Celery copies the message's own headers into its retry: the hint the attempt ended with replaces them.
    hint = getattr(retried, messages.SKU_HINT, None)
    if hint is not None:
        headers[messages.SKU_HINT] = hint
    if ENQUEUED_AT in headers:
        return
    inherited = getattr(retried, ENQUEUED_AT, None)
    headers[ENQUEUED_AT] = inherited if isinstance(inherited, int | float) else time.time()


def request_of(
    name: str,
    key: str,
    kwargs: Mapping[str, Any],
    *,
    deadline: float | None = None,
    caller: str | None = None,
    fingerprint: str | None = None,
    sku_hint: str | None = None,
) -> Request:
    """The record of request type ``name`` under ``key`` with the message arguments ``kwargs`` (without the
    key), as this release publishes it; ``fingerprint`` when the caller parsed the message already;
    ``sku_hint``: a confirm's or release's reservation's SKU, when the caller knows it. No I/O."""
    return Request(
        key=valid.idempotency_key(key),
        request_type=name,
        operation=SHAPES[name].operation,
        arguments=dict(kwargs),
        fingerprint=fingerprint or request_fingerprint(name, kwargs),
        task_id=request_id(key),
        message_format=messages.CURRENT_FORMAT,
        deadline=deadline,
        caller=caller,
        sku_hint=sku_hint,
    )


class Sender:
    """Records requests in the inventory database, then publishes them through ``producer``.
    ``look_after``: seconds after which the relay first looks at a recorded request without an outcome
    (``RESERVATIONS_REPUBLISH_AFTER``)."""

    def __init__(self, producer: Producer, inventory: Callable[[], Inventory], look_after: float) -> None:
        self.producer = producer
        self._inventory = inventory
        self.look_after = look_after

    def record(self, requests: Sequence[Request]) -> None:
        """Record ``requests`` in one statement (a key recorded already keeps its first record)."""
        self._inventory().record_accepted(requests, self.look_after)

    def admit(self, requests: Sequence[Request]) -> list[Admission]:
        """Admit ``requests`` (reservations.acceptance.admit_many): the new keys recorded in one statement."""
        return self._inventory().admit_many(requests, self.look_after)

    def send(self, request: Request, trace: Trace | None = None) -> str:
        """Record ``request``, then publish it (``trace``: its sender's span); returns its task id."""
        self.record([request])
        return self.producer.publish(request, trace=trace)

    def redrive(self, key: str, *, by: str | None = None) -> tuple[Redrive, str]:
        """Claim the next re-drive of the dead letter under ``key`` (reservations.redrives decides whether it
        may be and under which key), record it and publish it; returns the claim and its task id. The claim
        is dropped again when its record cannot be written (the error is raised), so a later attempt is not
        refused as already running; a publish that fails after it is raised too, and the relay publishes
        the request later."""
        inventory = self._inventory()
        claimed = inventory.claim_redrive(key, by=by)
        request = request_of(claimed.request_type, claimed.key, claimed.arguments)
        try:
            self.record([request])
        except BaseException:
            inventory.drop_redrive(claimed.key)
            raise
        return claimed, self.producer.publish(request)
