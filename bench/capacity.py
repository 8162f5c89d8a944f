"""What one reservation costs, measured end to end, for a capacity model: the CPU of the worker, of its
PostgreSQL backends, of the redis-server and of the producer; WAL bytes; Redis commands, network bytes and
memory per request and memory per SKU; PostgreSQL disk bytes and rows per relation.

A reservation here is one ``reserve`` request (no hold, quantity 1) enqueued by ``ReservationClient``
and run by a worker on a private redis-server (broker and leases) with a fresh schema, its outcome read
from the database; requests store no Celery result (the default). A warm-up burst leases every SKU four
times first, so that every pool child has its connections and every SKU its lease keys at full size;
the measured burst then reads each counter before and after. PostgreSQL is shared with whatever else
runs: WAL is the server's, less its idle rate sampled just before; CPU is read per backend from /proc, for
the backends of this run's connections only (their application_name), where PostgreSQL runs on this host.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from admin.harness import CeleryProcess, redis_server, start_all, stop_all, wait_until, worker_env
from bench.costs import RedisCommands, group_cpu, per_task_text
from bench.env import Scratch
from bench.timing import Progress, Results
from fencing.sql import make_engine
from reservations import Inventory, schema
from tasks import ReservationClient, Settings, create_app

ROOT = Path(__file__).resolve().parent.parent
SKUS = 400
QUICK_SKUS = 50
LEASES_PER_SKU = 4  # the warm-up's: fills every SKU's lease history log (history_cap 4)
MEASURED = 3000
QUICK_MEASURED = 300
CONCURRENCY = 2
ON_HAND = 10**6
IDLE_SAMPLE = 2.0  # seconds of WAL and Redis traffic with nothing of ours running, taken off the burst
BURST_TIMEOUT = 300.0
OUTCOME_READ = 1000  # keys per outcome read (Inventory.request_outcomes takes at most that many)

# Every table of the schema with its size (indexes and TOAST included) and rows; a partition counts
# for its partitioned table.
RELATIONS = sa.text(
    """
    SELECT coalesce(parent.relname, c.relname) AS name, sum(pg_total_relation_size(c.oid)) AS bytes
    FROM pg_class c
    JOIN pg_namespace n ON n.oid = c.relnamespace
    LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
    LEFT JOIN pg_class parent ON parent.oid = i.inhparent
    WHERE n.nspname = :schema AND c.relkind = 'r'
    GROUP BY 1
    """
)
WAL_LSN = sa.text("SELECT pg_current_wal_lsn()")
WAL_SINCE = sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), CAST(:lsn AS pg_lsn))")
BACKENDS = sa.text("SELECT pid FROM pg_stat_activity WHERE application_name = :tag")
TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of ``pid`` from /proc; None where it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def backends_cpu(engine: sa.Engine, tag: str) -> dict[int, float]:
    """CPU seconds so far of each PostgreSQL backend whose application_name is ``tag``, by pid."""
    with engine.connect() as conn:
        pids = [int(pid) for pid in conn.execute(BACKENDS, {"tag": tag}).scalars()]
    return {pid: cpu for pid in pids if (cpu := process_cpu(pid)) is not None}


def spent(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU between two readings of a set of processes; one that started in between counts whole."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


@dataclass(frozen=True)
class Reading:
    """The counters read before and after the measured burst."""

    at: float
    worker_cpu: float
    redis_cpu: float
    producer_cpu: float
    backends: dict[int, float]
    commands: Counter[str]
    net_in: int
    net_out: int
    used_memory: int
    relations: dict[str, int]
    rows: dict[str, int]


def _producer_cpu() -> float:
    times = os.times()
    return times.user + times.system


def _rows(conn: sa.Connection, schema_name: str, names: Iterable[str]) -> dict[str, int]:
    """Rows of each table ``names`` of ``schema_name`` (a partitioned table's count is its partitions')."""
    return {
        name: int(conn.execute(sa.text(f'SELECT count(*) FROM "{schema_name}"."{name}"')).scalar_one())  # noqa: S608
        for name in names
    }


def _outcomes_in(inventory: Inventory, keys: list[str]) -> Counter[str] | None:
    """The statuses of ``keys`` once every one of them has an outcome; None before."""
    statuses: Counter[str] = Counter()
    for start in range(0, len(keys), OUTCOME_READ):
        found = inventory.request_outcomes(keys[start : start + OUTCOME_READ])
        statuses.update(outcome.status for outcome in found.values())
    return statuses if statuses.total() == len(keys) else None


def reservation_costs(
    scratch: Scratch,
    results: Results,
    *,
    quick: bool = False,
    progress: Progress | None = None,
) -> None:
    """Needs PostgreSQL and a ``redis-server`` binary; the caller checks both."""
    sku_count, measured = (QUICK_SKUS, QUICK_MEASURED) if quick else (SKUS, MEASURED)
    tag = f"capacity-{uuid.uuid4().hex[:8]}"
    part = tag.replace("-", "_")
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="fencing-bench-capacity-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        if progress:
            progress("  starting a private redis-server, migrating a fresh schema, starting a worker")
        server = stack.enter_context(redis_server(workdir / "redis"))
        base = server.url(None)
        migrated = scratch.postgres_url(part)
        schema_name = f"{scratch.pg_schema}_{part}"
        schema.upgrade(migrated)
        # The worker's connections carry the run's name, the producer's another: PostgreSQL is shared.
        worker_url, producer_url = (
            make_url(migrated)
            .update_query_dict({"application_name": name})
            .render_as_string(hide_password=False)
            for name in (tag, f"{tag}-producer")
        )
        skus = [f"CAP-{n}" for n in range(sku_count)]
        with Inventory.from_url(producer_url) as seeding:
            for sku in skus:
                seeding.add_sku(sku, on_hand=ON_HAND)
        settings = Settings(broker_url=f"{base}/0", result_backend=f"{base}/1", lease_url=f"{base}/2",
                            database_url=worker_url)  # fmt: skip
        worker = CeleryProcess(
            "capacity", worker_env(settings), workdir / "capacity.log", concurrency=CONCURRENCY, cwd=ROOT
        )
        stack.callback(stop_all, [worker])
        start_all([worker])

        app = create_app(settings.with_(database_url=producer_url))
        stack.callback(app.close)
        client = ReservationClient(app)
        stack.callback(client.close)
        inventory = stack.enter_context(Inventory.from_url(producer_url))
        admin = make_engine(scratch.settings.postgres_url)
        stack.callback(admin.dispose)
        commands = RedisCommands(f"{base}/0")
        stack.callback(commands.close)
        info = stack.enter_context(redis.Redis.from_url(f"{base}/0"))
        leases = stack.enter_context(redis.Redis.from_url(f"{base}/2"))

        def burst(name: str, count: int) -> None:
            keys = [f"{tag}-{name}-{n}" for n in range(count)]
            for n, key in enumerate(keys):
                client.enqueue_reservation_sync(skus[n % len(skus)], 1, idempotency_key=key)
            statuses = wait_until(
                lambda: _outcomes_in(inventory, keys),
                timeout=BURST_TIMEOUT,
                what=f"the {name} burst",
                interval=0.1,
            )
            if statuses != Counter(reserved=count):
                raise RuntimeError(f"{name} burst: outcomes {dict(statuses)}, not all reserved")
            # Acknowledged too: nothing of the burst is still running when the counters are read.
            wait_until(lambda: info.hlen("unacked") == 0 and info.llen("celery") == 0, timeout=BURST_TIMEOUT,
                       what="an empty broker", interval=0.05)  # fmt: skip

        def read(conn: sa.Connection) -> Reading:
            stats = info.info("stats")
            relations = {
                str(name): int(size) for name, size in conn.execute(RELATIONS, {"schema": schema_name})
            }
            return Reading(
                at=time.monotonic(),
                worker_cpu=group_cpu(worker.pid),
                redis_cpu=group_cpu(commands.pid),
                producer_cpu=_producer_cpu(),
                backends=backends_cpu(admin, tag),
                commands=commands.snapshot(),
                net_in=int(stats["total_net_input_bytes"]),
                net_out=int(stats["total_net_output_bytes"]),
                used_memory=int(info.info("memory")["used_memory"]),
                relations=relations,
                rows=_rows(conn, schema_name, relations),
            )

        try:
            if progress:
                progress(f"  warm-up: {LEASES_PER_SKU * sku_count} reservations over {sku_count} SKUs")
            burst("warm", LEASES_PER_SKU * sku_count)
            per_sku = sum(leases.memory_usage(key, samples=0) or 0 for key in leases.scan_iter(count=1000))
            # The server's own traffic with nothing of ours running: idle workers' polls, and whatever
            # else writes WAL on a shared PostgreSQL.
            with admin.connect() as conn:
                lsn = conn.execute(WAL_LSN).scalar_one()
                idle_commands, idle_stats, idle_at = commands.snapshot(), info.info("stats"), time.monotonic()
                time.sleep(IDLE_SAMPLE)  # a sample of idle traffic, not a wait for anything
                idle_seconds = time.monotonic() - idle_at
                idle_wal = float(conn.execute(WAL_SINCE, {"lsn": lsn}).scalar_one()) / idle_seconds
                idle_calls = commands.snapshot() - idle_commands
                stats = info.info("stats")
                idle_net = (
                    (int(stats["total_net_input_bytes"]) - int(idle_stats["total_net_input_bytes"]))
                    / idle_seconds,
                    (int(stats["total_net_output_bytes"]) - int(idle_stats["total_net_output_bytes"]))
                    / idle_seconds,
                )
            if progress:
                progress(f"  measured: {measured} reservations")
            with admin.connect() as conn:
                lsn = conn.execute(WAL_LSN).scalar_one()
                before = read(conn)
                conn.commit()
                burst("measured", measured)
                after = read(conn)
                wal = float(conn.execute(WAL_SINCE, {"lsn": lsn}).scalar_one())
        except Exception as exc:  # a burst that does not end is usually explained by the worker's log
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n{worker.tail()}") from exc

    seconds = after.at - before.at
    n = measured
    idle_rate = {name: calls / idle_seconds for name, calls in idle_calls.items()}
    calls = {
        name: (count - idle_rate.get(name, 0.0) * seconds) / n
        for name, count in (after.commands - before.commands).items()
    }
    net_in = (after.net_in - before.net_in - idle_net[0] * seconds) / n
    net_out = (after.net_out - before.net_out - idle_net[1] * seconds) / n
    backend_cpu = spent(before.backends, after.backends)
    section = (
        f"Capacity: one reservation end to end ({n} reserve requests over {sku_count} SKUs, 1 worker "
        f"-c {CONCURRENCY}, {n / seconds:.0f}/s)"
    )

    def row(what: str, value: str, how: str) -> None:
        results.cost(section, what, {"per reservation": value, "measured as": how})

    row(
        "worker CPU",
        f"{(after.worker_cpu - before.worker_cpu) / n * 1e3:.2f} ms",
        "celery worker, main process and pool children, /proc",
    )
    row(
        "PostgreSQL backend CPU",
        f"{backend_cpu / n * 1e3:.2f} ms" if after.backends else "- (PostgreSQL not on this host)",
        f"the worker's {len(after.backends)} backends, /proc; background writers not counted",
    )
    row(
        "redis-server CPU",
        f"{(after.redis_cpu - before.redis_cpu) / n * 1e3:.2f} ms",
        "broker and leases on one private server, /proc",
    )
    row(
        "producer CPU",
        f"{(after.producer_cpu - before.producer_cpu) / n * 1e3:.2f} ms",
        "this process: ReservationClient enqueue, outcome polls (one read per 1,000 keys)",
    )
    row(
        "WAL",
        f"{(wal - idle_wal * seconds) / n:,.0f} B",
        f"pg_current_wal_lsn() difference, less the server's idle {idle_wal:,.0f} B/s",
    )
    row("Redis commands", f"{sum(calls.values()):.1f}", per_task_text(calls))
    row(
        "Redis network bytes in / out",
        f"{net_in:,.0f} B / {net_out:,.0f} B",
        "INFO stats total_net_input_bytes / total_net_output_bytes, less the idle rate",
    )
    row(
        "Redis memory",
        f"{(after.used_memory - before.used_memory) / n:,.1f} B",
        "used_memory difference (no Celery results kept: RESERVATIONS_RESULT_EXPIRES=0)",
    )
    row(
        "Redis memory per SKU",
        f"{per_sku / sku_count:,.0f} B",
        f"MEMORY USAGE of the lease keys after {LEASES_PER_SKU} leases per SKU, per SKU not per reservation",
    )
    total_bytes = sum(after.relations.values()) - sum(before.relations.values())
    row("PostgreSQL disk", f"{total_bytes / n:,.0f} B",
        "pg_total_relation_size of every table (indexes, TOAST, partitions) difference")  # fmt: skip

    disk = f"Capacity: PostgreSQL disk per reservation, by table ({n} reserve requests, no hold)"
    for name in sorted(after.relations):
        grown = after.relations[name] - before.relations.get(name, 0)
        rows = after.rows[name] - before.rows.get(name, 0)
        if grown or rows:
            results.cost(
                disk,
                name,
                {"rows per reservation": f"{rows / n:.2f}", "bytes per reservation": f"{grown / n:,.0f}"},
            )
    results.notes.append(
        "Capacity: counters read after a warm-up burst (every SKU leased "
        f"{LEASES_PER_SKU} times) and after the measured one, each burst waited out until every outcome is "
        "in the database and the broker is empty. Relation sizes grow by whole 8 KB pages, and a table's "
        "first pages (its indexes' too) came with the warm-up; PostgreSQL CPU counts the backends of the "
        "worker's connections (application_name), not the walwriter, checkpointer or autovacuum; WAL is "
        "server-wide less its idle rate, so other databases' writes during the burst count too."
    )
