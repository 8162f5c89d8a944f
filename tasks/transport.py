"""The Redis broker transports of the workers: kombu's (``redis://``, ``rediss://``, ``sentinel://``), except
that neither a message nor a full broker can stop a worker's consumer.

Two things end kombu's Redis consumer, and with it the worker's main process ("Unrecoverable error",
exit 1), its pool children and every request they hold:

* A message no task can be made of: a payload that is no JSON, a body that does not decode as its
  properties say (not base64), no properties, a body or headers Celery cannot read. Anyone who can push
  onto the queue could stop every worker with one. Such a message is dropped instead: one log line naming
  what identifies it (its queue; the task id and name from its headers and the idempotency key from its
  ``kwargsrepr`` where those are readable) and ``reservations_messages_dropped_total{reason}``
  (:mod:`tasks.metrics`). The request it may have carried is not lost with it: its durable record (the
  relay publishes again every recorded request that has no outcome) brings it back as a message that
  decodes, so dropping the copy that does not is right.
* A broker at ``maxmemory`` (policy noeviction) refuses every command that could grow its memory, and
  redis-py raises ``OutOfMemoryError``, which Celery does not count among the errors it recovers from. Here
  it is a connection error: the consumer backs off and connects again, as after a broker restart. Where a
  message is delivered it is caught instead (:class:`QoS`), so that a full broker can still be drained.
* A broker restarted under a consumer holding messages: kombu's close restores them through a connection
  it has already let go, and fails on it (AttributeError). :class:`QoS` leaves them to the broker then.

:func:`install` makes kombu resolve those three schemes to these transports. It edits kombu's alias table
rather than naming a transport in Celery's ``broker_transport``: kombu gives a ``rediss://`` broker its TLS
default only when the transport is named ``rediss``, and on failover to the next URL of a list (the
sentinels of ``sentinel://a;sentinel://b``) it takes the transport from that URL's scheme again, leaving
any transport named otherwise behind.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import kombu.transport
from kombu.exceptions import InconsistencyError
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads
from redis.exceptions import OutOfMemoryError, RedisError

from reservations import validation as valid
from reservations.errors import InvalidRequest
from tasks import metrics

__all__ = ["SCHEMES", "Channel", "QoS", "SentinelChannel", "SentinelTransport", "Transport", "install"]

log = logging.getLogger("tasks.transport")

# How much of a value sent by whoever published a message goes into a log line.
SHOWN_CHARS = 120
# How often a full broker is logged at most while deliveries go on without their unacked record.
FULL_LOG_INTERVAL = 10.0

# An idempotency key as Celery's kwargsrepr header shows it: ``'idempotency_key': 'order-7'``.
_KEY_IN_REPR = re.compile(rf"""'idempotency_key': (['"])([!-~]{{1,{valid.MAX_KEY_CHARS}}}?)\1[,}}]""")
_REPR_SEARCHED = 4096  # Celery cuts kwargsrepr to about a kilobyte; nothing further is searched


def _shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """A sender's value as a log line may carry it: printable characters only, cut at ``limit``."""
    text = value if isinstance(value, str) else repr(value)
    text = text[: limit + 1]
    printable = "".join(ch if ch.isprintable() else "?" for ch in text[:limit])
    return printable + ("..." if len(text) > limit else "")


def identity(payload: object) -> dict[str, str | None]:
    """What identifies a message in a log line, read from its headers where they are readable: the task
    id (a request's is derived from its key, :func:`reservations.request_outcomes.request_id`), the task
    name, and the idempotency key shown in ``kwargsrepr``."""
    headers = payload.get("headers") if isinstance(payload, Mapping) else None
    if not isinstance(headers, Mapping):
        return {"task_id": None, "task": None, "key": None}
    task_id, task = headers.get("id"), headers.get("task")
    shown = headers.get("kwargsrepr")
    key = None
    if isinstance(shown, str):
        found = _KEY_IN_REPR.search(shown[:_REPR_SEARCHED])
        try:
            key = valid.idempotency_key(found[2]) if found else None
        except InvalidRequest:
            key = None
    return {
        "task_id": None if task_id is None else _shown(task_id),
        "task": None if task is None else _shown(task),
        "key": key,
    }


def dropped(reason: metrics.DropReason, queue: object, payload: object, error: BaseException) -> None:
    """Log and count a message the consumer drops; ``payload`` is its JSON where it decoded (None else)."""
    metrics.current.dropped(reason)
    names = identity(payload)
    where = _shown(queue.decode(errors="replace") if isinstance(queue, bytes) else queue)
    log.error(
        "dropped a message from queue %s (task %s %s, key %s) that no task can be made of: %s: %s",
        where,
        names["task"],
        names["task_id"],
        names["key"],
        _kind(error),
        _shown(str(error)),
        extra={"event": "message_dropped", "reason": reason, "queue": where, **names},
    )


def _kind(error: BaseException) -> str:
    """An error's class as a log line names it: ``binascii.Error``, ``KeyError``."""
    kind = type(error)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


class _Throttled:
    """A warning logged at most once per ``interval`` seconds, saying how many times it happened since."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.last: float | None = None
        self.unlogged = 0

    def warn(self, message: str, *args: object, **extra: Any) -> None:
        now = self.clock()
        if self.last is not None and now - self.last < self.interval:
            self.unlogged += 1
            return
        if self.unlogged:
            message, args = message + " (%d more since the last such line)", (*args, self.unlogged)
        self.last, self.unlogged = now, 0
        log.warning(message, *args, extra=extra)


_full = _Throttled(FULL_LOG_INTERVAL)


class QoS(kombu_redis.QoS):
    """kombu's record of delivered messages, which survives a full broker: a delivery whose unacked record
    the broker refuses goes on without it, an ack still takes the message off that record, and a requeue
    or a restore of overdue messages waits for the visibility timeout or the next round."""

    def append(self, message: Any, delivery_tag: str) -> None:
        try:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
        except OutOfMemoryError as exc:
            # BRPOP took the message off the queue and the broker refused to note it as unacked: it runs
            # anyway (and taking it frees memory). Should this worker die before acking it, the broker has
            # no copy to give back after the visibility timeout; the relay publishes the request again
            # from its record in the database, as it does for any recorded request without an outcome.
            _full.warn(
                "broker at maxmemory: a message is run without its unacked record (%s)",
                exc,
                event="broker_full",
            )
            # This process's record of it, which prefetch counts and the ack clears.
            virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]

    def _detached(self) -> bool:
        """Whether the consumer lost the broker (a restart) and kombu already let go of both this
        channel's client pool and its connection: kombu would look for the broker's address on the
        connection that is gone and raise AttributeError, which ends the worker's main process. There is
        no broker to reach through it anyway. What kombu would have done stays on the broker's unacked
        record, where the visibility timeout brings the message back (a copy of a request that ended
        replays its outcome); one the broker lost is published again by the relay from its record."""
        channel = self.channel
        return channel._pool is None and getattr(channel.connection, "client", None) is None

    def _left_to_the_broker(self, what: str, count: int) -> None:
        log.warning("broker connection closed: %s %d message(s) left to the broker", what, count)

    def ack(self, delivery_tag: str) -> None:
        if self._detached():
            self._left_to_the_broker("the ack of", 1)
            virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]
            return
        try:
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]
        except OutOfMemoryError:
            self._unrecord(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if self._detached():
            self._left_to_the_broker("the rejection of", 1)
            virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]
            return
        try:
            super().reject(delivery_tag, requeue=requeue)  # type: ignore[no-untyped-call]
        except OutOfMemoryError:
            if requeue:
                # Requeueing needs memory: the message stays unacked and comes back after the
                # visibility timeout instead.
                virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]
            else:
                self._unrecord(delivery_tag)

    def _unrecord(self, delivery_tag: str) -> None:
        """Take a message off the unacked record of a full broker. kombu does it in MULTI, and a full
        broker refuses every command queued in MULTI, even one that frees memory; on their own ZREM and
        HDEL are never refused. Without this the ack would fail, and this process would keep counting the
        message as unacknowledged, which stops its consumer once it holds its prefetch of them."""
        with self.channel.conn_or_acquire() as client:
            client.zrem(self.unacked_index_key, delivery_tag)
            client.hdel(self.unacked_key, delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]

    def restore_unacked(self, client: Any = None) -> Any:
        if client is None and self._detached():
            held = len(self._delivered.keys() - self._dirty)  # kombu forgets acked ones lazily
            self._left_to_the_broker("the restore of", held)
            return None
        return super().restore_unacked(client)  # type: ignore[no-untyped-call]

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().restore_visible(*args, **kwargs)  # type: ignore[no-untyped-call]
        except OutOfMemoryError as exc:
            # Requeueing needs memory: the overdue messages stay unacked until a later round.
            _full.warn(
                "broker at maxmemory: overdue messages not restored yet (%s)", exc, event="broker_full"
            )


class _Screened:
    """A Redis channel whose BRPOP replies are read as kombu is about to read them: a payload that is no
    JSON becomes no reply at all (kombu's ``Empty``, as when BRPOP times out) once dropped, rather than an
    error out of the consumer's event loop. It is decoded twice, here and by kombu: a small price (a
    request's message is about a kilobyte) for leaving kombu's read of the reply as it is."""

    QoS = QoS
    sep: str

    def _create_client(self, asynchronous: bool = False) -> Any:
        client = super()._create_client(asynchronous)  # type: ignore[misc]
        if asynchronous:  # the client whose connection BRPOPs (kombu's Channel.client)
            parse = client.response_callbacks.get("BRPOP")
            client.set_response_callback("BRPOP", lambda reply, **opts: self._screen(parse, reply, opts))
        return client

    def _screen(self, parse: Callable[..., Any] | None, reply: Any, options: dict[str, Any]) -> Any:
        popped = parse(reply, **options) if parse is not None else reply
        if not popped:
            return popped
        key, item = popped
        try:
            loads(bytes_to_str(item))  # type: ignore[no-untyped-call]
        except Exception as exc:  # whatever kombu's loads raises on it (even RecursionError) ends here
            queue = bytes_to_str(key).rsplit(self.sep, 1)[0]  # type: ignore[no-untyped-call]
            dropped("undecodable", queue, None, exc)
            return None
        return popped


class _Delivering:
    """A Redis transport whose deliveries cannot raise out of the consumer for what a message holds.

    Every message the channels take (BRPOP replies, fanout messages) reaches the consumer through
    ``_deliver``, where kombu builds its Message (decoding the body as its properties say) and Celery reads
    its headers and body. An error there that is no broker error is the message's: it is dropped, and
    taken off the broker's unacked record where it was already put there, or it would come back after
    the visibility timeout only to be dropped again.
    """

    channels: list[Any]
    connection_errors: tuple[type[BaseException], ...]
    channel_errors: tuple[type[BaseException], ...]

    def _deliver(self, message: Any, queue: str) -> None:
        tag = _tag_of(message)
        held = [channel for channel in self.channels if _holds(channel, tag)]
        try:
            super()._deliver(message, queue)  # type: ignore[misc]
        except Exception as exc:
            if self._broker_error(exc):
                raise
            dropped("malformed", queue, message, exc)
            for channel in self.channels:
                if channel not in held and _holds(channel, tag):
                    channel.qos.reject(tag, requeue=False)

    def _broker_error(self, exc: Exception) -> bool:
        """An error of the broker or its connection, which the consumer recovers from by connecting again.
        kombu counts KeyError among its Redis connection errors (a stale socket of a dropped channel); in a
        delivery it is a field the message lacks."""
        if isinstance(exc, KeyError):
            return False
        return isinstance(exc, (RedisError, OSError, InconsistencyError, *self.connection_errors))


def _tag_of(message: object) -> Any:
    properties = message.get("properties") if isinstance(message, Mapping) else None
    return properties.get("delivery_tag") if isinstance(properties, Mapping) else None


def _holds(channel: Any, tag: Any) -> bool:
    try:
        return tag is not None and tag in channel.qos._delivered
    except TypeError:  # a tag that cannot be a key (a list): no channel holds it
        return False


class Channel(_Screened, kombu_redis.Channel):
    pass


class SentinelChannel(_Screened, kombu_redis.SentinelChannel):
    pass


# A full broker is a connection error here (see the module docstring). It is a ResponseError, which kombu
# counts as a channel error too; Celery's consumer recovers only from connection errors.
class Transport(_Delivering, kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel
    connection_errors = (*kombu_redis.Transport.connection_errors, OutOfMemoryError)


class SentinelTransport(_Delivering, kombu_redis.SentinelTransport):  # type: ignore[misc]
    Channel = SentinelChannel
    connection_errors = (*kombu_redis.SentinelTransport.connection_errors, OutOfMemoryError)


# The URL schemes whose kombu transport is replaced, and by which of these.
SCHEMES = {"redis": Transport, "rediss": Transport, "sentinel": SentinelTransport}


def install() -> None:
    """Make kombu resolve ``redis://``, ``rediss://`` and ``sentinel://`` URLs to these transports, in this
    process (every kombu connection of it: they differ from kombu's only in what is described above)."""
    for scheme, transport in SCHEMES.items():
        kombu.transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:{transport.__name__}"
        # kombu caches the class it resolved for a name: one resolved before this would stay.
        kombu.transport._transport_cache.pop(scheme, None)
