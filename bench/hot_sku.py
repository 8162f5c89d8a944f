"""One hot SKU against the same requests spread over many SKUs, end to end through Celery on a thread pool
of 2, 8 and 32 task slots, with hot-SKU batching on and off.

Every case is a burst of reserve requests enqueued back to back and timed from the first enqueue until
every request has its final outcome row in the database: that row is what a caller waits for, and with
batching it is written by the lease holder's batch, which then writes the waiting task's Celery result.
After the timed part the burst is drained until every task's Celery result is final (untimed), so no
retry or watch of one burst runs during the next. Each slot count and batching setting
gets a worker of its own, started fresh on its own broker and result databases and fully stopped before
the next one starts.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import redis
import sqlalchemy as sa
from celery import Celery

from bench import old_results
from bench.env import Scratch
from bench.leases import UnexpectedReply
from bench.tasks_e2e import _check_stock, _round_robin, _seed
from bench.timing import CaseStats, Progress, Results
from fencing.engines import make_engine
from fencing.urls import mask_url
from reservations import schema
from reservations.request_outcomes import request_id
from tasks import ReservationClient, Settings, create_app
from testing.celery_processes import CeleryProcess, stop_all, worker_env
from testing.redis_servers import redis_server

SLOTS = (2, 8, 32)
SPREAD = 32
POOL = "threads"
# At least this many requests per task slot in a burst, so that the pool stays full for most of it.
PER_SLOT = 8
MIN_WARMUP = 2  # warm-up requests per slot: every thread opens its connections before the timed bursts
POLL = 0.02  # seconds between polls of the outcome rows; the end of a burst is known to this resolution
# A burst that is not done by then has a dead or wedged worker; generous because retries back off.
BURST_TIMEOUT_PER_TASK = 0.5
MIN_BURST_TIMEOUT = 60.0
# A SKU's watch looks at its queue at 1, 2, 4, ... seconds (up to the lease ttl), and busy-lease retries
# back off: a drain can take a few of those steps.
DRAIN_TIMEOUT = 180.0
FINAL_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
LEASE_DB = 0  # one lease database for all modes: every mode reserves on SKUs of its own
RESULT_EXPIRES = 600
ROOT = Path(__file__).resolve().parent.parent

OUTCOMES = sa.text("SELECT key, status, at_ms FROM request_outcomes WHERE key = ANY(:keys)")
# Requests served in a lease holder's batch: one attempt row each, sharing the batch's task and time.
BATCHED = sa.text(
    "SELECT count(*), count(DISTINCT (task_id, at_ms)) FROM task_attempts "
    "WHERE key = ANY(:keys) AND detail LIKE 'served in a batch of %'"
)


@dataclass(frozen=True)
class Mode:
    """One worker configuration: a thread pool of ``slots`` and batching on or off."""

    index: int
    slots: int
    batching: bool

    @property
    def label(self) -> str:
        return f"{POOL} -c {self.slots}, batching {'on' if self.batching else 'off'}"

    @property
    def hot(self) -> list[str]:
        return [f"H{self.index}-0"]

    @property
    def spread(self) -> list[str]:
        return [f"M{self.index}-{n}" for n in range(SPREAD)]

    def settings(self, base: str, database_url: str) -> Settings:
        # Databases 1.. of the private redis-server: a fresh broker queue and result store per mode.
        return Settings(
            broker_url=f"{base}/{1 + 2 * self.index}",
            result_backend=f"{base}/{2 + 2 * self.index}",
            database_url=database_url,
            lease_url=f"{base}/{LEASE_DB}",
            batching=self.batching,
            # Each burst is drained until every task's Celery result is final: requests keep theirs.
            result_expires=RESULT_EXPIRES,
        )


@dataclass
class Tally:
    """What one case's timed bursts did besides taking their time."""

    requests: int = 0
    retries: int = 0  # Celery retries: busy-lease retries (batching off; with it on, none are expected)
    cpu: float | None = 0.0  # the worker's CPU seconds (all its threads) from first enqueue to drained
    settle_lag: list[float] = field(default_factory=list)  # last outcome row -> last Celery result
    keys: list[str] = field(default_factory=list)


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) of a process so far; None where /proc does not tell."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Burst:
    seconds: float  # first enqueue -> every outcome row present
    latencies: list[float]  # per request: enqueue -> its outcome row (database clock, same host)
    settle_lag: float  # last outcome row seen -> last Celery result final
    retries: int
    keys: list[str]


