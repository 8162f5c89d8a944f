"""What one reservation costs, measured end to end, for a capacity model: the CPU of the worker, of its
PostgreSQL backends, of the redis-server and of the producer; WAL bytes; Redis commands, network bytes and
memory per request and memory per SKU; PostgreSQL disk bytes and rows per relation.

A reservation here is one ``reserve`` request (no hold, quantity 1) enqueued by ``ReservationClient``
and run by a worker on a private redis-server (broker and leases) with a fresh schema, its outcome read
from the database; requests store no Celery result (the default). A :class:`Shape` says how many SKUs
(seeded in two statements), workers and pool processes, and how requests pick their SKU (round robin or
a Zipf law). A uniform shape's warm-up leases every SKU four times first, so that every pool child has its
connections and every SKU its lease keys at full size; the measured burst then reads each counter before
and after. PostgreSQL is shared with whatever else runs: WAL is read with pg_waldump for this run's schema
where possible (bench.capacity_wal), else the server's less its idle rate sampled just before; CPU is read
per backend from /proc, for the backends of this run's connections only (their application_name), where
PostgreSQL runs on this host; the whole machine's CPU (/proc/stat) shows what else ran.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from bench.bursts import outcomes_in
from bench.capacity_wal import schema_wal
from bench.costs import RedisCommands, group_cpu, per_task_text
from bench.env import Scratch
from bench.timing import Progress, Results
from fencing.engines import make_engine
from reservations import Inventory, schema
from tasks import ReservationClient, Settings, create_app
from testing.celery_processes import CeleryProcess, start_all, stop_all, worker_env
from testing.harness import wait_until
from testing.redis_servers import redis_server

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
# The server's own processes (walwriter, checkpointer, background writer, autovacuum): they work for every
# database, ours included.
BACKGROUND = sa.text("SELECT pid FROM pg_stat_activity WHERE backend_type <> 'client backend'")
TICKS = os.sysconf("SC_CLK_TCK")
# Every SKU of the run at once, with its creation in the history as add_sku writes it: 100,000 SKUs one
# add_sku at a time would take minutes, this statement a second or two.
SEED_STOCK = """
    INSERT INTO "{schema}".stock (sku, on_hand, reserved, available, fence_token, updated_ms)
    SELECT 'CAP-' || n, :on_hand, 0, :on_hand, 0, {now} FROM generate_series(0, :count - 1) AS n
"""
SEED_HISTORY = """
    INSERT INTO "{schema}".sku_history (sku, at_ms, kind, operation, token, quantity, on_hand_delta,
                                         reserved_delta)
    SELECT 'CAP-' || n, {now}, 'write', 'create', 0, :on_hand, :on_hand, 0
    FROM generate_series(0, :count - 1) AS n
"""
NOW_MS = "CAST(extract(epoch FROM clock_timestamp()) * 1000 AS bigint)"
BATCHED = sa.text(
    "SELECT count(*) FROM task_attempts WHERE key = ANY(:keys) AND detail LIKE 'served in a batch of %'"
)
SEED = 20261204  # the same SKU sequence every run


@dataclass(frozen=True)
class Shape:
    """One configuration measured: SKUs, workers x pool processes, and how requests pick their SKU.

    ``skew`` 0 is uniform (round robin over the SKUs); above 0 a Zipf law of that exponent over the SKUs
    (the k-th SKU drawn with weight 1/k**skew). ``warm_passes`` leases every SKU that many times before
    the measured burst (uniform shapes only: 100,000 SKUs cannot be warmed in a bench);
    ``warm_requests`` is the warm-up of a skewed shape, drawn like the measured burst."""

    skus: int
    workers: int = 1
    concurrency: int = CONCURRENCY
    skew: float = 0.0
    measured: int = MEASURED
    warm_passes: int = LEASES_PER_SKU
    warm_requests: int = 0

    @property
    def slots(self) -> int:
        return self.workers * self.concurrency

    @property
    def label(self) -> str:
        how = f"Zipf s={self.skew:g}" if self.skew else "uniform"
        return f"{self.skus:,} SKUs {how}, {self.workers} worker x -c {self.concurrency}"

    def draw(self, count: int, rnd: random.Random, start: int = 0) -> list[int]:
        """``count`` SKU indexes, the ``start``-th request of the run first."""
        if not self.skew:
            return [(start + n) % self.skus for n in range(count)]
        weights = accumulate(1 / (k + 1) ** self.skew for k in range(self.skus))
        return rnd.choices(range(self.skus), cum_weights=list(weights), k=count)


def machine_cpu() -> tuple[float, float]:
    """CPU seconds the whole machine used so far (all CPUs, idle and iowait left out), and of those the
    kernel's interrupts and softirqs (loopback traffic), which no process is charged with."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0, 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICKS, (irq + softirq) / TICKS


