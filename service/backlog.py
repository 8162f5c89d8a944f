"""How many requests wait in the broker's queue, sampled in the background for the door's backpressure.

Asking the broker on every request would put a broker round trip (and a blocking kombu call) in front of
each one; one sampler per process asks every ``every`` seconds in a thread and the routes read the last
figure. A passive queue declaration answers on both transports: Redis counts the list (every priority
step), RabbitMQ the ready messages. A queue that does not exist yet holds nothing. The last successful
sample also tells readiness the broker answers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from kombu.exceptions import ChannelError

log = logging.getLogger("service.backlog")

# Retry-After for an overloaded door when the queue's drain rate is not known yet.
DEFAULT_RETRY_AFTER = 2
MAX_RETRY_AFTER = 60


def retry_after(depth: int, bound: int, drained_per_second: float | None) -> int:
    """Seconds until the queue is expected back under its bound, at the rate it drained lately (whole
    seconds, 1 to 60); :data:`DEFAULT_RETRY_AFTER` while that rate is unknown or nothing drains."""
    if drained_per_second is None or drained_per_second <= 0:
        return DEFAULT_RETRY_AFTER
    return max(1, min(MAX_RETRY_AFTER, math.ceil((depth - bound) / drained_per_second)))


class Backlog:
    """The broker queue's depth, sampled every ``every`` seconds by :meth:`run` (a task of the app)."""

    def __init__(
        self,
        connect: Callable[[], Any],
        queue: str,
        *,
        every: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self.queue = queue
        self.every = every
        self._clock = clock
        self._connection: Any = None
        self.depth: int | None = None
        self.sampled_at: float | None = None  # the last successful sample, on ``clock``
        self.drained_per_second: float | None = None
        self.error: str | None = None

    def answered_within(self, seconds: float) -> bool:
        """Whether the broker answered a sample within the last ``seconds``."""
        return self.sampled_at is not None and self._clock() - self.sampled_at <= seconds

    def over(self, bound: int) -> bool:
        return bound > 0 and self.depth is not None and self.depth > bound

    def _count(self) -> int:
        """One sample (blocking: run in a thread)."""
        if self._connection is None:
            self._connection = self._connect()
            # Once: kombu's default is to retry a connection forever, and this thread must come back.
            self._connection.ensure_connection(max_retries=1)
        try:
            declared = self._connection.default_channel.queue_declare(queue=self.queue, passive=True)
        except ChannelError:  # not declared yet (RabbitMQ closes the channel: a new one next time)
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
                self.sample(count, self._clock())
            await asyncio.sleep(self.every)

    def close(self) -> None:
        if self._connection is not None:
            with suppress(Exception):
                self._connection.release()
            self._connection = None
