"""One timed burst of Celery tasks: N tasks enqueued at once, timed from the first enqueue to the last
outcome (by AsyncResult, or by the outcome rows), for no-op tasks and for reservations.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery.result import AsyncResult

from bench import celery_defaults
from bench.leases import UnexpectedReply
from reservations import Inventory
from reservations.requests import request_id
from tasks import ReservationClient, ReservationHandle


@dataclass(frozen=True)
class Burst:
    """One timed burst: wall time, each task's enqueue-to-outcome latency, and Celery retries in it
    (``None`` where the wait does not see them: the outcome row does not record retries)."""

    seconds: float
    latencies: list[float]
    retries: int | None


# A burst that is not done by then has a dead or wedged worker; generous because busy leases retry.
BURST_TIMEOUT_PER_TASK = 0.5
MIN_BURST_TIMEOUT = 30.0

BurstFn = Callable[[str, int], Burst]  # (unique tag for this burst's keys, task count) -> Burst

OUTCOME_READ = 1000  # keys per outcome read (Inventory.request_outcomes takes at most that many)


def outcomes_in(inventory: Inventory, keys: list[str]) -> Counter[str] | None:
    """The statuses of ``keys`` once every one of them has an outcome; None before."""
    statuses: Counter[str] = Counter()
    for start in range(0, len(keys), OUTCOME_READ):
        found = inventory.request_outcomes(keys[start : start + OUTCOME_READ])
        statuses.update(outcome.status for outcome in found.values())
    return statuses if statuses.total() == len(keys) else None


def _done_at(result: AsyncResult) -> float:
    """When the worker stored the result (its clock; same host as ours), as a Unix time."""
    done = result.date_done
    if not isinstance(done, dt.datetime):
        raise UnexpectedReply(f"task {result.id} has no date_done: {done!r}")
    if done.tzinfo is None:  # Celery stores UTC; older versions leave it naive
        done = done.replace(tzinfo=dt.UTC)
    return done.timestamp()


def _deadline(count: int) -> float:
    return time.monotonic() + max(MIN_BURST_TIMEOUT, count * BURST_TIMEOUT_PER_TASK)


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


class InFlight:
    """The AsyncResults of the burst under way, released from their backend if the burst never ends.

    Each one is subscribed to its task's result channel. An interrupted burst's results outlive it in
    the traceback's frames, and their ``__del__`` unsubscribes: after our redis-server is gone Celery
    retries that reconnect for many seconds before giving up, so a Ctrl-C would hang. Released while
    the server is still up, their later ``__del__`` has nothing left to unsubscribe.
    """

    def __init__(self) -> None:
        self.results: list[AsyncResult] = []

    def track(self, result: AsyncResult) -> AsyncResult:
        self.results.append(result)
        return result

    def done(self) -> None:
        self.results.clear()

    def release(self) -> None:
        for result in self.results:
            result.backend.remove_pending_result(result)
        self.results.clear()


def noop_burst(app: Celery, in_flight: InFlight, task: str) -> BurstFn:
    def run(tag: str, count: int) -> Burst:
        deadline = _deadline(count)
        sent: list[tuple[float, AsyncResult]] = []
        start = time.perf_counter()
        for i in range(count):
            sent.append((time.time(), in_flight.track(app.send_task(task, args=[i]))))
        values = [result.get(timeout=_left(deadline)) for _, result in sent]
        seconds = time.perf_counter() - start
        in_flight.done()
        if values != list(range(count)):
            raise UnexpectedReply(f"noop burst {tag} returned {values[:5]}...")
        return Burst(seconds, [_done_at(result) - at for at, result in sent], retries=0)

    return run


def noop_no_result_burst(app: Celery, in_flight: InFlight) -> BurstFn:
    """No-ops that store no result, the last one excepted: with nothing to wait on, the burst ends when
    that last one's result is stored. Tasks run in queue order, so at most the other pool slots' last
    no-ops can still be running then: a no-op's run time each, against a burst of many."""

    def run(tag: str, count: int) -> Burst:
        deadline = _deadline(count)
        start = time.perf_counter()
        for i in range(count - 1):
            # ignore_result on the message too: the producer then does not subscribe to its result.
            app.send_task(celery_defaults.NOOP_NO_RESULT, args=[i], ignore_result=True)
        last = in_flight.track(app.send_task(celery_defaults.NOOP, args=[count - 1]))
        value = last.get(timeout=_left(deadline))
        seconds = time.perf_counter() - start
        in_flight.done()
        if value != count - 1:
            raise UnexpectedReply(f"no-result burst {tag} ended with {value!r}")
        return Burst(seconds, [], retries=0)

    return run


def _enqueue(
    client: ReservationClient, skus: list[str], tag: str, count: int
) -> Iterator[tuple[float, ReservationHandle]]:
    for i in range(count):
        at = time.time()
        yield at, client.enqueue_reservation_sync(skus[i % len(skus)], 1, idempotency_key=f"{tag}-{i}")


def _not_reserved(tag: str, count: int, statuses: list[Any]) -> None:
    wrong = [status for status in statuses if status != "reserved"]
    if wrong:
        raise UnexpectedReply(f"{len(wrong)} of {count} reservations in {tag} not reserved: {wrong[:3]}")


def reserve_burst_result(
    app: Celery, client: ReservationClient, skus: list[str], in_flight: InFlight
) -> BurstFn:
    """Waits through the Celery result backend, exactly as the no-op baseline does."""

    def run(tag: str, count: int) -> Burst:
        deadline = _deadline(count)
        start = time.perf_counter()
        sent = [
            (at, in_flight.track(app.AsyncResult(request_id(handle.key))))
            for at, handle in _enqueue(client, skus, tag, count)
        ]
        outcomes = [result.get(timeout=_left(deadline)) for _, result in sent]
        seconds = time.perf_counter() - start
        in_flight.done()
        _not_reserved(tag, count, [outcome.get("status") for outcome in outcomes])
        return Burst(
            seconds,
            [_done_at(result) - at for at, result in sent],
            retries=sum(result.retries or 0 for _, result in sent),
        )

    return run


def reserve_burst_poll(client: ReservationClient, skus: list[str]) -> BurstFn:
    """Waits the way the client's API does: polling the request's outcome row in the database."""

    def run(tag: str, count: int) -> Burst:
        deadline = _deadline(count)
        start = time.perf_counter()
        sent = list(_enqueue(client, skus, tag, count))
        outcomes = [handle.result_sync(timeout=_left(deadline)) for _, handle in sent]
        seconds = time.perf_counter() - start
        _not_reserved(tag, count, [outcome.status for outcome in outcomes])
        # The outcome row's time is the database's clock, on this same host.
        latencies = [outcome.at - at for (at, _), outcome in zip(sent, outcomes, strict=True)]
        return Burst(seconds, latencies, retries=None)

    return run
