"""End to end through Celery: reservation tasks against no-op tasks, under Celery's defaults (results on and
off) and under the project's settings, on one private redis-server, pool and concurrency. One case is a burst
of N tasks enqueued at once, timed from the first enqueue to the last outcome; Redis commands per task come
from the server's command counters, PostgreSQL round trips per task from a counting proxy in front of a worker
of their own. One hot SKU against many is :mod:`bench.hot_sku`.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.result import AsyncResult
from sqlalchemy.engine import make_url

from admin.harness import CeleryProcess, free_port, redis_server, start_all, stop_all, worker_env
from bench import celery_defaults
from bench.env import Scratch
from bench.leases import UnexpectedReply
from bench.timing import CaseStats, Progress, Results
from bench.wire import CountingProxy, transactions_in
from fencing import mask_url
from reservations import Inventory, schema
from tasks import ReservationClient, ReservationHandle, Settings, create_app, request_id

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 2
POOL = "prefork"
# A burst that is not done by then has a dead or wedged worker; generous because busy leases retry.
BURST_TIMEOUT_PER_TASK = 0.5
MIN_BURST_TIMEOUT = 30.0
# The timed bursts of all cases and runs together; with worker start-up and warm-up the section then
# stays near a minute on a 2-core machine.
TIMED_BUDGET = 40.0
MIN_BURST = 20  # a few times the pool's concurrency, so the pool is full for most of a burst
MAX_WARMUP = 20  # enough for each pool child to open its connections and fill its statement caches

SPREAD = 32
ON_HAND = 10**6

# Redis commands of the server's own idle traffic (idle workers' blocking pops) are measured over this
# long with nothing running and taken off each burst's count.
IDLE_SAMPLE = 2.0
# Tasks through the counting proxy: a warm-up that gets each pool child past psycopg's preparing of its
# statements (prepared on the sixth use per connection), then the counted burst.
COUNT_WARMUP = 24
COUNTED = 20

NOOP_PROJECT = "noop, project settings, AsyncResult.get"
NOOP_DEFAULTS = "noop, Celery defaults, AsyncResult.get"
NOOP_IGNORED = "noop, Celery defaults, ignore_result"
NOOPS = (NOOP_PROJECT, NOOP_DEFAULTS, NOOP_IGNORED)
SPREAD_RESULT = f"reserve, {SPREAD} SKUs, AsyncResult.get"
SPREAD_POLL = f"reserve, {SPREAD} SKUs, DB outcome poll"
SQL_SPREAD_RESULT = f"reserve, {SPREAD} SKUs, SQL leases, AsyncResult.get"
METRICS_SPREAD_RESULT = f"reserve, {SPREAD} SKUs, metrics on, AsyncResult.get"


@dataclass(frozen=True)
class Burst:
    """One timed burst: wall time, each task's enqueue-to-outcome latency, and Celery retries in it
    (``None`` where the wait does not see them: the outcome row does not record retries)."""

    seconds: float
    latencies: list[float]
    retries: int | None


BurstFn = Callable[[str, int], Burst]  # (unique tag for this burst's keys, task count) -> Burst


@dataclass(frozen=True)
class TaskCase:
    name: str
    run: BurstFn
    worker: CeleryProcess  # the one that runs this case's tasks: its CPU is charged to the case


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


@dataclass(frozen=True)
class Sizing:
    """The burst size actually timed, and why it differs from the one asked for."""

    tasks: int
    asked: int
    estimate: float  # seconds the timed bursts would have taken at the warm-up rates, at ``asked``


def _fit(asked: int, repeats: int, rates: list[float], budget: float | None) -> Sizing:
    """Shrink the bursts so that every case's timed runs fit ``budget`` seconds at the warm-up rates.

    A Celery task costs milliseconds on an idle machine and ten times that on a busy one; a fixed size
    would either take minutes there or time too little here.
    """
    per_task = repeats * sum(1 / rate for rate in rates)
    estimate = asked * per_task
    if budget is None or estimate <= budget or asked <= MIN_BURST:
        return Sizing(asked, asked, estimate)
    return Sizing(max(MIN_BURST, int(budget / per_task)), asked, estimate)


def group_cpu(group: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``group``, from
    /proc; 0.0 where there is no /proc. A worker started in its own session is the group of its pid,
    pool children included."""
    ticks = 0
    try:
        entries = os.scandir("/proc")
    except OSError:
        return 0.0
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                text = Path(entry.path, "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            # After "pid (comm) ": state, ppid, pgrp, ..., utime and stime at 11 and 12.
            fields = text[text.rindex(")") + 2 :].split()
            if int(fields[2]) == group:
                ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class RedisCommands:
    """Commands the private redis-server ran, by name, from INFO commandstats: every client's, producer
    and workers alike. The INFO calls that read them are left out."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        # The harness starts the server in a session of its own: its pid is its process group.
        self.pid = int(self.client.info("server")["process_id"])

    def snapshot(self) -> Counter[str]:
        stats = self.client.info("commandstats")
        return Counter({
            name.removeprefix("cmdstat_"): int(values["calls"])
            for name, values in stats.items() if name != "cmdstat_info"
        })

    def close(self) -> None:
        self.client.close()


@dataclass
class Commands:
    """One case's Redis commands over its timed bursts, how long those bursts took, and the CPU its
    worker (main process and pool children), the redis-server and this process (the producer) used."""

    seen: Counter[str]
    seconds: float = 0.0
    tasks: int = 0
    worker_cpu: float = 0.0
    redis_cpu: float = 0.0
    producer_cpu: float = 0.0

    def per_task(self, idle: Mapping[str, float]) -> dict[str, float]:
        """Commands per task by name, less what the server's idle traffic (``idle``, commands per second)
        ran meanwhile."""
        net = {name: calls - idle.get(name, 0.0) * self.seconds for name, calls in self.seen.items()}
        return {name: calls / self.tasks for name, calls in net.items() if self.tasks}


def _idle_rates(commands: RedisCommands, seconds: float) -> dict[str, float]:
    before = commands.snapshot()
    time.sleep(seconds)
    return {name: calls / seconds for name, calls in (commands.snapshot() - before).items()}


@dataclass
class CaseRuns:
    stats: dict[str, CaseStats]
    retries: dict[str, int | None]
    commands: dict[str, Commands]
    idle: dict[str, float]  # the server's idle traffic, commands per second
    sizing: Sizing


def _run_cases(
    cases: list[TaskCase],
    *,
    run_id: str,
    iterations: int,
    warmup: int,
    repeats: int,
    budget: float | None,
    commands: RedisCommands,
    progress: Progress | None,
) -> CaseRuns:
    """A warm-up burst per case, then ``repeats`` runs of one burst per case, rotating the case order
    run by run: a burst leaves work behind (result keys, WAL, dead tuples) that slows whatever comes
    next, so no case may always follow the same one. Counts each timed burst's Redis commands."""
    rates = []
    for n, case in enumerate(cases):
        if progress:
            progress(f"  warm-up: {case.name} ({warmup} tasks)")
        rates.append(warmup / case.run(f"{run_id}-w{n}", warmup).seconds)
    sizing = _fit(iterations, repeats, rates, budget)
    if progress:
        progress(f"  sampling the redis-server's idle traffic for {IDLE_SAMPLE:.0f} s")
    idle = _idle_rates(commands, IDLE_SAMPLE)
    count = sizing.tasks
    stats = {case.name: CaseStats(case.name) for case in cases}
    retries: dict[str, int | None] = dict.fromkeys(stats, 0)
    seen = {case.name: Commands(Counter()) for case in cases}
    for repeat in range(repeats):
        shift = repeat % len(cases)
        for case in [*cases[shift:], *cases[:shift]]:
            if progress:
                progress(f"  run {repeat + 1}/{repeats}: {case.name} ({count} tasks)")
            group = case.worker.pid
            before = commands.snapshot()
            cpu = (group_cpu(group), group_cpu(commands.pid), time.process_time())
            started = time.perf_counter()
            burst = case.run(f"{run_id}-r{repeat}-{cases.index(case)}", count)
            took = time.perf_counter() - started
            spent = seen[case.name]
            spent.producer_cpu += time.process_time() - cpu[2]
            spent.worker_cpu += group_cpu(group) - cpu[0]
            spent.redis_cpu += group_cpu(commands.pid) - cpu[1]
            # Counter subtraction drops non-positive counts; calls only ever grow.
            spent.seen.update(commands.snapshot() - before)
            spent.seconds += took
            spent.tasks += count
            stats[case.name].ops_per_s.append(count / burst.seconds)
            stats[case.name].latencies.extend(burst.latencies)
            was = retries[case.name]
            retries[case.name] = None if was is None or burst.retries is None else was + burst.retries
    return CaseRuns(stats, retries, seen, idle, sizing)


@dataclass(frozen=True)
class DatabaseCount:
    """The reservation task's PostgreSQL traffic as the counting proxy saw it, over ``tasks`` tasks."""

    tasks: int
    trips: Counter[str]  # round trips by label, preparing excluded
    prepares: int  # psycopg preparing a statement: a round trip once per connection and statement
    transactions: int

    def describe(self) -> str:
        parts = ", ".join(f"{label} {n / self.tasks:.2f}" for label, n in self.trips.most_common())
        return parts + (f"; plus {self.prepares} statement preparations in the counted burst"
                        if self.prepares else "")


def count_database(
    burst: BurstFn, proxy: CountingProxy, tag: str, *, progress: Progress | None
) -> DatabaseCount:
    """Run a warm-up burst and then a counted one through ``burst``, whose worker reaches PostgreSQL
    through ``proxy``; only the counted burst's round trips are kept."""
    if progress:
        progress(f"  counting PostgreSQL round trips: {COUNT_WARMUP} + {COUNTED} reservation tasks via proxy")
    burst(f"{tag}-w", COUNT_WARMUP)
    mark = proxy.mark()
    burst(tag, COUNTED)
    connections = proxy.since(mark)
    trips = Counter(trip for conn in connections for trip in conn if not trip.startswith("prepare "))
    prepares = sum(1 for conn in connections for trip in conn if trip.startswith("prepare "))
    return DatabaseCount(COUNTED, trips, prepares, sum(transactions_in(conn) for conn in connections))


def _proxied(database_url: str, proxy: CountingProxy) -> str:
    """``database_url`` through the proxy, unencrypted so that the proxy can read it."""
    url = make_url(database_url).set(host="127.0.0.1", port=proxy.port)
    return url.update_query_dict({"sslmode": "disable", "gssencmode": "disable"}).render_as_string(
        hide_password=False
    )


def _round_robin(skus: list[str], bursts: list[int]) -> dict[str, int]:
    """Units reserved per SKU by bursts that each hand out their tasks round-robin over ``skus``."""
    counts = dict.fromkeys(skus, 0)
    for count in bursts:
        for i in range(count):
            counts[skus[i % len(skus)]] += 1
    return counts


def _seed(url: str, skus: list[str]) -> None:
    with Inventory.from_url(url) as inventory:
        for sku in skus:
            inventory.add_sku(sku, on_hand=ON_HAND)


def _check_stock(url: str, expected: dict[str, int]) -> str:
    """Every SKU holds exactly the reservations its requests asked for and the inventory is consistent:
    a burst that applied a request twice (or lost one) would have timed different work."""
    with Inventory.from_url(url) as inventory:
        problems = inventory.invariant_violations()
        reserved = {level.sku: level.reserved for level in inventory.all_stock()}
    wrong = [(sku, reserved.get(sku), want) for sku, want in expected.items() if reserved.get(sku) != want]
    if problems or wrong:
        raise UnexpectedReply(f"stock check failed: {problems[:3]}; (sku, reserved, wanted): {wrong[:3]}")
    return f"{sum(expected.values())} reservations on {len(expected)} SKUs"


def _per_task(counts: Mapping[str, float]) -> str:
    """The commands a task costs by name, the biggest first; traces of idle traffic left out."""
    shown = sorted(((n, name) for name, n in counts.items() if n >= 0.05), reverse=True)
    return " ".join(f"{name.upper()} {n:.1f}" for n, name in shown)


def tasks_vs_noop(
    scratch: Scratch,
    results: Results,
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    sql_leases: bool = True,
    fit_budget: bool = True,
    progress: Progress | None = None,
) -> int:
    """Needs PostgreSQL (the inventory) and a ``redis-server`` binary; the caller checks both.

    With ``fit_budget`` the bursts shrink below ``iterations`` when the warm-up rates say they would not
    fit :data:`TIMED_BUDGET`; returns the burst size timed.
    """
    run_id = f"b{uuid.uuid4().hex[:8]}"
    warmup = min(warmup, MAX_WARMUP)
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="fencing-bench-tasks-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        if progress:
            progress("  starting a private redis-server, migrating a fresh schema, starting workers")
        server = stack.enter_context(redis_server(workdir / "redis"))
        base = server.url(None)
        in_flight = InFlight()
        stack.callback(in_flight.release)  # after the workers stop, before the redis-server does
        database_url = scratch.postgres_url("tasks")
        schema.upgrade(database_url)
        target = make_url(database_url)
        proxy = stack.enter_context(CountingProxy((target.host or "127.0.0.1", target.port or 5432)))
        # Separate SKUs for the SQL-leased worker: each lease backend counts its own fencing tokens,
        # and a stock row fenced by one backend's high token refuses the other's low one as stale.
        spread = [f"S-{n}" for n in range(SPREAD)]
        sql_spread = [f"Q-{n}" for n in range(SPREAD)]
        counted_skus = [f"C-{n}" for n in range(SPREAD)]
        metered = [f"M-{n}" for n in range(SPREAD)]
        _seed(database_url, spread + counted_skus + metered + (sql_spread if sql_leases else []))

        # One redis-server, one database number per role; every worker has a broker database of its
        # own so that no worker takes another's tasks.
        redis_settings = Settings(
            broker_url=f"{base}/0",
            result_backend=f"{base}/1",
            database_url=database_url,
            lease_url=f"{base}/2",
        )
        sql_settings = redis_settings.with_(
            broker_url=f"{base}/3", result_backend=f"{base}/4", lease_url=database_url
        )
        defaults_env = {
            celery_defaults.BROKER_ENV: f"{base}/5",
            celery_defaults.BACKEND_ENV: f"{base}/6",
        }
        # The project's worker again, reaching PostgreSQL through the counting proxy; never timed.
        count_settings = redis_settings.with_(
            broker_url=f"{base}/7", result_backend=f"{base}/8", database_url=_proxied(database_url, proxy)
        )
        # The project's worker with its Prometheus metrics on (served on a port of its own), same leases.
        metrics_settings = redis_settings.with_(
            broker_url=f"{base}/9", result_backend=f"{base}/10", metrics_port=free_port()
        )
        envs: dict[str, tuple[str, Settings | Mapping[str, str]]] = {
            "bench-redis": ("tasks", redis_settings),
            "bench-metrics": ("tasks", metrics_settings),
            "bench-defaults": ("bench.celery_defaults", defaults_env),
            "bench-count": ("tasks", count_settings),
            **({"bench-sql": ("tasks", sql_settings)} if sql_leases else {}),
        }
        workers = {
            name: CeleryProcess(
                name, worker_env(env), workdir / f"{name}.log", app=app_name, pool=POOL,
                concurrency=CONCURRENCY, cwd=ROOT,
            )
            for name, (app_name, env) in envs.items()
        }
        stack.callback(stop_all, workers.values())  # warm shutdown: each finishes its task, in parallel
        started = time.monotonic()
        start_all(workers.values())
        startup = time.monotonic() - started

        def producer(settings: Settings) -> tuple[Celery, ReservationClient]:
            app = create_app(settings)
            stack.callback(app.close)
            client = ReservationClient(app)
            stack.callback(client.close)
            return app, client

        app, client = producer(redis_settings)
        defaults_app = celery_defaults.create_app(f"{base}/5", f"{base}/6")
        stack.callback(defaults_app.close)
        commands = RedisCommands(f"{base}/0")
        stack.callback(commands.close)
        cases = [
            TaskCase(NOOP_DEFAULTS, noop_burst(defaults_app, in_flight, celery_defaults.NOOP),
                     workers["bench-defaults"]),
            TaskCase(NOOP_IGNORED, noop_no_result_burst(defaults_app, in_flight), workers["bench-defaults"]),
            TaskCase(NOOP_PROJECT, noop_burst(app, in_flight, "reservations.noop"), workers["bench-redis"]),
            TaskCase(SPREAD_RESULT, reserve_burst_result(app, client, spread, in_flight),
                     workers["bench-redis"]),
            TaskCase(SPREAD_POLL, reserve_burst_poll(client, spread), workers["bench-redis"]),
        ]
        metrics_app, metrics_client = producer(metrics_settings)
        cases.append(TaskCase(METRICS_SPREAD_RESULT,
                              reserve_burst_result(metrics_app, metrics_client, metered, in_flight),
                              workers["bench-metrics"]))
        if sql_leases:
            sql_app, sql_client = producer(sql_settings)
            sql_case = reserve_burst_result(sql_app, sql_client, sql_spread, in_flight)
            cases.append(TaskCase(SQL_SPREAD_RESULT, sql_case, workers["bench-sql"]))
        try:
            count_app, count_client = producer(count_settings)
            database = count_database(
                reserve_burst_result(count_app, count_client, counted_skus, in_flight), proxy,
                f"{run_id}-count", progress=progress,
            )
            runs = _run_cases(
                cases, run_id=run_id, iterations=iterations, warmup=warmup, repeats=repeats,
                budget=TIMED_BUDGET if fit_budget else None, commands=commands, progress=progress,
            )
        except Exception as exc:  # a failed burst is usually explained by the workers' logs
            tails = "\n".join(worker.tail() for worker in workers.values())
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n{tails}") from exc

        count = runs.sizing.tasks
        bursts = [warmup, *[count] * repeats]
        # Both spread cases on the Redis-leased worker reserve on the same SKUs.
        expected = _round_robin(spread, bursts + bursts)
        expected |= _round_robin(counted_skus, [COUNT_WARMUP, COUNTED])
        expected |= _round_robin(metered, bursts)
        if sql_leases:
            expected |= _round_robin(sql_spread, bursts)
        checked = _check_stock(database_url, expected)

    stats = runs.stats
    section = f"Celery end to end: reservation task vs no-op tasks (bursts of {count})"
    for baseline in (NOOP_DEFAULTS, NOOP_IGNORED, NOOP_PROJECT):
        results.add(section, stats, SPREAD_RESULT, baseline)
    # Waiting on the outcome row needs no Celery result: its like-for-like no-op stores none either.
    results.add(section, stats, SPREAD_POLL, NOOP_IGNORED)
    results.add(section, stats, SPREAD_POLL, SPREAD_RESULT)
    settings_section = (
        f"Celery no-op: the project's settings and results vs Celery's defaults (bursts of {count})"
    )
    results.add(settings_section, stats, NOOP_PROJECT, NOOP_DEFAULTS)
    results.add(settings_section, stats, NOOP_DEFAULTS, NOOP_IGNORED)
    if sql_leases:
        results.add(f"Celery end to end: SQL lease backend vs Redis lease backend (bursts of {count})",
                    stats, SQL_SPREAD_RESULT, SPREAD_RESULT)
    results.add(f"Celery end to end: reservation task with metrics on vs off (bursts of {count})",
                stats, METRICS_SPREAD_RESULT, SPREAD_RESULT)

    per_task = {name: seen.per_task(runs.idle) for name, seen in runs.commands.items()}
    reserving = {SPREAD_RESULT, SPREAD_POLL}  # the counted worker runs with metrics off
    for case in cases:
        seen_retries = runs.retries[case.name]
        spent = runs.commands[case.name]
        results.cost(section, case.name, {
            "worker CPU / task": f"{spent.worker_cpu / spent.tasks * 1e3:.2f} ms",
            "producer CPU / task": f"{spent.producer_cpu / spent.tasks * 1e3:.2f} ms",
            "redis-server CPU / task": f"{spent.redis_cpu / spent.tasks * 1e3:.2f} ms",
            "Redis commands / task": f"{sum(per_task[case.name].values()):.1f}",
            "PG round trips / task": (
                f"{database.trips.total() / database.tasks:.1f}" if case.name in reserving else "-"
            ),
            "PG transactions / task": (
                f"{database.transactions / database.tasks:.1f}" if case.name in reserving else "-"
            ),
            "Celery retries / task": (
                "-" if seen_retries is None else f"{seen_retries / (count * repeats):.2f}"
            ),
        })

    leases = f"redis at {mask_url(redis_settings.lease_url)} (as compose.yaml deploys it)"
    if sql_leases:
        leases += "; SQL on the inventory database for the 'SQL leases' row, on a worker of its own"
    broker, backend = mask_url(redis_settings.broker_url), mask_url(redis_settings.result_backend)
    results.context += [
        f"Celery workers: {len(workers)} x celery {version('celery')} worker --pool {POOL} -c {CONCURRENCY} "
        "--without-gossip --without-mingle --without-heartbeat --loglevel INFO: the project's app (acks "
        "late, prefetch 1, extended results), the same app counting through a proxy, an app at Celery's "
        "defaults (early acks, prefetch 4)"
        + (", the project's app on SQL leases" if sql_leases else "")
        + f"; one busy at a time, the others idling; ready {startup:.1f} s after start",
        f"Celery broker / results: private redis-server {server.version}, {broker} / {backend} "
        "(every worker a broker and result database of its own on the same server)",
        f"Lease backend: {leases}",
        f"Inventory: PostgreSQL at {mask_url(database_url)}",
    ]
    results.notes.append(
        f"Celery rows: a run is one burst of {count} tasks enqueued back to back, timed from the first "
        f"enqueue to the last outcome seen (ops/s = tasks per second); cases rotate run by run after a "
        f"{warmup}-task warm-up burst each. 'AsyncResult.get' waits on Celery's result backend in enqueue "
        "order; 'DB outcome poll' is ReservationHandle.result_sync, polling the outcome row with backoff; "
        "'ignore_result' no-ops store no result, so the burst ends when its last task (the only one that "
        "stores a result) is done, and their latency is not seen ('-'). Celery defaults = an app with only "
        "broker, result backend and JSON serializers set. p50 / p99: enqueue to outcome stored (worker or "
        "database clock) per task; in a burst that is mostly queueing."
    )
    idle_total = sum(runs.idle.values())
    results.notes.append(
        "Redis commands / task: INFO commandstats deltas of the private redis-server over each case's timed "
        "bursts (producer, broker, results and leases alike), less the server's idle traffic "
        f"({idle_total:.1f} commands/s with nothing running, sampled for {IDLE_SAMPLE:.0f} s), per task: "
        + "; ".join(f"{case.name}: {_per_task(per_task[case.name])}" for case in cases) + "."
    )
    results.notes.append(
        "CPU / task: user + system time over each case's timed bursts, from /proc: the worker running the "
        "case (main process and pool children), this process (the producer: enqueue and wait) and the "
        f"redis-server; on {os.cpu_count()} CPUs shared by all of them and PostgreSQL."
    )
    results.notes.append(
        f"PG round trips / task: the reservation task's PostgreSQL traffic counted off the wire by a proxy "
        f"in front of a worker of its own (same app and settings as the timed one, never timed), over "
        f"{database.tasks} tasks after a {COUNT_WARMUP}-task warm-up, waiting through AsyncResult.get; "
        "the 'DB outcome poll' row adds the producer's polls of the outcome row, not counted. Per task: "
        f"{database.describe()}. Transactions: BEGIN ... COMMIT blocks plus statements outside one."
    )
    results.notes.append(
        "Celery retries per request: with batching on (the default) a request that finds its lease busy "
        f"is queued for the holder instead of retrying. Stock after the run: {checked}, as requested, no "
        "invariant violations."
    )
    if runs.sizing.tasks < runs.sizing.asked:
        results.notes.append(
            f"Celery bursts cut from {runs.sizing.asked} to {runs.sizing.tasks} tasks: at the warm-up rates "
            f"the timed bursts would have taken ~{runs.sizing.estimate:.0f} s against a budget of "
            f"{TIMED_BUDGET:.0f} s, so the machine is slower or busier than the sizing assumes (an explicit "
            "--iterations is never cut)."
        )
    return count
