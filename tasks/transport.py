"""The Redis broker transports of the workers: kombu's (``redis://``, ``rediss://``, ``sentinel://``), except
that none of these ends the consumer, and with it the worker's main process and every request it holds:

* A message no task can be made of (no JSON, a body that does not decode as its properties say, no
  properties, headers Celery cannot read): anyone who can push onto the queue could stop every worker with
  one. It is dropped with one log line and ``reservations_messages_dropped_total{reason}``; its request
  comes back from its durable record, which the relay publishes again as a message that decodes.
* A broker at ``maxmemory`` (noeviction): redis-py's ``OutOfMemoryError`` is no error Celery recovers
  from. Here it is a connection error (the consumer connects again, as after a restart), and where a
  message is delivered it is caught (:class:`QoS`), so that a full broker can still be drained.
* A broker restarted under a consumer holding messages: kombu restores them through a connection it has
  already let go (AttributeError). :class:`QoS` leaves them to the broker then.

A channel also keeps one redis-py client per connection pool for the commands it sends on the pool (each
ack, a delivery's unacked record, each publish), where kombu made a client for every one: about a tenth of
a worker's main process, and of a producer's publishing thread.

:func:`install` edits kombu's alias table rather than naming a transport in ``broker_transport``: kombu
gives ``rediss://`` its TLS default only for a transport named ``rediss``, and on failover to the next
sentinel of a list takes the transport from that URL's scheme again.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
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

log = logging.getLogger("tasks.transport")

# How much of a value sent by whoever published a message goes into a log line.
SHOWN_CHARS = 120
# How often a full broker is logged at most while deliveries go on without their unacked record.
FULL_LOG_INTERVAL = 10.0

# An idempotency key as Celery's kwargsrepr header shows it: ``'idempotency_key': 'order-7'``.
_KEY_IN_REPR = re.compile(rf"""'idempotency_key': (['"])([!-~]{{1,{valid.MAX_KEY_CHARS}}}?)\1[,}}]""")
_REPR_SEARCHED = 4096  # Celery cuts kwargsrepr to about a kilobyte; nothing further is searched


def _shown(value: object) -> str:
    """A sender's value as a log line may carry it: printable characters only, cut at SHOWN_CHARS."""
    text = (value if isinstance(value, str) else repr(value))[: SHOWN_CHARS + 1]
    printable = "".join(ch if ch.isprintable() else "?" for ch in text[:SHOWN_CHARS])
    return printable + ("..." if len(text) > SHOWN_CHARS else "")


def identity(payload: object) -> dict[str, str | None]:
    """What identifies a message in a log line, from its headers where readable: task id, task name, and
    the idempotency key shown in ``kwargsrepr``."""
    headers = payload.get("headers") if isinstance(payload, Mapping) else None
    if not isinstance(headers, Mapping):
        return {"task_id": None, "task": None, "key": None}
    task_id, task = headers.get("id"), headers.get("task")
    shown = headers.get("kwargsrepr")
    found = _KEY_IN_REPR.search(shown[:_REPR_SEARCHED]) if isinstance(shown, str) else None
    key = None
    with suppress(InvalidRequest):
        key = valid.idempotency_key(found[2]) if found else None
    return {
        "task_id": None if task_id is None else _shown(task_id),
        "task": None if task is None else _shown(task),
        "key": key,
    }


def dropped(reason: metrics.DropReason, queue: object, payload: object, error: BaseException) -> None:
    """Log and count a message the consumer drops; ``payload`` is its JSON where it decoded (None else)."""
    metrics.current.dropped(reason)
    names = identity(payload)
    kind = type(error)  # binascii.Error, KeyError
    named = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    where = _shown(queue.decode(errors="replace") if isinstance(queue, bytes) else queue)
    log.error(
        "dropped a message from queue %s (task %s %s, key %s) that no task can be made of: %s: %s",
        where,
        names["task"],
        names["task_id"],
        names["key"],
        named,
        _shown(str(error)),
        extra={"event": "message_dropped", "reason": reason, "queue": where, **names},
    )


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
    """kombu's record of delivered messages, surviving a full broker (a delivery goes on without its
    unacked record, a requeue or restore waits) and a broker that restarted under it."""

    def append(self, message: Any, delivery_tag: str) -> None:
        try:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
        except OutOfMemoryError as exc:
            # BRPOP took the message and the broker refused to note it as unacked: it runs anyway. Should
            # this worker die before acking it, the relay publishes the request again from its record.
            _full.warn(
                "broker at maxmemory: a message is run without its unacked record (%s)",
                exc,
                event="broker_full",
            )
            # This process's record of it, which prefetch counts and the ack clears.
            virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]

    def _detached(self, what: str, count: int = 1) -> bool:
        """Whether kombu already let go of this channel's pool and connection (the broker restarted): then
        ``what`` is left to the broker's unacked record, which the visibility timeout brings back."""
        channel = self.channel
        if channel._pool is not None or getattr(channel.connection, "client", None) is not None:
            return False
        log.warning("broker connection closed: %s %d message(s) left to the broker", what, count)
        return True

    def ack(self, delivery_tag: str) -> None:
        if self._detached("the ack of"):
            virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]
            return
        try:
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]
        except OutOfMemoryError:
            self._unrecord(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if self._detached("the rejection of"):
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
        """Take a message off a full broker's unacked record. kombu does it in MULTI, where a full broker
        refuses every command; on their own ZREM and HDEL are never refused. Otherwise this process would
        count the message unacked forever, and stop consuming once it holds its prefetch of them."""
        with self.channel.conn_or_acquire() as client:
            client.zrem(self.unacked_index_key, delivery_tag)
            client.hdel(self.unacked_key, delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]

    def restore_unacked(self, client: Any = None) -> Any:
        # kombu forgets acked ones lazily
        if client is None and self._detached("the restore of", len(self._delivered.keys() - self._dirty)):
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
    """A Redis channel whose BRPOP replies that are no JSON are dropped, becoming no reply (as when BRPOP
    times out) rather than an error out of the consumer's event loop. Decoded twice, here and by kombu:
    a small price for leaving kombu's read as it is."""

    QoS = QoS
    sep: str
    pool: Any
    _shared_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if not asynchronous:
            # kombu makes a client for each command it sends on the pool (a delivery's unacked record,
            # each ack, each publish), and a redis-py client builds its table of reply parsers as it is
            # made: about a tenth of a worker's main process. One client per pool serves them all, the
            # pool handing each command a connection; a new pool (kombu drops it on a reconnect) gets
            # a client of its own.
            pool = self.pool
            shared = self._shared_client
            if shared is None or shared.connection_pool is not pool:
                shared = self._shared_client = super()._create_client(False)  # type: ignore[misc]
            return shared
        # The client whose connection BRPOPs (kombu's Channel.client).
        client = super()._create_client(True)  # type: ignore[misc]
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
    """A Redis transport whose deliveries cannot raise out of the consumer for what a message holds:
    in ``_deliver`` kombu builds its Message and Celery reads it. An error there that is no broker error is
    the message's: it is dropped, and taken off the unacked record, or it would come back to be dropped
    again."""

    channels: list[Any]
    connection_errors: tuple[type[BaseException], ...]
    channel_errors: tuple[type[BaseException], ...]

    def _deliver(self, message: Any, queue: str) -> None:
        properties = message.get("properties") if isinstance(message, Mapping) else None
        tag = properties.get("delivery_tag") if isinstance(properties, Mapping) else None
        held = [channel for channel in self.channels if _holds(channel, tag)]
        try:
            super()._deliver(message, queue)  # type: ignore[misc]
        except Exception as exc:
            # A broker error the consumer recovers from by connecting again. kombu counts KeyError among
            # its Redis connection errors; in a delivery it is a field the message lacks.
            broker = (RedisError, OSError, InconsistencyError, *self.connection_errors)
            if isinstance(exc, broker) and not isinstance(exc, KeyError):
                raise
            dropped("malformed", queue, message, exc)
            for channel in self.channels:
                if channel not in held and _holds(channel, tag):
                    channel.qos.reject(tag, requeue=False)


def _holds(channel: Any, tag: Any) -> bool:
    try:
        return tag is not None and tag in channel.qos._delivered
    except TypeError:  # a tag that cannot be a key (a list): no channel holds it
        return False


class Channel(_Screened, kombu_redis.Channel):
    pass


class SentinelChannel(_Screened, kombu_redis.SentinelChannel):
    pass


# A full broker is a connection error here: Celery's consumer recovers only from those.
class Transport(_Delivering, kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel
    connection_errors = (*kombu_redis.Transport.connection_errors, OutOfMemoryError)


class SentinelTransport(_Delivering, kombu_redis.SentinelTransport):  # type: ignore[misc]
    Channel = SentinelChannel
    connection_errors = (*kombu_redis.SentinelTransport.connection_errors, OutOfMemoryError)


SCHEMES = {"redis": Transport, "rediss": Transport, "sentinel": SentinelTransport}


def install() -> None:
    """Make kombu resolve the ``SCHEMES`` to these transports in this process."""
    for scheme, transport in SCHEMES.items():
        kombu.transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:{transport.__name__}"
        # kombu caches the class it resolved for a name: one resolved before this would stay.
        kombu.transport._transport_cache.pop(scheme, None)
