"""How many requests wait in the broker's queue, sampled in the background for the door's backpressure:
asking the broker on every request would put a broker round trip (a blocking kombu call) in front of each
one; one sampler per process asks every ``every`` seconds in a thread and the routes read the last figure.
A passive queue declaration answers on both transports: Redis counts the list (every priority step),
RabbitMQ the ready messages. The last successful sample also tells readiness the broker answers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from kombu.exceptions import ChannelError

# Retry-After for an overloaded door when the queue's drain rate is not known yet.
DEFAULT_RETRY_AFTER = 2
MAX_RETRY_AFTER = 60


def retry_after(depth: int, bound: int, drained_per_second: float | None) -> int:
    """Seconds until the queue is expected back under its bound, at the rate it drained lately (whole
    seconds, 1 to 60); :data:`DEFAULT_RETRY_AFTER` while that rate is unknown or nothing drains."""
    if drained_per_second is None or drained_per_second <= 0:
        return DEFAULT_RETRY_AFTER
    return max(1, min(MAX_RETRY_AFTER, math.ceil((depth - bound) / drained_per_second)))


@dataclass(eq=False)
class Backlog:
    """The broker queue's depth, sampled every ``every`` seconds by :meth:`run` (a task of the app)."""

    connect: Callable[[], Any]
    queue: str
    _: KW_ONLY
    every: float = 0.5
    clock: Callable[[], float] = time.monotonic
    depth: int | None = field(default=None, init=False)
    sampled_at: float | None = field(default=None, init=False)  # the last successful sample, on ``clock``
    drained_per_second: float | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)
    _connection: Any = field(default=None, init=False)

    def answered_within(self, seconds: float) -> bool:
        """Whether the broker answered a sample within the last ``seconds``."""
        return self.sampled_at is not None and self.clock() - self.sampled_at <= seconds

    def over(self, bound: int) -> bool:
        return bound > 0 and self.depth is not None and self.depth > bound

    def _count(self) -> int:
        """One sample (blocking: run in a thread)."""
        if self._connection is None:
            self._connection = self.connect()
            # Once: kombu's default is to retry a connection forever, and this thread must come back.
            self._connection.ensure_connection(max_retries=1)
        try:
            declared = self._connection.default_channel.queue_declare(queue=self.queue, passive=True)
        except ChannelError:
            # No queue: on Redis an empty one (its list exists only while it holds messages), and the
            # connection serves the next sample; on RabbitMQ one not declared yet, whose channel the broker
            # closed: a new connection next time. Reconnecting at every sample of an empty Redis queue
            # cost about 4 ms of CPU, twice a second.
            if self._connection.transport.driver_type != "redis":
                self.close()
            return 0
        return int(declared.message_count)

    def sample(self, count: int, at: float) -> None:
        """Take a sample of ``count`` at ``at``: the depth, and how fast it went down since the last."""
        if self.depth is not None and self.sampled_at is not None and at > self.sampled_at:
            drained = (self.depth - count) / (at - self.sampled_at)
            if drained > 0:
                self.drained_per_second = drained
        self.depth, self.sampled_at, self.error = count, at, None

    async def run(self) -> None:
        while True:
            try:
                count = await asyncio.to_thread(self._count)
            except Exception as exc:  # the broker is down or unreachable: readiness says so
                self.error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                self.close()
            else:
                self.sample(count, self.clock())
            await asyncio.sleep(self.every)

    def close(self) -> None:
        if self._connection is not None:
            with suppress(Exception):
                self._connection.release()
            self._connection = None