@dataclass
class Costs:
    """What one reservation cost in one shape: CPU seconds per process group, bytes, commands; and the
    burst's throughput. ``lease_memory`` is the lease keys' bytes after the run over ``requests_by_sku``
    (the requests each touched SKU got, warm-up included); ``sku_memory`` per SKU after 1 and after
    ``warm_passes`` leases, where the shape warmed every SKU."""

    shape: Shape
    n: int
    seconds: float
    worker_cpu: float
    postgres_cpu: float | None
    redis_cpu: float
    producer_cpu: float
    machine_cpu: float
    background_cpu: float | None
    kernel_cpu: float
    wal: float
    disk: float
    commands: float
    net_in: float
    net_out: float
    lease_memory: int
    requests_by_sku: Counter[int] = field(default_factory=Counter)
    sku_memory: dict[int, float] = field(default_factory=dict)
    batched: int = 0

    @property
    def throughput(self) -> float:
        return self.n / self.seconds

    @property
    def run_cpu(self) -> float:
        """CPU seconds per reservation of everything the run itself keeps busy."""
        return (self.worker_cpu + (self.postgres_cpu or 0.0) + self.redis_cpu + self.producer_cpu
                + (self.background_cpu or 0.0) + self.kernel_cpu)  # fmt: skip

    @property
    def other_cores(self) -> float:
        """Cores the rest of the machine kept busy meanwhile (other test runs, other databases'
        backends): what the run did not have."""
        if not self.machine_cpu:
            return 0.0
        return max(0.0, (self.machine_cpu - self.run_cpu) * self.n / self.seconds)


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of ``pid`` from /proc; None where it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def backends_cpu(engine: sa.Engine, tag: str | None) -> dict[int, float]:
    """CPU seconds so far of each PostgreSQL backend whose application_name is ``tag``, by pid; of the
    server's background processes with ``tag`` None."""
    with engine.connect() as conn:
        found = conn.execute(BACKGROUND) if tag is None else conn.execute(BACKENDS, {"tag": tag})
        pids = [int(pid) for pid in found.scalars()]
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
    machine_cpu: float
    kernel_cpu: float
    backends: dict[int, float]
    background: dict[int, float]
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


def _lease_memory(leases: redis.Redis) -> int:
    """Bytes of every lease key (the lease database holds nothing else; keys of touched SKUs only)."""
    return sum(leases.memory_usage(key, samples=0) or 0 for key in leases.scan_iter(count=1000))


