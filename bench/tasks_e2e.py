"""End to end through Celery: reservation tasks against no-op tasks, under Celery's defaults (results on and
off) and under the project's settings, on one private redis-server, pool and concurrency. One case is a burst
of N tasks enqueued at once, timed from the first enqueue to the last outcome; Redis commands per task come
from the server's command counters, PostgreSQL round trips per task from a counting proxy in front of a worker
of their own. One hot SKU against many is :mod:`bench.hot_sku`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from celery import Celery
from sqlalchemy.engine import make_url

from bench import celery_defaults, raw_tasks
from bench.bursts import (
    BurstFn,
    InFlight,
    life_burst,
    noop_burst,
    noop_no_result_burst,
    noop_pair_burst,
    raw_life_burst,
    raw_reserve_burst,
    reserve_burst_poll,
    reserve_burst_result,
)
from bench.bursts import check_stock as _check_stock  # bench.hot_sku takes these three from here
from bench.bursts import round_robin as _round_robin
from bench.bursts import seed as _seed
from bench.costs import (
    COUNT_WARMUP,
    COUNTED,
    Commands,
    RedisCommands,
    count_database,
    group_cpu,
    idle_rates,
    per_task_text,
    proxied,
)
from bench.env import Scratch
from bench.timing import CaseStats, Progress, Results
from bench.wire import CountingProxy
from fencing.urls import mask_url
from reservations import schema
from tasks import ReservationClient, Settings, create_app
from testing.celery_processes import CeleryProcess, start_all, stop_all, worker_env
from testing.etcd_cluster import etcd_cluster
from testing.harness import free_port
from testing.redis_servers import redis_server

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 2
POOL = "prefork"
# The timed bursts of all cases and runs together; with worker start-up and warm-up the section then
# stays near a minute on a 2-core machine.
TIMED_BUDGET = 40.0
MIN_BURST = 20  # a few times the pool's concurrency, so the pool is full for most of a burst
MAX_WARMUP = 20  # enough for each pool child to open its connections and fill its statement caches

SPREAD = 32
RESULT_EXPIRES = 600

# Redis commands of the server's own idle traffic (idle workers' blocking pops) are measured over this
# long with nothing running and taken off each burst's count.
IDLE_SAMPLE = 2.0

NOOP_PROJECT = "noop, project settings, AsyncResult.get"
NOOP_DEFAULTS = "noop, Celery defaults, AsyncResult.get"
NOOP_IGNORED = "noop, Celery defaults, ignore_result"
NOOPS = (NOOP_PROJECT, NOOP_DEFAULTS, NOOP_IGNORED)
SPREAD_RESULT = f"reserve, {SPREAD} SKUs, AsyncResult.get"
SPREAD_POLL = f"reserve, {SPREAD} SKUs, DB outcome poll"
SQL_SPREAD_RESULT = f"reserve, {SPREAD} SKUs, SQL leases, AsyncResult.get"
ETCD_SPREAD_RESULT = f"reserve, {SPREAD} SKUs, etcd leases (3 members), AsyncResult.get"
METRICS_SPREAD_RESULT = f"reserve, {SPREAD} SKUs, metrics on, AsyncResult.get"
TRACED_SPREAD_RESULT = f"reserve, {SPREAD} SKUs, trace comment on, AsyncResult.get"
RAW_RESERVE = f"raw reservation task (lock, one statement), Celery defaults, {SPREAD} SKUs, AsyncResult.get"
RAW_RECORDED = f"raw reservation task, its request recorded first, {SPREAD} SKUs, AsyncResult.get"
RAW_FENCED = (
    f"raw reservation task, fenced and idempotent (a token from its lock, the project's statement), its "
    f"request recorded first, {SPREAD} SKUs, AsyncResult.get"
)
LIFE = "a reservation's life as tasks: reserve then confirm"
RAW_LIFE = "the fenced reference's life: reserve then confirm, each recorded first"
NOOP_PAIR = "two Celery no-ops with results"


@dataclass(frozen=True)
class TaskCase:
    name: str
    run: BurstFn
    worker: CeleryProcess  # the one that runs this case's tasks: its CPU is charged to the case


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
    idle = idle_rates(commands, IDLE_SAMPLE)
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


def _etcd_settings(stack: ExitStack, workdir: Path, settings: Settings, base: str) -> Settings:
    """The project's worker again, on the leases of a private 3-member etcd cluster (stopped after the
    workers, as the redis-server is), at the default 30 s ttl: whole seconds, as etcd keeps them."""
    (workdir / "etcd").mkdir()
    cluster = stack.enter_context(etcd_cluster(workdir / "etcd"))
    url = cluster.url("bench")
    return settings.with_(broker_url=f"{base}/16", result_backend=f"{base}/17", lease_url=url)


def tasks_vs_noop(
    scratch: Scratch,
    results: Results,
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    sql_leases: bool = True,
    etcd_leases: bool = False,
    fit_budget: bool = True,
    progress: Progress | None = None,
) -> int:
    """Needs PostgreSQL (the inventory) and a ``redis-server`` binary (and ``etcd`` with ``etcd_leases``:
    a worker on the leases of a private 3-member etcd cluster); the caller checks them.

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
        # A database number per worker role and store (see below): more than Redis's default 16.
        server = stack.enter_context(redis_server(workdir / "redis", databases=32))
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
        etcd_spread = [f"E-{n}" for n in range(SPREAD)]
        counted_skus = [f"C-{n}" for n in range(SPREAD)]
        metered = [f"M-{n}" for n in range(SPREAD)]
        commented = [f"T-{n}" for n in range(SPREAD)]
        lives = [f"L-{n}" for n in range(SPREAD)]  # reserved, then confirmed: on hand goes down
        raw_skus = [f"R-{n}" for n in range(SPREAD)]  # the physical reference's, locked by name only
        recorded_skus = [f"D-{n}" for n in range(SPREAD)]  # the same, each request recorded first
        fenced_skus = [f"F-{n}" for n in range(SPREAD)]  # the fenced reference's, each request recorded
        raw_lives = [f"G-{n}" for n in range(SPREAD)]  # the fenced reference's lives: reserved, confirmed
        seeded = [
            *spread, *counted_skus, *metered, *commented, *lives, *raw_skus, *recorded_skus, *fenced_skus,
            *raw_lives,
        ]
        _seed(database_url, seeded + (sql_spread if sql_leases else []) + etcd_spread)

        # One redis-server, one database number per role; every worker has a broker database of its
        # own so that no worker takes another's tasks. Requests keep their Celery result (none by
        # default): the AsyncResult.get cases wait on it.
        redis_settings = Settings(
            broker_url=f"{base}/0",
            result_backend=f"{base}/1",
            database_url=database_url,
            lease_url=f"{base}/2",
            result_expires=RESULT_EXPIRES,
        )
        sql_settings = redis_settings.with_(
            broker_url=f"{base}/3", result_backend=f"{base}/4", lease_url=database_url
        )
        etcd_settings = _etcd_settings(stack, workdir, redis_settings, base) if etcd_leases else None
        defaults_env = {
            celery_defaults.BROKER_ENV: f"{base}/5",
            celery_defaults.BACKEND_ENV: f"{base}/6",
        }
        # The physical reference (bench.raw_tasks): Celery's defaults, a plain lock, one raw statement.
        raw_env = raw_tasks.environment(base, 11, database_url)
        # The project's worker again, reaching PostgreSQL through the counting proxy; never timed.
        count_settings = redis_settings.with_(
            broker_url=f"{base}/7", result_backend=f"{base}/8", database_url=proxied(database_url, proxy)
        )
        # The project's worker with its Prometheus metrics on (served on a port of its own), same leases.
        metrics_settings = redis_settings.with_(
            broker_url=f"{base}/9", result_backend=f"{base}/10", metrics_port=free_port()
        )
        # And with each statement carrying its request's trace as a comment (RESERVATIONS_TRACING=sql).
        traced_settings = redis_settings.with_(
            broker_url=f"{base}/14", result_backend=f"{base}/15", tracing="sql"
        )
        # The project's workers run its own app as shipped, request results kept RESULT_EXPIRES for the
        # waits. Without Celery's extended metadata (off in the project's app) a result carries no retry
        # count: the retries column shows '-' for them (the hot-SKU section counts retries).
        project = "tasks"
        envs: dict[str, tuple[str, Settings | Mapping[str, str]]] = {
            "bench-redis": (project, redis_settings),
            "bench-metrics": (project, metrics_settings),
            "bench-traced": (project, traced_settings),
            "bench-defaults": ("bench.celery_defaults", defaults_env),
            "bench-raw": (raw_tasks.__name__, raw_env),
            "bench-count": (project, count_settings),
            **({"bench-sql": (project, sql_settings)} if sql_leases else {}),
            **({"bench-etcd": (project, etcd_settings)} if etcd_settings is not None else {}),
        }
        workers = {
            name: CeleryProcess(
                name, worker_env(env), workdir / f"{name}.log", app=app_name, pool=POOL,
                concurrency=CONCURRENCY, cwd=ROOT,
            )
            for name, (app_name, env) in envs.items()
        }  # fmt: skip
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
        raw_app = celery_defaults.create_app(f"{base}/11", f"{base}/12")
        stack.callback(raw_app.close)
        recorder = raw_tasks.Recorder(database_url)
        stack.callback(recorder.close)
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
            TaskCase(RAW_RESERVE, raw_reserve_burst(raw_app, raw_skus, in_flight, raw_tasks.RAW_RESERVE),
                     workers["bench-raw"]),
            TaskCase(RAW_RECORDED,
                     raw_reserve_burst(raw_app, recorded_skus, in_flight, raw_tasks.RAW_RESERVE, recorder),
                     workers["bench-raw"]),
            TaskCase(RAW_FENCED,
                     raw_reserve_burst(raw_app, fenced_skus, in_flight, raw_tasks.RAW_FENCED, recorder),
                     workers["bench-raw"]),
            TaskCase(NOOP_PAIR, noop_pair_burst(defaults_app, in_flight, celery_defaults.NOOP),
                     workers["bench-defaults"]),
            TaskCase(LIFE, life_burst(app, client, lives, in_flight), workers["bench-redis"]),
            TaskCase(RAW_LIFE,
                     raw_life_burst(raw_app, raw_lives, in_flight, raw_tasks.RAW_FENCED,
                                    raw_tasks.RAW_FENCED_CONFIRM, recorder),
                     workers["bench-raw"]),
        ]  # fmt: skip
        metrics_app, metrics_client = producer(metrics_settings)
        cases.append(TaskCase(METRICS_SPREAD_RESULT,
                              reserve_burst_result(metrics_app, metrics_client, metered, in_flight),
                              workers["bench-metrics"]))  # fmt: skip
        traced_app, traced_client = producer(traced_settings)
        cases.append(TaskCase(TRACED_SPREAD_RESULT,
                              reserve_burst_result(traced_app, traced_client, commented, in_flight),
                              workers["bench-traced"]))  # fmt: skip
        if sql_leases:
            sql_app, sql_client = producer(sql_settings)
            sql_case = reserve_burst_result(sql_app, sql_client, sql_spread, in_flight)
            cases.append(TaskCase(SQL_SPREAD_RESULT, sql_case, workers["bench-sql"]))
        if etcd_settings is not None:
            etcd_app, etcd_client = producer(etcd_settings)
            etcd_case = reserve_burst_result(etcd_app, etcd_client, etcd_spread, in_flight)
            cases.append(TaskCase(ETCD_SPREAD_RESULT, etcd_case, workers["bench-etcd"]))
        try:
            count_app, count_client = producer(count_settings)
            database = count_database(
                reserve_burst_result(count_app, count_client, counted_skus, in_flight), proxy,
                f"{run_id}-count", progress=progress,
            )  # fmt: skip
            runs = _run_cases(
                cases, run_id=run_id, iterations=iterations, warmup=warmup, repeats=repeats,
                budget=TIMED_BUDGET if fit_budget else None, commands=commands, progress=progress,
            )  # fmt: skip
        except Exception as exc:  # a failed burst is usually explained by the workers' logs
            tails = "\n".join(worker.tail() for worker in workers.values())
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n{tails}") from exc

        count = runs.sizing.tasks
        bursts = [warmup, *[count] * repeats]
        # Both spread cases on the Redis-leased worker reserve on the same SKUs.
        expected = _round_robin(spread, bursts + bursts)
        expected |= _round_robin(counted_skus, [COUNT_WARMUP, COUNTED])
        expected |= _round_robin(metered, bursts)
        expected |= _round_robin(commented, bursts)
        if sql_leases:
            expected |= _round_robin(sql_spread, bursts)
        if etcd_settings is not None:
            expected |= _round_robin(etcd_spread, bursts)
        expected |= _round_robin(raw_skus, bursts)
        expected |= _round_robin(recorded_skus, bursts)
        expected |= _round_robin(fenced_skus, bursts)
        expected |= dict.fromkeys(lives, 0)  # every life's reservation confirmed: none held
        expected |= dict.fromkeys(raw_lives, 0)
        confirmed = _round_robin(lives, bursts) | _round_robin(raw_lives, bursts)
        checked = _check_stock(database_url, expected, confirmed=confirmed)

    stats = runs.stats
    section = f"Celery end to end: reservation task vs no-op tasks (bursts of {count})"
    for baseline in (NOOP_DEFAULTS, NOOP_IGNORED, NOOP_PROJECT, RAW_RESERVE, RAW_RECORDED, RAW_FENCED):
        results.add(section, stats, SPREAD_RESULT, baseline)
    results.add(section, stats, RAW_RESERVE, NOOP_DEFAULTS)
    results.add(section, stats, RAW_RECORDED, RAW_RESERVE)
    results.add(section, stats, RAW_FENCED, RAW_RESERVE)
    results.add(section, stats, RAW_FENCED, RAW_RECORDED)
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
                    stats, SQL_SPREAD_RESULT, SPREAD_RESULT)  # fmt: skip
    if etcd_leases:
        results.add(f"Celery end to end: etcd lease backend vs Redis lease backend (bursts of {count})",
                    stats, ETCD_SPREAD_RESULT, SPREAD_RESULT)  # fmt: skip
    results.add(f"Celery end to end: reservation task with metrics on vs off (bursts of {count})",
                stats, METRICS_SPREAD_RESULT, SPREAD_RESULT)  # fmt: skip
    results.add(f"Celery end to end: reservation task with the trace comment on vs off (bursts of {count})",
                stats, TRACED_SPREAD_RESULT, SPREAD_RESULT)  # fmt: skip
    lives_section = f"Celery end to end: a reservation's life vs two no-ops (bursts of {count} lives)"
    results.add(lives_section, stats, LIFE, NOOP_PAIR)
    results.add(lives_section, stats, RAW_LIFE, NOOP_PAIR)
    results.add(lives_section, stats, LIFE, RAW_LIFE)

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
        })  # fmt: skip

    leases = f"redis at {mask_url(redis_settings.lease_url)} (as compose.yaml deploys it)"
    if sql_leases:
        leases += "; SQL on the inventory database for the 'SQL leases' row, on a worker of its own"
    if etcd_leases:
        leases += (
            "; a private 3-member etcd cluster on loopback (as compose.yaml's etcd profile deploys it) for"
            " the 'etcd leases' row, on a worker of its own"
        )
    broker, backend = mask_url(redis_settings.broker_url), mask_url(redis_settings.result_backend)
    results.context += [
        f"Celery workers: {len(workers)} x celery {version('celery')} worker --pool {POOL} -c {CONCURRENCY} "
        "--without-gossip --without-mingle --without-heartbeat --loglevel INFO: the project's app (acks "
        f"late, prefetch 1, request results kept {RESULT_EXPIRES} s, no extended metadata), the same app "
        "counting through a proxy, an "
        "app at Celery's defaults (early acks, prefetch 4), the same defaults running the physical reference "
        "(bench.raw_tasks)"
        + (", the project's app on SQL leases" if sql_leases else "")
        + (", the project's app on etcd leases" if etcd_leases else "")
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
    results.notes.append(
        f"'{RAW_RESERVE}': the physical reference for a reservation task (bench.raw_tasks), on a worker at "
        "Celery's defaults: a plain Redis lock (SET NX PX, released by a compare-and-delete script, taken "
        "again after 5 ms when found taken) and ONE raw psycopg statement writing the rows a reservation "
        "task writes (stock counts, reservation, history row, idempotency record, the request's outcome "
        "and attempt). No fencing token, idempotency lookup, stock row lock, message checks, late acks or "
        "lease renewal: its gap to the no-op is what a lock and the rows cost, and the reservation task's "
        "gap to it is the project's own work."
    )
    results.notes.append(
        f"'{RAW_RECORDED}': the same reference, its producer writing each request's record first (one plain "
        "INSERT into accepted_requests, in autocommit, of the columns the project's client writes), as "
        "nothing accepted may vanish: the reference that does strictly less than the reservation task and "
        "still keeps every request."
    )
    results.notes.append(
        f"'{RAW_FENCED}': the recorded reference with every guarantee of the reservation task's writes "
        "(bench.raw_tasks.raw_fenced_reserve): its lock hands out the SKU's next token in the same script "
        "(SET NX PX, then INCR of a counter), and its statement is the project's own "
        "(reservations.reserve_statement, fenced and speaking for the request: the outcome read first, the "
        "idempotency lookup, the stock row lock, the fence in the UPDATE, the outcome and attempt written) "
        "on a plain autocommit psycopg connection. No message checks, late acks, lease renewal, epoch log "
        "or hot-SKU protocol: the reservation task's gap to it is the project's code around the same "
        "round trips and rows."
    )
    results.notes.append(
        f"'{LIFE}': a burst of {count} reserve requests on {SPREAD} SKUs of their own, each waited on by "
        "AsyncResult.get in enqueue order; as each reservation is in, a confirm of it is enqueued through "
        "ReservationClient.enqueue_sync and waited on the same way, the burst done when every confirm is. "
        "ops/s = lives (reserve + confirm) per second; p50 / p99 from a life's reserve enqueued to its "
        f"confirm stored; its costs are per life. '{NOOP_PAIR}': the same with two no-ops a life on the "
        "Celery-defaults worker, the second enqueued with the first's result."
    )
    results.notes.append(
        f"'{RAW_LIFE}': the same life on the fenced reference (bench.raw_tasks): its reserve, then, as each "
        "reservation is in, a confirm of it by the project's confirm statement "
        "(reservations.finish_statement) under the SKU's lock and next token, each request recorded first "
        "by the same plain INSERT, on the reference's worker at Celery's defaults. What a life cannot do "
        "without on this machine, less the project's code around it."
    )
    idle_total = sum(runs.idle.values())
    results.notes.append(
        "Redis commands / task: INFO commandstats deltas of the private redis-server over each case's timed "
        "bursts (producer, broker, results and leases alike), less the server's idle traffic "
        f"({idle_total:.1f} commands/s with nothing running, sampled for {IDLE_SAMPLE:.0f} s), per task: "
        + "; ".join(f"{case.name}: {per_task_text(per_task[case.name])}" for case in cases) + "."
    )  # fmt: skip
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
        "is queued for the holder instead of retrying; the project's app keeps no retry count beside a "
        "result (no extended metadata), so its rows show '-' (the hot-SKU section runs bench.old_results "
        f"and counts them). Stock after the run: {checked}, as requested, no invariant violations."
    )
    if runs.sizing.tasks < runs.sizing.asked:
        results.notes.append(
            f"Celery bursts cut from {runs.sizing.asked} to {runs.sizing.tasks} tasks: at the warm-up rates "
            f"the timed bursts would have taken ~{runs.sizing.estimate:.0f} s against a budget of "
            f"{TIMED_BUDGET:.0f} s, so the machine is slower or busier than the sizing assumes (an explicit "
            "--iterations is never cut)."
        )
    return count