class Probe:
    """The bench's own view of the database (outcome rows) and of the result store (Celery states)."""

    def __init__(self, database_url: str) -> None:
        self.engine = make_engine(database_url, isolation_level="AUTOCOMMIT", pool_size=1)

    def outcomes(self, keys: list[str], deadline: float) -> tuple[float, dict[str, tuple[str, int]]]:
        """Poll until every key has its outcome row; returns when that was seen (perf_counter) and the
        rows (status, at_ms) by key."""
        missing, found = set(keys), {}
        with self.engine.connect() as conn:
            while True:
                for key, status, at_ms in conn.execute(OUTCOMES, {"keys": list(missing)}):
                    found[key] = (status, int(at_ms))
                    missing.discard(key)
                if not missing:
                    return time.perf_counter(), found
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(missing)} of {len(keys)} requests had no outcome row in time")
                time.sleep(POLL)

    def batched(self, keys: list[str]) -> tuple[int, int]:
        """(requests served in a holder's batch, batches they were served in)."""
        with self.engine.connect() as conn:
            served, batches = conn.execute(BATCHED, {"keys": keys}).one()
        return int(served), int(batches)

    def close(self) -> None:
        self.engine.dispose()


def _drain(app: Celery, store: redis.Redis, task_ids: list[str]) -> tuple[float, int]:
    """Poll the result store until every task is final; returns when (perf_counter) and their retries."""
    keys = {task_id: app.backend.get_key_for_task(task_id) for task_id in task_ids}
    waiting, retries = dict(keys), 0
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while True:
        ids = list(waiting)
        for task_id, raw in zip(ids, store.mget([waiting[i] for i in ids]), strict=True):
            if raw is None:
                continue
            meta = json.loads(raw)
            if meta.get("status") in FINAL_STATES:
                if meta["status"] != "SUCCESS":
                    raise UnexpectedReply(f"task {task_id} ended {meta['status']}: {meta.get('result')!r}")
                retries += int(meta.get("retries") or 0)
                del waiting[task_id]
        if not waiting:
            return time.perf_counter(), retries
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(waiting)} of {len(task_ids)} tasks not final {DRAIN_TIMEOUT:.0f}s on")
        time.sleep(POLL * 5)


def _burst(
    app: Celery, client: ReservationClient, store: redis.Redis, probe: Probe, skus: list[str], tag: str,
    count: int,
) -> Burst:
    keys = [f"{tag}-{i}" for i in range(count)]
    sent: list[float] = []
    start = time.perf_counter()
    for i, key in enumerate(keys):
        sent.append(time.time())
        client.enqueue_reservation_sync(skus[i % len(skus)], 1, idempotency_key=key)
    deadline = time.monotonic() + max(MIN_BURST_TIMEOUT, count * BURST_TIMEOUT_PER_TASK)
    done, rows = probe.outcomes(keys, deadline)
    wrong = [(key, status) for key, (status, _) in rows.items() if status != "reserved"]
    if wrong:
        raise UnexpectedReply(f"{len(wrong)} of {count} requests in {tag} not reserved: {wrong[:3]}")
    settled, retries = _drain(app, store, [request_id(key) for key in keys])
    return Burst(
        seconds=done - start,
        latencies=[rows[key][1] / 1000 - at for key, at in zip(keys, sent, strict=True)],
        settle_lag=settled - done,
        retries=retries,
        keys=keys,
    )


def burst_size(slots: int, asked: int) -> int:
    return max(asked, PER_SLOT * slots)


@dataclass
class ModeRun:
    mode: Mode
    count: int
    warmup: int
    stats: dict[str, CaseStats]
    tallies: dict[str, Tally]
    startup: float