def reservation_costs(  # noqa: C901  # one run's steps in order; its counters stay local
    scratch: Scratch,
    results: Results,
    *,
    quick: bool = False,
    progress: Progress | None = None,
    shape: Shape | None = None,
) -> Costs:
    """Needs PostgreSQL and a ``redis-server`` binary; the caller checks both."""
    if shape is None:
        shape = Shape(QUICK_SKUS, measured=QUICK_MEASURED) if quick else Shape(SKUS)
    sku_count, measured = shape.skus, shape.measured
    rnd = random.Random(SEED)
    tag = f"capacity-{uuid.uuid4().hex[:8]}"
    part = tag.replace("-", "_")
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="fencing-bench-capacity-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        if progress:
            progress(f"  {shape.label}: a private redis-server, a fresh schema, {sku_count:,} SKUs, workers")
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
        seeding = make_engine(migrated)
        stack.callback(seeding.dispose)
        with seeding.begin() as conn:
            for statement in (SEED_STOCK, SEED_HISTORY):
                conn.execute(sa.text(statement.format(schema=schema_name, now=NOW_MS)),
                             {"on_hand": ON_HAND, "count": sku_count})  # fmt: skip
        # Now rather than by autovacuum during the run: its pass over the fresh rows (hint bits, the
        # visibility map, statistics) writes WAL that would land in the idle sample or the measured burst.
        with seeding.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in ("stock", "sku_history"):
                conn.execute(sa.text(f'VACUUM ANALYZE "{schema_name}"."{table}"'))
        settings = Settings(broker_url=f"{base}/0", result_backend=f"{base}/1", lease_url=f"{base}/2",
                            database_url=worker_url)  # fmt: skip
        env, pool = worker_env(settings), shape.concurrency
        workers = [
            CeleryProcess(f"capacity{i}", env, workdir / f"capacity{i}.log", concurrency=pool, cwd=ROOT)
            for i in range(shape.workers)
        ]
        stack.callback(stop_all, workers)
        start_all(workers)

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

        requests_by_sku: Counter[int] = Counter()
        done = 0  # requests enqueued so far: a uniform shape goes on round robin where it stopped

        def burst(name: str, count: int) -> list[str]:
            nonlocal done
            keys = [f"{tag}-{name}-{n}" for n in range(count)]
            picks = shape.draw(count, rnd, done)
            done += count
            requests_by_sku.update(picks)
            for pick, key in zip(picks, keys, strict=True):
                client.enqueue_reservation_sync(skus[pick], 1, idempotency_key=key)
            statuses = wait_until(
                lambda: outcomes_in(inventory, keys),
                timeout=BURST_TIMEOUT,
                what=f"the {name} burst",
                interval=0.1,
            )
            if statuses != Counter(reserved=count):
                raise RuntimeError(f"{name} burst: outcomes {dict(statuses)}, not all reserved")
            # Acknowledged too: nothing of the burst is still running when the counters are read.
            wait_until(lambda: info.hlen("unacked") == 0 and info.llen("celery") == 0, timeout=BURST_TIMEOUT,
                       what="an empty broker", interval=0.05)  # fmt: skip
            return keys

        def read(conn: sa.Connection) -> Reading:
            stats = info.info("stats")
            machine = machine_cpu()
            relations = {
                str(name): int(size) for name, size in conn.execute(RELATIONS, {"schema": schema_name})
            }
            return Reading(
                at=time.monotonic(),
                worker_cpu=sum(group_cpu(worker.pid) for worker in workers),
                redis_cpu=group_cpu(commands.pid),
                producer_cpu=_producer_cpu(),
                machine_cpu=machine[0],
                kernel_cpu=machine[1],
                backends=backends_cpu(admin, tag),
                background=backends_cpu(admin, None),
                commands=commands.snapshot(),
                net_in=int(stats["total_net_input_bytes"]),
                net_out=int(stats["total_net_output_bytes"]),
                used_memory=int(info.info("memory")["used_memory"]),
                relations=relations,
                rows=_rows(conn, schema_name, relations),
            )

        sku_memory: dict[int, float] = {}
        try:
            if shape.skew:
                if progress:
                    progress(f"  warm-up: {shape.warm_requests} reservations drawn like the measured ones")
                burst("warm", shape.warm_requests)
            else:
                if progress:
                    progress(f"  warm-up: {shape.warm_passes * sku_count} reservations over {sku_count} SKUs")
                # One pass first: what a SKU leased once holds, then what it holds with its log full.
                burst("warm", sku_count)
                sku_memory[1] = _lease_memory(leases) / sku_count
                burst("warm-more", (shape.warm_passes - 1) * sku_count)
                sku_memory[shape.warm_passes] = _lease_memory(leases) / sku_count
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
                keys = burst("measured", measured)
                after = read(conn)
                wal = float(conn.execute(WAL_SINCE, {"lsn": lsn}).scalar_one())
                end = conn.execute(WAL_LSN).scalar_one()
                conn.commit()
                dumped = schema_wal(conn, schema_name, str(lsn), str(end))
            with seeding.connect() as conn:
                batched = int(conn.execute(BATCHED, {"keys": keys}).scalar_one())
            lease_memory = _lease_memory(leases)
        except Exception as exc:  # a burst that does not end is usually explained by the workers' logs
            logs = "\n".join(worker.tail() for worker in workers)
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n{logs}") from exc

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
    wal_bytes = wal - idle_wal * seconds if dumped is None else dumped
    section = (
        f"Capacity: one reservation end to end ({n} reserve requests, {shape.label}, {n / seconds:.0f}/s)"
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
        f"{wal_bytes / n:,.0f} B",
        f"pg_current_wal_lsn() difference, less the server's idle {idle_wal:,.0f} B/s"
        if dumped is None
        else f"pg_waldump: records of this schema's transactions (server-wide "
        f"{(wal - idle_wal * seconds) / n:,.0f} B less the idle {idle_wal:,.0f} B/s)",
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
    if sku_memory:
        row(
            "Redis memory per SKU",
            " / ".join(f"{sku_memory[k]:,.0f} B" for k in sorted(sku_memory)),
            "MEMORY USAGE of the lease keys after " + " / ".join(map(str, sorted(sku_memory)))
            + " leases per SKU, per SKU not per reservation",
        )
    else:
        row(
            "Redis memory per SKU touched",
            f"{lease_memory / len(requests_by_sku):,.0f} B",
            f"MEMORY USAGE of the lease keys of the {len(requests_by_sku):,} SKUs requested, per SKU",
        )
    row(
        "machine CPU",
        f"{(after.machine_cpu - before.machine_cpu) / n * 1e3:.2f} ms",
        "/proc/stat, every process on the machine: the rows above, PostgreSQL's background processes, the "
        "kernel, and whatever else runs",
    )
    if after.background:
        row("PostgreSQL background CPU", f"{spent(before.background, after.background) / n * 1e3:.2f} ms",
            "walwriter, checkpointer, background writer, autovacuum: the whole server's, /proc")  # fmt: skip
    row("kernel interrupts", f"{(after.kernel_cpu - before.kernel_cpu) / n * 1e3:.2f} ms",
        "/proc/stat irq + softirq (loopback traffic), charged to no process")  # fmt: skip
    if batched:
        row("served in a hot SKU's batch", f"{batched / n:.1%}", "task_attempts 'served in a batch of'")
    total_bytes = sum(after.relations.values()) - sum(before.relations.values())
    row("PostgreSQL disk", f"{total_bytes / n:,.0f} B",
        "pg_total_relation_size of every table (indexes, TOAST, partitions) difference")  # fmt: skip

    disk = f"Capacity: PostgreSQL disk per reservation, by table ({n} reserve requests, {shape.label})"
    for name in sorted(after.relations):
        grown = after.relations[name] - before.relations.get(name, 0)
        rows = after.rows[name] - before.rows.get(name, 0)
        if grown or rows:
            results.cost(
                disk,
                name,
                {"rows per reservation": f"{rows / n:.2f}", "bytes per reservation": f"{grown / n:,.0f}"},
            )
    note = (
        "Capacity: counters read after a warm-up burst (a uniform shape leases every SKU "
        f"{LEASES_PER_SKU} times) and after the measured one, each burst waited out until every outcome is "
        "in the database and the broker is empty. Relation sizes grow by whole 8 KB pages, and a table's "
        "first pages (its indexes' too) came with the warm-up; PostgreSQL CPU counts the backends of the "
        "worker's connections (application_name), the background processes a row of their own; WAL is "
        "read with pg_waldump where the server's pg_wal is readable here (the records of transactions on "
        "the run's schema), else server-wide less its idle rate, so other databases' writes count too."
    )
    if note not in results.notes:
        results.notes.append(note)
    return Costs(
        shape=shape,
        n=n,
        seconds=seconds,
        worker_cpu=(after.worker_cpu - before.worker_cpu) / n,
        postgres_cpu=backend_cpu / n if after.backends else None,
        redis_cpu=(after.redis_cpu - before.redis_cpu) / n,
        producer_cpu=(after.producer_cpu - before.producer_cpu) / n,
        machine_cpu=(after.machine_cpu - before.machine_cpu) / n,
        background_cpu=spent(before.background, after.background) / n if after.background else None,
        kernel_cpu=(after.kernel_cpu - before.kernel_cpu) / n,
        wal=wal_bytes / n,
        disk=total_bytes / n,
        commands=sum(calls.values()),
        net_in=net_in,
        net_out=net_out,
        lease_memory=lease_memory,
        requests_by_sku=requests_by_sku,
        sku_memory=sku_memory,
        batched=batched,
    )
