"""Whether the broker still carries a request's message: the relay's way to tell a lost message from one
that is queued or being worked on, so that a backlog is not flooded with copies.

On Redis (kombu's transport) a message is in one of two places: its queue (a list per priority step), or
the unacknowledged set (a hash of delivery tag to message, with the delivery time in a sorted index)
while a worker holds it. A message taken by BRPOP and not yet written to the unacknowledged set (a worker
killed between the two) is in neither: lost. An unacknowledged message whose worker died stays in the
set until the visibility timeout gives it back; one held longer than ``held_for`` is counted as not
carried, so its request is published again long before that (a copy is harmless).

RabbitMQ cannot be looked into without taking messages: there the relay knows nothing (None) and
spaces its copies out instead (tasks.relay).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# Messages read per LRANGE or HSCAN: a 10,000-message backlog is ten round trips.
CHUNK = 1000

Presence = Callable[[], set[str]]


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
        start = 0
        while True:
            chunk = client.lrange(key, start, start + CHUNK - 1)
            for payload in chunk:
                task_id = _task_id(payload)
                if task_id is not None:
                    yield task_id
            if len(chunk) < CHUNK:
                break
            start += CHUNK


def _held(client: Any, hash_key: str, index_key: str, since: float) -> Iterator[str]:
    fresh = {_text(tag) for tag in client.zrangebyscore(index_key, since, "+inf")}
    if not fresh:
        return
    for tag, payload in client.hscan_iter(hash_key, count=CHUNK):
        task_id = _task_id(payload) if _text(tag) in fresh else None
        if task_id is not None:
            yield task_id


def redis_presence(
    connection: Any, queues: Iterable[str], held_for: float, clock: Callable[[], float] = time.time
) -> Presence:
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