def _names(mode: Mode) -> tuple[str, str]:
    batching = f"batching {'on' if mode.batching else 'off'}"
    return f"reserve, 1 hot SKU, {batching}", f"reserve, {SPREAD} SKUs, {batching}"


def _run_mode(
    mode: Mode,
    *,
    base: str,
    database_url: str,
    workdir: Path,
    probe: Probe,
    count: int,
    warmup: int,
    repeats: int,
    run_id: str,
    progress: Progress | None,
) -> ModeRun:
    settings = mode.settings(base, database_url)
    hot_name, spread_name = _names(mode)
    cases = [(hot_name, mode.hot), (spread_name, mode.spread)]
    stats = {name: CaseStats(name) for name, _ in cases}
    tallies = {name: Tally() for name, _ in cases}
    name = f"hot{mode.index}"
    with ExitStack() as stack:
        if progress:
            progress(f"  {mode.label}: starting the worker")
        started = time.monotonic()
        # With the extended metadata beside each result: the drain counts each task's retries from it.
        worker = CeleryProcess(
            name, worker_env(settings), workdir / f"{name}.log", app=old_results.__name__, pool=POOL,
            concurrency=mode.slots, cwd=ROOT,
        )  # fmt: skip
        stack.callback(stop_all, [worker])  # warm shutdown, waited for: nothing of it outlives the mode
        worker.start()
        worker.wait_ready()
        startup = time.monotonic() - started
        app = create_app(settings)
        stack.callback(app.close)
        client = ReservationClient(app)
        stack.callback(client.close)
        store = redis.Redis.from_url(settings.result_backend)
        stack.callback(store.close)
        try:
            for n, (case, skus) in enumerate(cases):
                if progress:
                    progress(f"  {mode.label}: warm-up, {case} ({warmup} tasks)")
                _burst(app, client, store, probe, skus, f"{run_id}-m{mode.index}-w{n}", warmup)
            for repeat in range(repeats):
                shift = repeat % len(cases)
                for case, skus in [*cases[shift:], *cases[:shift]]:
                    if progress:
                        progress(f"  run {repeat + 1}/{repeats}: {case} ({count} tasks)")
                    tag = f"{run_id}-m{mode.index}-r{repeat}-{'h' if case == hot_name else 's'}"
                    before = cpu_seconds(worker.pid)
                    burst = _burst(app, client, store, probe, skus, tag, count)
                    after = cpu_seconds(worker.pid)
                    stats[case].ops_per_s.append(count / burst.seconds)
                    stats[case].latencies.extend(burst.latencies)
                    tally = tallies[case]
                    tally.requests += count
                    tally.retries += burst.retries
                    tally.cpu = (
                        None if tally.cpu is None or before is None or after is None
                        else tally.cpu + after - before
                    )
                    tally.settle_lag.append(burst.settle_lag)
                    tally.keys.extend(burst.keys)
        except Exception as exc:  # a failed burst is usually explained by the worker's log
            raise RuntimeError(f"{mode.label}: {type(exc).__name__}: {exc}\n{worker.tail()}") from exc
    return ModeRun(mode, count, warmup, stats, tallies, startup)


def _describe(run: ModeRun, probe: Probe) -> str:
    parts = []
    for name, tally in run.tallies.items():
        served, batches = probe.batched(tally.keys)
        batched = (
            f"{served / tally.requests:.0%} served in a holder's batch (mean {served / batches:.1f} a batch)"
            if batches else "none served in a batch"
        )
        cpu = f"worker CPU {tally.cpu / tally.requests * 1000:.1f} ms, " if tally.cpu is not None else ""
        parts.append(
            f"{'hot' if 'hot' in name else 'spread'}: {cpu}{tally.retries / tally.requests:.2f} Celery "
            f"retries a request, {batched}, last Celery result "
            f"{statistics.median(tally.settle_lag):.2f} s after the last outcome row"
        )
    return f"{run.mode.label}: " + "; ".join(parts) + "."


