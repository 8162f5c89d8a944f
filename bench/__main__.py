"""``python -m bench``: run every benchmark against its baseline and print one table of ratios.

Sections whose service is unreachable are skipped and listed; scratch keys, schemas and files are
removed before exit whatever happens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from rich.console import Console

from bench.asyncio_client import asyncio_producer
from bench.capacity import reservation_costs
from bench.capacity_check import capacity_check
from bench.env import Scratch, Settings, probe
from bench.hot_sku import PER_SLOT, SLOTS, hot_vs_many
from bench.hot_sku import SPREAD as SPREAD_SKUS
from bench.http import http_front_door
from bench.leases import etcd_vs_redis_leases, redis_vs_raw, sql_vs_redis_leases
from bench.lifecycle import one_vs_several
from bench.report import Plan, render_markdown, render_rich
from bench.reserve import reserve_vs_raw
from bench.soak import redis_per_request
from bench.tasks_e2e import tasks_vs_noop
from bench.timing import Progress, Results
from bench.writes import guarded_vs_plain

# Sized for a 2-core machine: every section but the hot-SKU one finishes in well under a minute; SQL
# operations cost several round trips and a commit each, so their sections run proportionally fewer
# iterations. A Celery task costs milliseconds (broker, result backend, several transactions) and every
# case of the tasks section is a burst of that many tasks per run. A reserve is a transaction of several
# round trips and milliseconds of client CPU, timed next to raw ones of four round trips and of one. The
# hot-SKU section times 12 cases (3 slot counts x batching on/off x hot/spread) on 6 workers and takes a
# few minutes.
DEFAULT_ITERATIONS = 1500
QUICK_ITERATIONS = 200
WRITE_SHARE = 10
RESERVE_SHARE = 5
BACKEND_SHARE = 25
TASK_SHARE = 5
HOT_SHARE = 10
MIN_ITERATIONS = 5
WARMUP_FRACTION = 0.1
SECTIONS = (
    "redis", "writes", "reserve", "backends", "etcd", "tasks", "hot", "asyncio", "soak", "capacity",
    "capacity-check", "http", "lifecycle",
)  # fmt: skip
# The asyncio section: messages per enqueue case, and the enqueue-and-await calls kept in flight.
ASYNC_ENQUEUES = 2000
ASYNC_IN_FLIGHT = (100, 1000, 10_000)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Fencing benchmarks, each against a baseline measured in the same run. "
        "Service URLs come from BENCH_REDIS_URL and BENCH_POSTGRES_URL.",
    )
    parser.add_argument(
        "--iterations", type=int, metavar="N",
        help=f"timed Redis pairs per run (default {DEFAULT_ITERATIONS}, {QUICK_ITERATIONS} with "
        f"--quick); SQL writes run N/{WRITE_SHARE}, reserves N/{RESERVE_SHARE}, the backend comparison "
        f"N/{BACKEND_SHARE}, Celery bursts N/{TASK_SHARE} tasks, hot-SKU bursts N/{HOT_SHARE} requests "
        f"(at least {PER_SLOT} a task slot)",
    )
    parser.add_argument("--quick", action="store_true", help="a fast smoke run with fewer iterations")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument("--markdown", action="store_true", help="print the report as Markdown")
    parser.add_argument(
        "--only", action="append", choices=SECTIONS,
        help="run only this section (repeatable): redis = lease vs raw Redis, writes = guarded vs "
        "plain write, reserve = Inventory.reserve vs the same rows by raw psycopg, as a transaction "
        "and as one CTE statement (PostgreSQL), "
        "backends = SQL vs Redis lease backend, etcd = etcd vs Redis lease backend and the raw Redis lock "
        "(private etcd clusters of 1 and 3 members; needs etcd), tasks = Celery reservation tasks vs no-op "
        "tasks end to end (own redis-server and workers; needs PostgreSQL), hot = one hot SKU vs "
        f"{SPREAD_SKUS} SKUs on a thread pool of {', '.join(map(str, SLOTS))} task slots, batching on and "
        "off (same needs), asyncio = the asyncio client's enqueue rate vs Task.delay and its event loop lag "
        f"with {', '.join(map(str, ASYNC_IN_FLIGHT))} requests in flight (same needs), soak = Redis memory "
        "per request over 8 waves of reservations, results off vs kept vs kept 24 h extended (same needs), "
        "capacity = CPU, WAL, Redis and disk per reservation end to end (same needs), capacity-check = the "
        "capacity model fitted on 1,000 uniform SKUs and checked on 100,000 Zipf SKUs (same needs), http = "
        "the HTTP front door (reservations serve) vs the same server stack awaiting a Celery no-op, /healthz "
        "latency with 1,000 requests open, and the load generator's cost (same needs), lifecycle = confirm, "
        "release, restock, count and replenish as one statement vs several (PostgreSQL)",
    )
    parser.add_argument(
        "--no-sql-leases", action="store_true",
        help="tasks section: skip the second worker on the SQL lease backend (saves its bursts)",
    )
    parser.add_argument(
        "--no-etcd-leases", action="store_true",
        help="tasks section: skip the worker on etcd leases (a private 3-member cluster; saves its bursts)",
    )
    args = parser.parse_args(argv)
    if args.iterations is not None and args.iterations < MIN_ITERATIONS:
        parser.error(f"--iterations must be at least {MIN_ITERATIONS}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def _load() -> str:
    """The load averages, which say how much else ran on the machine next to the benchmarks."""
    try:
        return " / ".join(f"{value:.1f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


@dataclass
class Run:
    """What every section of one run shares."""

    args: argparse.Namespace
    plan: Plan
    scratch: Scratch
    results: Results
    progress: Progress | None
    redis_ok: bool
    postgres_ok: bool
    redis_server: bool  # a redis-server binary for the Celery sections' private broker
    etcd: bool  # an etcd binary for private etcd clusters

    def sizing(self, iterations: int) -> dict[str, int]:
        return {
            "iterations": iterations,
            "warmup": max(10, round(iterations * WARMUP_FRACTION)),
            "repeats": self.args.repeats,
        }


def _redis(run: Run) -> None:
    redis_vs_raw(run.scratch, run.results, progress=run.progress, **run.sizing(run.plan.redis_iterations))


def _writes(run: Run) -> None:
    targets: list[tuple[str, Callable[[], str]]] = (
        [("PostgreSQL", run.scratch.postgres_url)] if run.postgres_ok else []
    )
    targets.append(("SQLite", run.scratch.sqlite_url))
    for label, url_of in targets:
        if run.progress:
            run.progress(f"guarded vs plain write, {label}")
        guarded_vs_plain(
            url_of(), label, run.results, progress=run.progress, **run.sizing(run.plan.write_iterations)
        )


def _reserve(run: Run) -> None:
    reserve_vs_raw(
        run.scratch, run.results, progress=run.progress, **run.sizing(run.plan.reserve_iterations)
    )


def _lifecycle(run: Run) -> None:
    one_vs_several(
        run.scratch, run.results, progress=run.progress, **run.sizing(run.plan.reserve_iterations)
    )


def _backends(run: Run) -> None:
    sql_vs_redis_leases(
        run.scratch, run.results, postgres=run.postgres_ok, sqlite=True, progress=run.progress,
        **run.sizing(run.plan.backend_iterations),
    )  # fmt: skip


def _etcd(run: Run) -> None:
    etcd_vs_redis_leases(
        run.scratch, run.results, progress=run.progress, **run.sizing(run.plan.backend_iterations)
    )


def _tasks(run: Run) -> None:
    timed = tasks_vs_noop(
        run.scratch, run.results, sql_leases=not run.args.no_sql_leases,
        etcd_leases=not run.args.no_etcd_leases and run.etcd,
        fit_budget=run.args.iterations is None, progress=run.progress,
        **run.sizing(run.plan.task_iterations),
    )  # fmt: skip
    run.plan = replace(run.plan, task_iterations=timed)


def _hot(run: Run) -> None:
    hot = run.sizing(run.plan.hot_iterations)
    sizes = hot_vs_many(
        run.scratch, run.results, iterations=hot["iterations"], warmup=hot["warmup"],
        repeats=hot["repeats"], progress=run.progress,
    )  # fmt: skip
    run.plan = replace(run.plan, hot_bursts=tuple(sizes.items()))


def _asyncio(run: Run) -> None:
    quick = run.args.quick or run.args.iterations is not None
    asyncio_producer(
        run.scratch, run.results, enqueues=ASYNC_ENQUEUES // (10 if quick else 1),
        in_flight=ASYNC_IN_FLIGHT[:2] if quick else ASYNC_IN_FLIGHT, repeats=run.args.repeats,
        progress=run.progress,
    )  # fmt: skip


def _soak(run: Run) -> None:
    redis_per_request(run.scratch, run.results, quick=run.args.quick, progress=run.progress)


def _capacity(run: Run) -> None:
    reservation_costs(run.scratch, run.results, quick=run.args.quick, progress=run.progress)


def _capacity_check(run: Run) -> None:
    capacity_check(run.scratch, run.results, quick=run.args.quick, progress=run.progress)


def _http(run: Run) -> None:
    http_front_door(
        run.scratch, run.results, quick=run.args.quick, repeats=run.args.repeats, progress=run.progress
    )


def _celery(run: Run) -> bool:
    return run.postgres_ok and run.redis_server


# In the order they run: (section, what it needs, progress line, runner).
SECTION_RUNS: list[tuple[str, Callable[[Run], bool], str, Callable[[Run], None]]] = [
    ("redis", lambda run: run.redis_ok, "Redis lease vs raw Redis lock", _redis),
    ("writes", lambda run: True, "guarded vs plain writes", _writes),
    ("reserve", lambda run: run.postgres_ok, "fenced reserve vs raw psycopg, PostgreSQL", _reserve),
    ("lifecycle", lambda run: run.postgres_ok, "later steps: one statement vs several", _lifecycle),
    ("backends", lambda run: run.redis_ok, "SQL vs Redis lease backend", _backends),
    ("etcd", lambda run: run.redis_ok and run.etcd, "etcd vs Redis lease backend", _etcd),
    ("tasks", _celery, "Celery end to end: reservation vs no-op tasks, hot vs spread SKUs", _tasks),
    ("hot", _celery, "Celery end to end on a thread pool: one hot SKU vs many, batching on and off", _hot),
    ("asyncio", _celery, "asyncio producer: enqueue rate and event loop lag with real workers", _asyncio),
    ("soak", _celery, "soak: Redis memory per request, request results off vs kept", _soak),
    ("capacity", _celery, "capacity: what one reservation costs end to end", _capacity),
    ("capacity-check", _celery, "capacity model: fitted on one configuration, checked on another",
     _capacity_check),
    ("http", _celery, "HTTP front door: service vs FastAPI + Celery no-op, /healthz under load", _http),
]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n = args.iterations or (QUICK_ITERATIONS if args.quick else DEFAULT_ITERATIONS)
    plan = Plan(
        redis_iterations=n,
        write_iterations=max(MIN_ITERATIONS, n // WRITE_SHARE),
        reserve_iterations=max(MIN_ITERATIONS, n // RESERVE_SHARE),
        backend_iterations=max(MIN_ITERATIONS, n // BACKEND_SHARE),
        task_iterations=max(MIN_ITERATIONS, n // TASK_SHARE),
        hot_iterations=max(MIN_ITERATIONS, n // HOT_SHARE),
        repeats=args.repeats,
        warmup_fraction=WARMUP_FRACTION,
    )
    wanted = set(args.only or SECTIONS)
    settings = Settings.from_env()
    errors = Console(stderr=True)
    progress: Progress | None = None
    if errors.is_terminal:
        def progress(message: str) -> None:
            errors.print(f"[dim]{message}[/dim]", highlight=False)

    ctx = probe(settings)
    redis_ok, postgres_ok = ctx.redis_version is not None, ctx.postgres_version is not None
    results = Results()
    # The tasks section runs its own redis-server (the shared one may carry other jobs' queues), so it
    # needs the binary instead of BENCH_REDIS_URL.
    redis_server = shutil.which("redis-server")
    if not redis_ok and wanted & {"redis", "backends", "etcd"}:
        results.skipped.append("Skipped the Redis and backend sections: Redis is unreachable.")
    etcd = shutil.which("etcd") is not None
    if not etcd and wanted & {"etcd", "tasks"}:
        results.skipped.append("Skipped the etcd rows: no etcd on PATH (Debian: etcd-server).")
    if not postgres_ok and wanted - {"redis"}:
        what = "the PostgreSQL rows" + (" and the Celery sections" if wanted & {"tasks", "hot"} else "")
        results.skipped.append(f"Skipped {what}: PostgreSQL is unreachable.")
    celery_sections = {"tasks", "hot", "asyncio", "soak", "capacity", "capacity-check", "http"}
    if redis_server is None and wanted & celery_sections:
        results.skipped.append("Skipped the Celery sections: no redis-server on PATH for a private broker.")

    # A terminated run (CI timeout, kill) must still reach the cleanup below; SystemExit does.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.perf_counter()
    load_before = _load()
    scratch = Scratch(settings)
    run = Run(args, plan, scratch, results, progress, redis_ok, postgres_ok, redis_server is not None, etcd)
    try:
        for name, needs, label, section in SECTION_RUNS:
            if name in wanted and needs(run):
                if progress:
                    progress(label)
                section(run)
    finally:
        for problem in run.scratch.close():
            errors.print(f"cleanup: {problem}", highlight=False)
    plan = run.plan
    results.notes.append(f"Whole run: {time.perf_counter() - started:.1f} s.")
    results.context.append(
        f"Machine load (1 / 5 / 15 min load averages) at start: {load_before}; at end: {_load()}"
    )

    if args.markdown:
        print(render_markdown(ctx, plan, results))
    else:
        # A pipe gets no terminal width; let the table keep its natural width instead of 80 columns.
        out = Console() if sys.stdout.isatty() else Console(width=240)
        render_rich(ctx, plan, results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
