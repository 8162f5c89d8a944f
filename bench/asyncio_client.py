"""The asyncio producer as a web service uses it: enqueue rate against Celery's own ``delay()`` from the
same process, and, with real workers, how late the event loop runs (a ticker sleeping 1 ms) and how fast
awaited outcomes arrive while 100 / 1,000 / 10,000 enqueue-and-await calls are in flight.

Baselines: ``Task.delay`` of the same task to the same broker (enqueue); the workers' own rate, read off
the outcome rows' commit times (completions: the awaiting side should keep up with it).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from operator import truediv
from pathlib import Path

import redis

from bench.env import Scratch
from bench.tasks_e2e import CONCURRENCY, POOL
from bench.timing import CaseStats, Progress, Results
from reservations import Inventory, schema
from tasks import ReservationClient, create_app
from tasks.settings import Settings
from testing.celery_processes import CeleryProcess, stop_all, worker_env
from testing.redis_servers import redis_server

SECTION_ENQUEUE = "asyncio producer: enqueue rate, one process, same broker"
SECTION_LAG = "asyncio producer: event loop lag and awaited completions with real workers"
ENQUEUE_ASYNC = "await client.enqueue_reservation, all in flight"
ENQUEUE_DELAY = "Celery Task.delay, one after another"
TICK = 0.001
SKUS = 64
ON_HAND = 1_000_000


async def _ticker(stop: asyncio.Event, lags: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(TICK)
        lags.append(loop.time() - before - TICK)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _enqueue_cases(
    client: ReservationClient, delay: Callable[[str, int], object], broker: redis.Redis, count: int
) -> dict[str, Callable[[], float]]:
    """Each case publishes ``count`` reserve messages that no worker consumes; returns seconds taken."""

    def asynchronous() -> float:
        tag = uuid.uuid4().hex[:8]

        async def burst() -> float:
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    client.enqueue_reservation(f"E-{i % SKUS}", 1, idempotency_key=f"{tag}-{i}")
                    for i in range(count)
                )
            )
            return time.perf_counter() - start

        seconds = asyncio.run(burst())
        broker.delete("celery")
        return seconds

    def delayed() -> float:
        start = time.perf_counter()
        for i in range(count):
            delay(f"E-{i % SKUS}", i)
        seconds = time.perf_counter() - start
        broker.delete("celery")
        return seconds

    return {ENQUEUE_ASYNC: asynchronous, ENQUEUE_DELAY: delayed}


async def _in_flight(client: ReservationClient, count: int) -> tuple[list[float], float, str]:
    """``count`` enqueue-and-await calls at once, a ticker alongside; returns the ticker's lags, the
    seconds until the last outcome was awaited, and the tag of the keys."""
    tag = uuid.uuid4().hex[:8]
    lags: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticker(stop, lags))

    async def one(i: int) -> str:
        handle = await client.enqueue_reservation(f"S-{i % SKUS}", 1, idempotency_key=f"{tag}-{i}")
        return (await handle.result(timeout=600)).status

    start = time.perf_counter()
    statuses = await asyncio.gather(*(one(i) for i in range(count)))
    seconds = time.perf_counter() - start
    stop.set()
    await ticker
    wrong = [s for s in statuses if s != "reserved"]
    if wrong:
        raise RuntimeError(f"{len(wrong)} of {count} requests not reserved: {wrong[:3]}")
    return lags, seconds, tag


def _workers_rate(inventory: Inventory, tag: str, count: int) -> float:
    """Outcomes per second as the workers committed them (first to last outcome row of the burst)."""
    keys = [f"{tag}-{i}" for i in range(count)]
    stamps = [
        outcome.at
        for start in range(0, count, 1000)
        for outcome in inventory.request_outcomes(keys[start : start + 1000]).values()
    ]
    span = max(stamps) - min(stamps)
    return count / span if span > 0 else float("inf")


def asyncio_producer(
    scratch: Scratch,
    results: Results,
    *,
    enqueues: int,
    in_flight: tuple[int, ...],
    repeats: int,
    progress: Progress | None = None,
) -> None:
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="fencing-bench-asyncio-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        base = stack.enter_context(redis_server(workdir / "redis")).url(None)
        database_url = scratch.postgres_url("asyncio")
        schema.upgrade(database_url)
        inventory = stack.enter_context(Inventory.from_url(database_url))
        for n in range(SKUS):
            inventory.add_sku(f"S-{n}", on_hand=ON_HAND)
        settings = Settings(
            broker_url=f"{base}/0",
            result_backend=f"{base}/1",
            database_url=database_url,
            lease_url=f"{base}/2",
        )
        app = create_app(settings)
        stack.callback(app.close)
        broker = redis.Redis.from_url(f"{base}/0")
        stack.callback(broker.close)

        # Enqueue alone, before any worker runs: nothing consumes the messages, each case deletes them.
        if progress:
            progress(f"  enqueue: {enqueues} messages per case, {repeats} runs")
        # The task under its name on this app, for Task.delay to publish (this process never runs it).
        def reserve(*args: object, **kwargs: object) -> None:
            return None

        reserve_task = app.task(name="reservations.reserve", typing=False)(reserve)

        def delay(sku: str, i: int) -> object:
            return reserve_task.delay(sku=sku, quantity=1, idempotency_key=f"d-{uuid.uuid4().hex}")

        enqueue_stats = {name: CaseStats(name) for name in (ENQUEUE_ASYNC, ENQUEUE_DELAY)}
        for round_ in range(repeats + 1):  # the first round warms both up and is not kept
            client = ReservationClient(app)
            try:
                cases = _enqueue_cases(client, delay, broker, enqueues)
                for name, run in cases.items():
                    seconds = run()
                    if round_ > 0:
                        enqueue_stats[name].ops_per_s.append(enqueues / seconds)
                        enqueue_stats[name].latencies.append(seconds / enqueues)
            finally:
                client.close()
        results.add(SECTION_ENQUEUE, enqueue_stats, ENQUEUE_ASYNC, ENQUEUE_DELAY)

        worker = CeleryProcess(
            "bench-asyncio", worker_env(settings), workdir / "worker.log", pool=POOL, concurrency=CONCURRENCY
        )
        stack.callback(stop_all, [worker])
        worker.start()
        worker.wait_ready()

        async def measured(count: int) -> tuple[list[float], float, str]:
            async with ReservationClient(app) as client:
                return await _in_flight(client, count)

        asyncio.run(measured(50))  # warm-up: imports, connections, statement caches
        for count in in_flight:
            runs = 1 if count >= 10_000 else repeats
            if progress:
                progress(f"  {count} in flight, {runs} run(s)")
            lags: list[float] = []
            awaited, produced, elapsed = [], [], 0.0
            for _ in range(runs):
                run_lags, seconds, tag = asyncio.run(measured(count))
                lags.extend(run_lags)
                elapsed += seconds
                awaited.append(count / seconds)
                produced.append(_workers_rate(inventory, tag, count))
            quantiles = statistics.quantiles(lags, n=100, method="inclusive")
            results.cost(
                SECTION_LAG,
                f"{count} enqueue + await in flight",
                {
                    "loop lag p50": _ms(quantiles[49]),
                    "loop lag p99": _ms(quantiles[98]),
                    "loop lag max": _ms(max(lags)),
                    "ticks/s": f"{len(lags) / elapsed:,.0f}",
                    "awaited/s": f"{statistics.median(awaited):,.0f}",
                    "workers' own rate/s": f"{statistics.median(produced):,.0f}",
                    "ratio": f"{statistics.median(map(truediv, awaited, produced)):.2f}x",
                },
            )
        results.notes.append(
            f"asyncio rows: enqueue = {enqueues} reserve messages published to a private redis-server "
            "with no worker consuming (queue deleted after each case), the client's awaited enqueues all "
            "in flight vs Task.delay one after another from the same process, medians of "
            f"{repeats} runs after a warm-up round. Loop lag: a coroutine sleeping {TICK * 1000:.0f} ms "
            "in a loop records how late each wake-up is, while N enqueue + await calls run on the same "
            "loop against one worker (prefork -c 2, Redis leases); awaited/s = N / time to the last "
            "awaited outcome, workers' own rate = N / span of the outcome rows' commit times. 10,000 in "
            "flight: one run."
        )

