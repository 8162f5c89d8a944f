"""One timed burst of Celery tasks: N tasks enqueued at once, timed from the first enqueue to the last
outcome (by AsyncResult, or by the outcome rows), for no-op tasks and for reservations; or N requests of
two tasks each, the second enqueued once the first's outcome is in (a reserve then its confirm, two
no-ops).
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from celery import Celery
from celery.result import AsyncResult

from bench import celery_defaults
from bench.leases import UnexpectedReply
from reservations import Inventory
from reservations.request_outcomes import request_id
from tasks import ReservationClient, ReservationHandle

ON_HAND = 10**6  # each SKU's stock when seeded: no burst runs out of it


def round_robin(skus: list[str], bursts: list[int]) -> dict[str, int]:
    """Units reserved per SKU by bursts that each hand out their tasks round-robin over ``skus``."""
    counts = dict.fromkeys(skus, 0)
    for count in bursts:
        for i in range(count):
            counts[skus[i % len(skus)]] += 1
    return counts


def seed(url: str, skus: list[str]) -> None:
    with Inventory.from_url(url) as inventory:
        for sku in skus:
            inventory.add_sku(sku, on_hand=ON_HAND)


def check_stock(url: str, expected: dict[str, int], confirmed: dict[str, int] | None = None) -> str:
    """Every SKU of ``expected`` holds exactly the reservations its requests asked for (those confirmed
    left it), every SKU of ``confirmed`` has on hand less the units its confirms took, and the inventory is
    consistent: a burst that applied a request twice (or lost one) would have timed different work."""
    confirmed = confirmed or {}
    with Inventory.from_url(url) as inventory:
        problems = inventory.invariant_violations()
        levels = {level.sku: level for level in inventory.all_stock()}
    held = {sku: level.reserved for sku, level in levels.items()}
    shelf = {sku: level.on_hand for sku, level in levels.items()}
    wrong = [
        (sku, "reserved", held.get(sku), want) for sku, want in expected.items() if held.get(sku) != want
    ]
    wrong += [
        (sku, "on hand", shelf.get(sku), ON_HAND - units)
        for sku, units in confirmed.items()
        if shelf.get(sku) != ON_HAND - units
    ]
    if problems or wrong:
        raise UnexpectedReply(f"stock check failed: {problems[:3]}; (sku, what, found, wanted): {wrong[:3]}")
    done = f"{sum(expected.values())} reservations on {len(expected)} SKUs"
    confirms = f", and {sum(confirmed.values())} more reserved then confirmed on {len(confirmed)} SKUs"
    return done + (confirms if confirmed else "")


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


def retries_of(results: Iterable[AsyncResult]) -> int | None:
    """The Celery retries of ``results``; None when a result does not carry its count (a result stored
    without Celery's extended metadata)."""
    counts = [result.retries for result in results]
    return None if any(count is None for count in counts) else sum(counts)


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


Sent = tuple[float, AsyncResult]  # when a task was enqueued (Unix time), and its result


def _noops(app: Celery, in_flight: InFlight, task: str, count: int) -> Iterator[Sent]:
    for i in range(count):
        yield time.time(), in_flight.track(app.send_task(task, args=[i]))


def noop_burst(app: Celery, in_flight: InFlight, task: str) -> BurstFn:
    def run(tag: str, count: int) -> Burst:
        deadline = _deadline(count)
        start = time.perf_counter()
        sent = list(_noops(app, in_flight, task, count))
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


def _reserves(
    app: Celery, client: ReservationClient, skus: list[str], in_flight: InFlight, tag: str, count: int
) -> Iterator[Sent]:
    """Reservations enqueued as :func:`_enqueue` does, each with its request's Celery result."""
    for at, handle in _enqueue(client, skus, tag, count):
        yield at, in_flight.track(app.AsyncResult(request_id(handle.key)))


def _all_ended(want: str, tag: str, statuses: list[Any]) -> None:
    wrong = [status for status in statuses if status != want]
    if wrong:
        raise UnexpectedReply(f"{len(wrong)} of {len(statuses)} requests in {tag} not {want}: {wrong[:3]}")


Sends = Callable[[str, int], Iterable[Sent]]  # (tag, count) -> the burst's reservations as enqueued


def _reserved_burst(send: Sends, in_flight: InFlight) -> BurstFn:
    """Reservations enqueued by ``send`` all at once, each waited on by AsyncResult.get in enqueue order,
    every one of them ``reserved``."""

    def run(tag: str, count: int) -> Burst:
        deadline = _deadline(count)
        start = time.perf_counter()
        sent = list(send(tag, count))
        outcomes = [result.get(timeout=_left(deadline)) for _, result in sent]
        seconds = time.perf_counter() - start
        in_flight.done()
        _all_ended("reserved", tag, [outcome.get("status") for outcome in outcomes])
        return Burst(
            seconds,
            [_done_at(result) - at for at, result in sent],
            retries=retries_of(result for _, result in sent),
        )

    return run


def reserve_burst_result(
    app: Celery, client: ReservationClient, skus: list[str], in_flight: InFlight
) -> BurstFn:
    """Waits through the Celery result backend, exactly as the no-op baseline does."""
    return _reserved_burst(lambda tag, count: _reserves(app, client, skus, in_flight, tag, count), in_flight)


# Writes a request's record (its arguments, its task id, its operation) before it is published.
Record = Callable[[dict[str, Any], str, str], None]


def _raw_reserves(
    app: Celery, skus: list[str], in_flight: InFlight, task: str, record: Record | None, tag: str, count: int
) -> Iterator[Sent]:
    """The physical reference's reservations (bench.raw_tasks, task ``task``), round-robin over ``skus``,
    each recorded first when there is a ``record``."""
    for i in range(count):
        kwargs = {"sku": skus[i % len(skus)], "quantity": 1, "idempotency_key": f"{tag}-{i}"}
        at, task_id = time.time(), str(uuid.uuid4())
        if record is not None:
            record(kwargs, task_id, "reserve")
        yield at, in_flight.track(app.send_task(task, kwargs=kwargs, task_id=task_id))


def raw_reserve_burst(
    app: Celery, skus: list[str], in_flight: InFlight, task: str, record: Record | None = None
) -> BurstFn:
    """:func:`_raw_reserves` waited on as :func:`reserve_burst_result` waits. Its app stores no retry
    counts, so its retries are not seen."""
    return _reserved_burst(partial(_raw_reserves, app, skus, in_flight, task, record), in_flight)


def reserve_burst_poll(client: ReservationClient, skus: list[str]) -> BurstFn:
    """Waits the way the client's API does: polling the request's outcome row in the database."""

    def run(tag: str, count: int) -> Burst:
        deadline = _deadline(count)
        start = time.perf_counter()
        sent = list(_enqueue(client, skus, tag, count))
        outcomes = [handle.result_sync(timeout=_left(deadline)) for _, handle in sent]
        seconds = time.perf_counter() - start
        _all_ended("reserved", tag, [outcome.status for outcome in outcomes])
        # The outcome row's time is the database's clock, on this same host.
        latencies = [outcome.at - at for (at, _), outcome in zip(sent, outcomes, strict=True)]
        return Burst(seconds, latencies, retries=None)

    return run


Then = Callable[[int, Any], AsyncResult]  # (a request's index, its first task's result) -> its second task


def _two_steps(
    first: Iterable[Sent], then: Then, in_flight: InFlight, deadline: float
) -> tuple[Burst, list[Any]]:
    """Requests of two tasks: every first task enqueued at once (``first`` enqueues as it is read), their
    results waited in enqueue order, and each request's second task enqueued as soon as its first one's
    result is in; done when every second task has its result, whose values are returned. Latency: a
    request's first enqueue to its second task's result stored."""
    start = time.perf_counter()
    sent = list(first)
    second = [
        (at, in_flight.track(then(i, result.get(timeout=_left(deadline)))))
        for i, (at, result) in enumerate(sent)
    ]
    values = [result.get(timeout=_left(deadline)) for _, result in second]
    seconds = time.perf_counter() - start
    in_flight.done()
    return Burst(
        seconds,
        [_done_at(result) - at for at, result in second],
        retries=retries_of(result for _, result in sent + second),
    ), values


def _reservation_of(tag: str, index: int, outcome: dict[str, Any]) -> tuple[str, str]:
    """The id and SKU of the one reservation a reserve's outcome made; a reserve that made none ends the
    burst."""
    detail = outcome.get("detail", {})
    ids, stock = detail.get("reservation_ids") or [], detail.get("stock") or []
    if outcome.get("status") != "reserved" or len(ids) != 1 or len(stock) != 1:
        raise UnexpectedReply(f"reservation {index} of {tag} has nothing to confirm: {outcome!r}")
    return str(ids[0]), str(stock[0]["sku"])


def life_burst(app: Celery, client: ReservationClient, skus: list[str], in_flight: InFlight) -> BurstFn:
    """A reservation's life as requests: its reserve, waited on as :func:`reserve_burst_result` waits, then
    a confirm of the reservation it made, enqueued through the client with the SKU its reserve's outcome
    names (the worker's lease taken without a read) and waited on the same way."""

    def run(tag: str, count: int) -> Burst:
        def confirm(index: int, outcome: dict[str, Any]) -> AsyncResult:
            reservation, sku = _reservation_of(tag, index, outcome)
            key = f"{tag}-{index}-confirm"
            handle = client.enqueue_sync(
                "confirm", idempotency_key=key, reservation_id=reservation, sku_hint=sku
            )
            return app.AsyncResult(request_id(handle.key))

        reserves = _reserves(app, client, skus, in_flight, tag, count)
        burst, outcomes = _two_steps(reserves, confirm, in_flight, _deadline(2 * count))
        _all_ended("confirmed", tag, [outcome.get("status") for outcome in outcomes])
        return burst

    return run


def raw_life_burst(
    app: Celery,
    skus: list[str],
    in_flight: InFlight,
    reserve: str,
    confirm: str,
    record: Record,
) -> BurstFn:
    """A reservation's life on the physical reference (bench.raw_tasks): its reserve, then a confirm of
    the reservation it made, each recorded before it is published and waited on as :func:`life_burst`
    waits."""

    def run(tag: str, count: int) -> Burst:
        def confirmed(index: int, outcome: dict[str, Any]) -> AsyncResult:
            reservation, sku = _reservation_of(tag, index, outcome)
            kwargs = {"sku": sku, "reservation_id": reservation, "idempotency_key": f"{tag}-{index}-confirm"}
            task_id = str(uuid.uuid4())
            record(kwargs, task_id, "confirm")
            return app.send_task(confirm, kwargs=kwargs, task_id=task_id)

        reserves = _raw_reserves(app, skus, in_flight, reserve, record, tag, count)
        burst, outcomes = _two_steps(reserves, confirmed, in_flight, _deadline(2 * count))
        _all_ended("confirmed", tag, [outcome.get("status") for outcome in outcomes])
        return burst

    return run


def noop_pair_burst(app: Celery, in_flight: InFlight, task: str) -> BurstFn:
    """Two no-ops a request, as :func:`life_burst` has a reserve and a confirm: the second no-op enqueued
    with the first one's result once it is in."""

    def run(tag: str, count: int) -> Burst:
        def again(index: int, value: Any) -> AsyncResult:
            return app.send_task(task, args=[value])

        noops = _noops(app, in_flight, task, count)
        burst, values = _two_steps(noops, again, in_flight, _deadline(2 * count))
        if values != list(range(count)):
            raise UnexpectedReply(f"no-op pair burst {tag} returned {values[:5]}...")
        return burst

    return run