def hot_vs_many(
    scratch: Scratch,
    results: Results,
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    slots: Iterable[int] = SLOTS,
    progress: Progress | None = None,
) -> dict[int, int]:
    """Needs PostgreSQL (the inventory) and a ``redis-server`` binary; the caller checks both.

    ``iterations`` is the smallest burst; a slot count gets :data:`PER_SLOT` requests a slot if that is
    more. Returns the burst size per slot count.
    """
    run_id = f"h{uuid.uuid4().hex[:8]}"
    modes = [
        Mode(i, n, batching)
        for i, (n, batching) in enumerate((n, b) for n in slots for b in (True, False))
    ]
    sizes = {mode.slots: burst_size(mode.slots, iterations) for mode in modes}
    runs: list[ModeRun] = []
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="fencing-bench-hot-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        if progress:
            progress("  starting a private redis-server, migrating a fresh schema")
        server = stack.enter_context(redis_server(workdir / "redis", databases=1 + 2 * len(modes)))
        base = server.url(None)
        database_url = scratch.postgres_url("hot")
        schema.upgrade(database_url)
        _seed(database_url, [sku for mode in modes for sku in mode.hot + mode.spread])
        probe = Probe(database_url)
        stack.callback(probe.close)
        for mode in modes:
            runs.append(
                _run_mode(
                    mode, base=base, database_url=database_url, workdir=workdir, probe=probe,
                    count=sizes[mode.slots], warmup=max(warmup, MIN_WARMUP * mode.slots),
                    repeats=repeats, run_id=run_id, progress=progress,
                )
            )
        expected: dict[str, int] = {}
        for run in runs:
            bursts = [run.warmup, *[run.count] * repeats]
            expected |= _round_robin(run.mode.hot, bursts) | _round_robin(run.mode.spread, bursts)
        checked = _check_stock(database_url, expected)
        described = [_describe(run, probe) for run in runs]

    for slot_count in dict.fromkeys(mode.slots for mode in modes):
        section = (
            f"Celery end to end, --pool {POOL} -c {slot_count}: one hot SKU vs {SPREAD} SKUs (bursts of "
            f"{sizes[slot_count]} reserves, timed to the last outcome row)"
        )
        for run in runs:
            if run.mode.slots == slot_count:
                results.add(section, run.stats, *_names(run.mode))

    settings = Settings()
    startups = ", ".join(f"{run.startup:.1f}" for run in runs)
    results.context += [
        f"Hot-SKU workers: one celery {version('celery')} worker --pool {POOL} -c N per slot count and "
        "batching setting, each started fresh on its own broker and result databases and stopped before "
        f"the next; ready after {startups} s",
        f"Hot-SKU services: private redis-server {server.version} at {mask_url(base)} (broker, results, "
        f"leases on database {LEASE_DB}); inventory PostgreSQL at {mask_url(database_url)}; "
        f"batch size {settings.batch_size}, first watch of a queue after {settings.handoff_check:g} s, "
        f"lease ttl {settings.lease_ttl:g} s (defaults)",
    ]
    results.notes.append(
        "Hot-SKU rows: a run is one burst of reserve requests (1 unit each, stock never runs out) for one "
        f"SKU, or round-robin over {SPREAD} SKUs, enqueued back to back and timed from the first enqueue "
        f"until every request has its outcome row in request_outcomes (polled every {POLL * 1000:.0f} ms); "
        "ops/s = requests per second; hot and spread alternate run by run after a warm-up burst each "
        f"({MIN_WARMUP} requests a slot at least), and each burst is drained (every Celery result final) "
        "before the next starts. Batching on: a request whose SKU a thread of its own worker serves joins "
        "that batch in memory, one that finds the lease busy otherwise queues in the database, and the "
        "holder serves both in batches; off: it retries through the broker until it gets the lease. p50 "
        "/ p99: enqueue to outcome row per request. Below, per mode: worker CPU = the worker process's "
        "CPU time (all threads) from a burst's first enqueue until it is drained, per request."
    )
    results.notes += described
    results.notes.append(f"Hot-SKU stock after the run: {checked}, as requested, no invariant violations.")
    return sizes

