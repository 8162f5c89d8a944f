"""The relay: every recorded request ends in one outcome, whatever happened to its messages.

Each pass claims the records whose look has come (reservations.acceptance.due) and decides for each in
:func:`decide`, without I/O (the table: docs/architecture.md, "The relay: nothing accepted vanishes").

Looking into the broker (:func:`redis_presence`) tells a lost message from one that is queued or being
worked on, so that a backlog is not flooded with copies. On Redis a message is in its queue (a list per
priority step) or, while a worker holds it, in kombu's unacknowledged set; one taken by BRPOP by a worker
killed before it wrote the set is in neither: lost. One held longer than ``held_for`` is counted as not
carried, so its request is published again long before the visibility timeout gives it back. Where the
broker cannot be looked into (RabbitMQ: ``carried`` is None) copies are spaced out: ``after``, then twice
as long each time (:func:`spacing`). A publish that fails is not counted: the record is looked at again
after ``after``.

Where it runs: in every worker's main process, in a thread of its own (:class:`RelayStep`). Workers are
wherever requests can be carried at all, so a deployment cannot forget the relay, and it needs no message
of its own on the broker it repairs (a beat task would wait behind the very backlog it looks after, and
beat is one process).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import KW_ONLY, dataclass, field
from enum import StrEnum
from typing import Any

from celery import bootsteps

from fencing import BackendUnavailable
from reservations import Inventory
from reservations.acceptance import Due
from reservations.request_outcomes import AlreadyApplied
from reservations.statuses import RequestStatus
from tasks.producer import Producer
from tasks.settings import REDIS, Settings, scheme_of

log = logging.getLogger("tasks.relay")

# Records claimed per pass, and how long a claim keeps other relays off a record (a relay that dies
# mid-pass leaves its claims to the next pass after this).
BATCH = 500
CLAIM = 60.0
# Copies spaced out to at most this many times ``after`` where the broker cannot be looked into.
MOST_SPACING = 2**5
# The longest a message may sit held by a live worker before it runs: a retry's countdown (backoff to 30
# s, tasks.policy) on top of a lease ttl of waiting. Held longer, its worker is taken to be dead.
RETRY_COUNTDOWN = 30.0
WORKER_NAME = "relay"
# Seconds between the two looks into the broker that must both miss a message for it to count as lost.
SECOND_LOOK = 0.25
# Messages read per LRANGE or HSCAN: a 10,000-message backlog is ten round trips.
CHUNK = 1000


class Action(StrEnum):
    CLOSE = "close"
    WAIT = "wait"
    EXPIRE = "expire"
    DEAD_LETTER = "dead_letter"
    REPUBLISH = "republish"


def decide(due: Due, now: float, carried: set[str] | None, max_publishes: int) -> Action:
    """What the relay does with a record whose look has come (the table of docs/architecture.md); ``now`` in
    seconds since the epoch, ``carried`` the task ids the broker carries (None: unknown)."""
    record = due.accepted
    if due.ended:
        return Action.CLOSE
    if due.queued:
        return Action.WAIT
    if record.deadline is not None and now >= record.deadline:
        return Action.EXPIRE
    if carried is not None and record.task_id in carried:
        return Action.WAIT
    if record.publishes >= max_publishes or record.arguments is None:
        return Action.DEAD_LETTER
    return Action.REPUBLISH


def spacing(after: float, spaced: bool) -> list[float]:
    """Seconds until the next look after the n-th publication (the last for any more): ``after`` each
    time where the broker can be looked into, else doubling up to :data:`MOST_SPACING` times it."""
    return [after * 2**n for n in range(MOST_SPACING.bit_length() if spaced else 1)]


def ending(action: Action, due: Due, now: float) -> tuple[str, dict[str, Any]]:
    """The final status and detail the relay records for a request it ends."""
    record = due.accepted
    if action == Action.EXPIRE:
        assert record.deadline is not None
        return RequestStatus.EXPIRED, {
            "deadline": record.deadline,
            "late_by": round(now - record.deadline, 3),
            "reason": f"no outcome by its deadline; published {record.publishes} time(s)",
        }
    if record.arguments is None:
        return RequestStatus.DEAD_LETTERED, {"reason": "lost", "error": "recorded without its arguments"}
    error = f"no outcome after {record.publishes} publications: its messages were lost or killed the workers"
    error += " that took them"
    request = {"type": record.request_type, "arguments": record.arguments}
    return RequestStatus.DEAD_LETTERED, {"reason": "lost", "error": error, "request": request}


@dataclass
class Pass:
    """What one pass did, by action."""

    counts: dict[str, int] = field(default_factory=lambda: {action.value: 0 for action in Action})

    def __bool__(self) -> bool:
        return any(self.counts.values())


@dataclass(eq=False)
class Relay:
    """One relay: ``inventory`` to read and claim records, ``producer`` to publish, ``carried`` to look
    into the broker (None where it cannot)."""

    inventory: Inventory
    producer: Producer
    _: KW_ONLY
    after: float
    max_publishes: int
    carried: Callable[[], set[str]] | None
    clock: Callable[[], float] = time.time
    pause: Callable[[float], None] = time.sleep
    worker: str = WORKER_NAME
    closing: Callable[[], None] = lambda: None

    def close(self) -> None:
        self.closing()
        self.inventory.close()
        self.producer.close()

    def run_once(self) -> Pass:
        """Claim the records due now and act on each; returns what was done."""
        inventory = self.inventory
        done = Pass()
        dues = inventory.claim_due(BATCH, CLAIM)
        if not dues:
            return done
        carried = self._carried(dues)
        now = self.clock()
        closed, waiting, republished = [], [], []
        for due in dues:
            action = decide(due, now, carried, self.max_publishes)
            done.counts[action.value] += 1
            key = due.accepted.key
            if action == Action.CLOSE:
                closed.append(key)
            elif action == Action.WAIT:
                waiting.append(key)
            elif action in (Action.EXPIRE, Action.DEAD_LETTER):
                self._end(action, due, now)
                closed.append(key)
            elif self._republish(due):
                republished.append(key)
            else:  # not counted: looked at again after ``after``, as one still carried
                waiting.append(key)
        inventory.close_records(closed)
        inventory.look_later(waiting, self.after)
        inventory.record_republished(republished, spacing(self.after, carried is None))
        if done.counts[Action.REPUBLISH] or done.counts[Action.EXPIRE] or done.counts[Action.DEAD_LETTER]:
            log.warning(
                "relay: %s",
                ", ".join(f"{n} {a}" for a, n in done.counts.items() if n),
                extra={"event": "relayed", **done.counts},
            )
        return done

    def _carried(self, dues: list[Due]) -> set[str] | None:
        if self.carried is None:
            return None
        sought = [due.accepted.task_id for due in dues if not (due.ended or due.queued)]
        if not sought:
            return set()  # nothing to look for: no scan of the broker
        try:
            found = self.carried()
            # A worker takes a message off the queue, then records it as held (kombu, after the pop): for
            # that moment it is in neither place, and a worker descheduled in between on a loaded host
            # stays there for tens of milliseconds. What one look misses is looked for once more, a
            # moment later, by when it is in the record; only what both miss is lost.
            if any(task_id not in found for task_id in sought):
                self.pause(SECOND_LOOK)
                found |= self.carried()
            return found
        except Exception as exc:  # the broker does not answer: nothing can be published either
            log.warning("relay: could not look into the broker: %s", exc)
            return None

    def _republish(self, due: Due) -> bool:
        record = due.accepted
        request = record.request()  # decide() ended a record without arguments instead
        try:
            self.producer.publish(request, enqueued_at=record.at)
        except Exception as exc:
            log.warning("relay: could not publish %s again: %s", record.key, exc)
            return False
        log.info("relay: published %s again (publication %d)", record.key, record.publishes + 1)
        return True

    def _end(self, action: Action, due: Due, now: float) -> None:
        status, detail = ending(action, due, now)
        record = due.accepted
        try:
            self.inventory.record_outcome(
                record.key, record.operation, status, detail,
                task_id=record.task_id, worker=self.worker, fingerprint=record.fingerprint,
            )  # fmt: skip
        except AlreadyApplied:
            return  # a worker decided it meanwhile: that outcome stands
        extra = {"event": f"relay_{status}", "key": record.key}
        log.warning("relay: request %s ended %s: %s", record.key, status, detail["reason"], extra=extra)


class RelayStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """The relay of a worker's main process, in a thread of its own (blocking I/O must stay off the
    consumer's event loop): a pass every ``RESERVATIONS_RELAY_EVERY`` seconds, with jitter so that the
    workers of a fleet do not all look at once."""

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        self.settings: Settings = consumer.app.conf.reservations_settings
        self.enabled = self.settings.relay_every > 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__(consumer, **kwargs)

    def start(self, consumer: Any) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(consumer.app,), name="relay", daemon=True)
        self._thread.start()

    def _loop(self, app: Any) -> None:
        settings = self.settings
        relay: Relay | None = None  # built in this thread, on first use: a database down at start waits
        every = settings.relay_every
        while not self._stop.wait(every * random.uniform(0.5, 1.0)):
            try:
                if relay is None:
                    relay = relay_of(settings, app.conf.task_default_queue)
                relay.run_once()
            except BackendUnavailable as exc:
                log.warning("relay: the database did not answer: %s", exc)
            except Exception:
                log.exception("relay pass failed")
        if relay is not None:
            with suppress(Exception):
                relay.close()

    def stop(self, consumer: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    shutdown = stop


def _task_id(payload: bytes | str) -> str | None:
    """The task id a message as kombu stores it names (``headers.id``), or None for a payload that is no
    message (the worker's own decoding counts those)."""
    try:
        message = json.loads(payload)
        if isinstance(message, list):  # an unacknowledged entry: [message, exchange, routing key]
            message = message[0]
        task_id = message["headers"]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return task_id if isinstance(task_id, str) else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _queued(client: Any, keys: Iterable[str]) -> Iterator[str]:
    for key in keys:
        for start in itertools.count(0, CHUNK):
            chunk = client.lrange(key, start, start + CHUNK - 1)
            yield from filter(None, map(_task_id, chunk))
            if len(chunk) < CHUNK:
                break


def _held(client: Any, hash_key: str, index_key: str, since: float) -> Iterator[str]:
    fresh = {_text(tag) for tag in client.zrangebyscore(index_key, since, "+inf")}
    if not fresh:
        return
    held = client.hscan_iter(hash_key, count=CHUNK)
    yield from filter(None, (_task_id(payload) for tag, payload in held if _text(tag) in fresh))


def redis_presence(
    connection: Any, queues: Iterable[str], held_for: float, clock: Callable[[], float] = time.time
) -> Callable[[], set[str]]:
    """The task ids a Redis broker carries now: in ``queues`` (every priority step), or held by a worker
    for less than ``held_for`` seconds. ``connection``: a kombu connection to the broker, used from one
    thread."""
    names = list(queues)

    def carried() -> set[str]:
        channel: Any = connection.default_channel  # kombu's Redis channel
        client = channel.client
        keys = [channel._q_for_pri(queue, step) for queue in names for step in channel.priority_steps]
        found = set(_queued(client, dict.fromkeys(keys)))
        found.update(_held(client, channel.unacked_key, channel.unacked_index_key, clock() - held_for))
        return found

    return carried


def relay_of(settings: Settings, queue: str = "celery") -> Relay:
    """A relay on ``settings``: its own producer and database pool, and a look into the broker's ``queue``
    where the broker is Redis."""
    producer = Producer.configured(settings)
    carried, closing = None, (lambda: None)
    if scheme_of(settings.broker_url) in REDIS:
        connection = producer.app.connection_for_read()
        carried = redis_presence(connection, [queue], RETRY_COUNTDOWN + settings.lease_ttl)
        closing = connection.release
    inventory = Inventory.from_url(settings.database_url, pooling=settings.database_pooling)
    return Relay(
        inventory,
        producer,
        after=settings.republish_after,
        max_publishes=settings.max_publishes,
        carried=carried,
        closing=closing,
    )
