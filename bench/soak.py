"""Soak: waves of reservations over many SKUs through two workers and beat, and what each wave leaves in
Redis. After every wave, once its outcomes are in the database and the broker holds no message (queued or
unacknowledged), it records Redis ``used_memory``, the workers' and this producer's resident memory and the
PostgreSQL connections of the run. Run three times, each on a fresh private redis-server and schema: with
the project's default retention (requests store no Celery result), with every result kept (as
``RESERVATIONS_RESULT_EXPIRES`` does for callers of ``AsyncResult.get()``), and with the retention the
project had before (every result kept 24 hours with extended metadata), the baseline.

What levels off is read from the growth after the second wave: the first waves pay for what is made once
(connections, a lease record per SKU, the broker's bindings, allocator arenas), later ones only for what
each request leaves behind.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from bench import old_results
from bench.bursts import outcomes_in
from bench.env import Scratch
from bench.timing import Progress, Results
from fencing.engines import make_engine
from reservations import Inventory, schema
from tasks import ReservationClient, Settings, create_app
from testing.celery_processes import CeleryProcess, start_all, stop_all, worker_env
from testing.harness import children, wait_until
from testing.redis_servers import redis_server

ROOT = Path(__file__).resolve().parent.parent
WAVES = 8
PER_WAVE = 800
QUICK_PER_WAVE = 100
# Many SKUs, so that requests rarely meet a busy lease; each leased 4 times in the first two waves, which
# fills its lease history log (history_cap 4): from then on a SKU's keys stay the size they are.
LEASES_PER_SKU = 4
ON_HAND = 10**6
WORKERS = 2
CONCURRENCY = 2
# Beat sweeps this often during the soak (30 s by default): its own tasks' results show up, bounded.
SWEEP_EVERY = 5.0
GOAL = 100.0  # bytes of Redis memory per request after the second wave
WAVE_TIMEOUT = 120.0  # a wave's outcomes and an empty broker, far above a wave's few seconds
SCAN_LIMIT = 100_000  # keys looked at per database when the key families are counted


@dataclass(frozen=True)
class Retention:
    label: str
    app: str  # the workers' Celery app (celery -A)
    expires: int  # RESERVATIONS_RESULT_EXPIRES


CURRENT = Retention("no request results (default)", "tasks", 0)
# What a deployment whose callers use AsyncResult.get() pays: every result kept (here an hour, far longer
# than the soak, so none expires during it), without the extended metadata.
KEPT = Retention("results kept 1 h", "tasks", 3600)
BEFORE = Retention("before: 24 h, extended", "bench.old_results", old_results.EXPIRES)


@dataclass(frozen=True)
class Wave:
    requests: int  # reservations so far, this wave's included
    seconds: float  # enqueue of the first to the broker drained
    used_memory: int
    results: int  # keys in the result backend's database
    worker_rss: int  # both workers, main processes and pool children
    producer_rss: int
    pg_connections: int


@dataclass(frozen=True)
class Family:
    keys: int
    bytes: int


@dataclass(frozen=True)
class Soak:
    retention: Retention
    waves: list[Wave]
    families: dict[str, Family]  # key family (db: pattern) -> count and MEMORY USAGE after the last wave

    def growth(self) -> float:
        """Bytes of used_memory per request from the second wave on: the slope of a least-squares line
        through the readings after waves 2 to the last, which a single noisy reading moves less than the
        difference of two."""
        later = self.waves[1:]
        fit = statistics.linear_regression([w.requests for w in later], [w.used_memory for w in later])
        return fit.slope


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` (VmRSS), 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


def worker_rss(workers: list[CeleryProcess]) -> int:
    return sum(rss(pid) for worker in workers for pid in [worker.pid, *children(worker.pid)])


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_SCOPE = re.compile(r"\{[^}]*\}")


def family(key: str) -> str:
    """A key's family: task ids and lease scopes (the SKU) replaced, so per-request and per-SKU keys
    each count as one line."""
    return _SCOPE.sub("{sku}", _UUID.sub("<task id>", key))


def key_families(base: str, dbs: dict[int, str]) -> dict[str, Family]:
    """Every key of the databases ``dbs`` (number -> role) of the server at ``base``, at most SCAN_LIMIT
    each, by family, with its count and MEMORY USAGE total. A bench-only look: the product never scans."""
    found: dict[str, list[int]] = {}
    for db, role in dbs.items():
        with redis.Redis.from_url(f"{base}/{db}") as client:
            scanned = zip(range(SCAN_LIMIT), client.scan_iter(count=1000), strict=False)
            keys = [key.decode() for _, key in scanned]
            with client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.memory_usage(key, samples=0)
                sizes = pipe.execute()
        for key, size in zip(keys, sizes, strict=True):
            entry = found.setdefault(f"{role}: {family(key)}", [0, 0])
            entry[0] += 1
            entry[1] += int(size or 0)
    return {name: Family(count, size) for name, (count, size) in sorted(found.items())}


def _seed(url: str, skus: list[str]) -> None:
    with Inventory.from_url(url) as inventory:
        for sku in skus:
            inventory.add_sku(sku, on_hand=ON_HAND)


def _connections(engine: sa.Engine, tag: str) -> int:
    with engine.connect() as conn:
        query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :tag")
        return int(conn.execute(query, {"tag": tag}).scalar_one())


def soak(
    retention: Retention,
    scratch: Scratch,
    workdir: Path,
    *,
    waves: int,
    per_wave: int,
    progress: Progress | None,
) -> Soak:
    """One soak on a private redis-server, a fresh schema, ``WORKERS`` workers and beat."""
    tag = f"soak-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        server = stack.enter_context(redis_server(workdir / "redis"))
        base = server.url(None)
        migrated = scratch.postgres_url(tag.replace("-", "_"))
        schema.upgrade(migrated)
        # The run's connections carry its name: PostgreSQL is shared with whatever else runs.
        database_url = make_url(migrated).update_query_dict({"application_name": tag})
        url = database_url.render_as_string(hide_password=False)
        skus = [f"SOAK-{n}" for n in range(2 * per_wave // LEASES_PER_SKU)]
        _seed(url, skus)
        settings = Settings(
            broker_url=f"{base}/0",
            result_backend=f"{base}/1",
            lease_url=f"{base}/2",
            database_url=url,
            result_expires=retention.expires,
            expiry_interval=SWEEP_EVERY,
        )
        env = worker_env(settings)
        workers = [
            CeleryProcess(
                f"soak{n}",
                env,
                workdir / f"soak{n}.log",
                app=retention.app,
                concurrency=CONCURRENCY,
                cwd=ROOT,
            )
            for n in range(WORKERS)
        ]
        beat = CeleryProcess("soak-beat", env, workdir / "beat.log", kind="beat", cwd=ROOT)
        stack.callback(stop_all, [*workers, beat])
        start_all([*workers, beat])

        app = create_app(settings)
        stack.callback(app.close)
        client = ReservationClient(app)
        stack.callback(client.close)
        inventory = stack.enter_context(Inventory.from_url(url))
        admin = make_engine(scratch.settings.postgres_url)
        stack.callback(admin.dispose)
        broker = stack.enter_context(redis.Redis.from_url(f"{base}/0"))
        results = stack.enter_context(redis.Redis.from_url(f"{base}/1"))

        def drained() -> bool:
            # kombu's Redis transport: the queue is a list, delivered and unacknowledged messages a hash.
            return bool(broker.llen("celery") == 0 and broker.hlen("unacked") == 0)

        recorded: list[Wave] = []
        try:
            for wave in range(waves):
                keys = [f"{tag}-{wave}-{n}" for n in range(per_wave)]
                started = time.monotonic()
                for n, key in enumerate(keys):
                    client.enqueue_reservation_sync(
                        skus[(wave * per_wave + n) % len(skus)], 1, idempotency_key=key
                    )
                statuses = wait_until(
                    lambda: outcomes_in(inventory, keys),  # noqa: B023  (called within this iteration)
                    timeout=WAVE_TIMEOUT, what=f"the outcomes of wave {wave + 1}", interval=0.1,
                )  # fmt: skip
                if statuses != Counter(reserved=per_wave):
                    raise RuntimeError(f"wave {wave + 1}: outcomes {dict(statuses)}, not all reserved")
                wait_until(drained, timeout=WAVE_TIMEOUT, what="an empty broker", interval=0.05)
                seconds = time.monotonic() - started
                recorded.append(Wave(
                    requests=(wave + 1) * per_wave,
                    seconds=seconds,
                    used_memory=int(broker.info("memory")["used_memory"]),
                    results=int(results.dbsize()),
                    worker_rss=worker_rss(workers),
                    producer_rss=rss(os.getpid()),
                    pg_connections=_connections(admin, tag),
                ))  # fmt: skip
                if progress:
                    memory = recorded[-1].used_memory
                    progress(f"    wave {wave + 1}: {per_wave} in {seconds:.1f} s, used_memory {memory:,} B")
            families = key_families(base, {0: "broker", 1: "results", 2: "leases"})
        except Exception as exc:  # a wave that does not end is usually explained by the logs
            tails = "\n".join(process.tail() for process in [*workers, beat])
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n{tails}") from exc
    return Soak(retention, recorded, families)


def _kb(n: int) -> str:
    return f"{n / 1024:,.0f} KB"


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def _rows(run: Soak) -> Iterator[tuple[str, dict[str, str]]]:
    first = run.waves[0]
    for n, wave in enumerate(run.waves, start=1):
        since = (
            f"{(wave.used_memory - run.waves[1].used_memory) / (wave.requests - run.waves[1].requests):,.0f}"
            if n > 2
            else "-"
        )
        yield (
            f"{run.retention.label}, wave {n}",
            {
                "requests": f"{wave.requests:,}",
                "s": f"{wave.seconds:.1f}",
                "Redis used_memory": _kb(wave.used_memory),
                "B/request since wave 2": since,
                "result keys": f"{wave.results:,}",
                "worker RSS": _mb(wave.worker_rss),
                "Δ worker RSS": _mb(wave.worker_rss - first.worker_rss),
                "producer RSS": _mb(wave.producer_rss),
                "PG connections": str(wave.pg_connections),
            },
        )


def redis_per_request(
    scratch: Scratch,
    results: Results,
    *,
    quick: bool = False,
    progress: Progress | None = None,
) -> None:
    """Needs PostgreSQL and a ``redis-server`` binary; the caller checks both."""
    per_wave = QUICK_PER_WAVE if quick else PER_WAVE
    runs: list[Soak] = []
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="fencing-bench-soak-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        for n, retention in enumerate((CURRENT, KEPT, BEFORE)):
            if progress:
                progress(f"  {retention.label}: {WAVES} waves of {per_wave} reservations")
            runs.append(
                soak(
                    retention, scratch, workdir / f"run{n}", waves=WAVES, per_wave=per_wave, progress=progress
                )
            )

    section = (
        f"Soak: {WAVES} waves of {per_wave} reservations over {2 * per_wave // LEASES_PER_SKU} SKUs, "
        f"{WORKERS} workers -c {CONCURRENCY}"
        " and beat; after each wave"
    )
    for run in runs:
        for case, values in _rows(run):
            results.cost(section, case, values)
    current, kept, before = (run.growth() for run in runs)
    verdict = "met" if current <= GOAL else "NOT met"
    results.notes.append(
        f"Soak: Redis used_memory grows {current:,.0f} bytes per request after the second wave with the "
        f"project's retention (goal at most {GOAL:.0f}: {verdict}), against {before:,.0f} bytes per request "
        f"with every result kept 24 h with extended metadata, the retention before, and {kept:,.0f} with "
        "every result kept (RESERVATIONS_RESULT_EXPIRES) without it. Growth: the slope of a "
        "least-squares line through the readings after waves 2 to the last; 'B/request since wave 2' is the "
        "plain difference to each wave. used_memory is read once the wave's outcomes are in the database and "
        "the broker holds no queued or unacknowledged message; between readings it moves by up to ~150 KB "
        "(client buffers, the allocator) whatever the keys."
    )
    for run in runs:
        families = "; ".join(
            f"{name} {entry.keys:,} keys, {entry.bytes:,} B" for name, entry in run.families.items()
        )
        results.notes.append(f"Soak, Redis keys after the last wave ({run.retention.label}): {families}.")
    results.context.append(
        f"Soak: each of the {len(runs)} retentions on a private redis-server and a fresh schema, {WORKERS} x "
        f"celery worker --pool prefork -c {CONCURRENCY} and celery beat sweeping every {SWEEP_EVERY:g} s; "
        "the baseline's workers run bench.old_results (result_expires 24 h, result_extended); reservations "
        "enqueued by ReservationClient, outcomes read from the database"
    )
