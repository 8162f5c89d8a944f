"""What a worker makes sure of before it takes tasks, and what it does when a client still cannot be built
once it runs: real ``celery worker`` processes.

- A database and a lease backend that do not answer yet are waited for, with a line saying so, and the
  ready line comes once they answer (misconfigured is refused at start: tests/test_settings_at_start.py).
- A schema behind the code is refused with exit 2 naming both revisions; a newer one is taken when its
  migrations declared it compatible with this code (the decision itself: :func:`reservations.schema.judge`).
- With ``RESERVATIONS_LOG_FORMAT=json`` every line the worker writes is one JSON object.
- A lease client that cannot be built ends each request ``dead_lettered`` with the reason; a database
  client that cannot be built keeps the request until a worker can record its outcome.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from fencing.engines import make_engine
from reservations import Inventory, schema
from reservations.models import schema_compatibility
from reservations.statuses import RequestStatus
from tasks import ReservationClient, Settings, create_app, failpoints
from testing.celery_processes import CeleryProcess, stop_all, worker_env
from testing.harness import free_port, wait_until
from testing.proxy import DelayProxy
from testing.redis_servers import RedisServer, redis_server
from testing.support import refused_worker, run
from testing.workers import pg_schema

pytestmark = pytest.mark.slow

HEAD = schema.head() or ""
NEWER = "9001"  # a revision no code of this package knows: a later release's migration


# -- the decision, without services ---------------------------------------------------------------------

KNOWN = ["0001", "0002", "0003"]


@pytest.mark.parametrize(
    ("found", "oldest_code", "ok", "says"),
    [
        ("0003", None, True, "at revision 0003"),
        ("0002", None, False, "at revision 0002, behind 0003: run `reservations db upgrade`"),
        (None, None, False, "no schema; it needs revision 0003"),
        (
            "0004",
            "0003",
            True,
            "newer than this code's 0003 and declared compatible with code from revision 0003",
        ),
        ("0004", "0002", True, "declared compatible with code from revision 0002"),
        ("0004", "0004", False, "not declared compatible"),
        ("0004", None, False, "not declared compatible"),
    ],
)
def test_which_schema_a_worker_runs_on(
    found: str | None, oldest_code: str | None, ok: bool, says: str
) -> None:
    fit = schema.judge(found, oldest_code, KNOWN)
    assert fit.ok is ok and says in fit.message
    assert fit.needed == "0003" and fit.found == found


def test_every_migration_run_records_which_code_may_run_on_its_schema(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'inventory.sqlite3'}"

    def recorded() -> list[tuple[str, str]]:
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                return [
                    (row.revision, row.oldest_code) for row in conn.execute(sa.select(schema_compatibility))
                ]
        finally:
            engine.dispose()

    # 0008 only adds a table that code of 0007 never reads, and declares so.
    schema.upgrade(url, "0008")
    assert recorded() == [("0008", "0007")]
    schema.upgrade(url)
    assert len(recorded()) == 1 and recorded()[0][0] == HEAD and schema.fit(url).ok


def forge_newer_revision(url: str, oldest_code: str) -> None:
    """The database as a later release's migrations leave it: a revision this code does not know, and the
    oldest code revision they declared compatible."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE alembic_version SET version_num = :v"), {"v": NEWER})
            conn.execute(schema_compatibility.delete())
            conn.execute(schema_compatibility.insert().values(revision=NEWER, oldest_code=oldest_code))
    finally:
        engine.dispose()


# -- real workers ----------------------------------------------------------------------------------------


def _embedded(folder: Path, database_url: str) -> dict[str, str]:
    """Settings of a worker on ``database_url`` with Celery's SQLAlchemy transport for broker and results."""
    return Settings(
        database_url=database_url,
        broker_url=f"sqla+sqlite:///{folder / 'broker.sqlite3'}",
        result_backend=f"db+sqlite:///{folder / 'results.sqlite3'}",
    ).to_env()


def test_a_worker_refuses_a_schema_behind_its_code(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'inventory.sqlite3'}"
    schema.upgrade(url, "0007")
    done = refused_worker(worker_env(_embedded(tmp_path, url)))
    assert done.returncode == 2, done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert f"at revision 0007, behind {HEAD}" in line and "reservations db upgrade" in line
    code, stdout, _ = run("db", "current", env={"RESERVATIONS_DATABASE_URL": url})
    assert code == 1 and "behind" in stdout
    # A later release's schema that did not declare itself compatible with this code: refused too.
    schema.upgrade(url)
    forge_newer_revision(url, NEWER)
    done = refused_worker(worker_env(_embedded(tmp_path, url)))
    assert done.returncode == 2 and f"at revision {NEWER}, which this code" in done.stderr, done.stderr
    assert run("db", "current", env={"RESERVATIONS_DATABASE_URL": url})[0] == 1


def test_a_worker_waits_for_backends_that_do_not_answer_yet_and_logs_only_json(tmp_path: Path) -> None:
    """The database's port and the lease Redis answer only after the worker started: it waits for each in
    turn, says so, and is ready once both answer. The schema is a later release's, declared compatible with
    this code, so the worker starts on it (migrate first, then roll the workers). Every line is JSON."""
    with pg_schema() as db:
        forge_newer_revision(db, HEAD)
        postgres = make_url(db)
        db_port = free_port()
        late_db = postgres.set(host="127.0.0.1", port=db_port).render_as_string(hide_password=False)
        lease_redis = RedisServer(tmp_path / "leases")  # its port is chosen; it is started later
        env = worker_env(
            {
                **_embedded(tmp_path, late_db),
                "RESERVATIONS_LEASE_URL": lease_redis.url(2),
                "RESERVATIONS_LOG_FORMAT": "json",
            }
        )
        worker = CeleryProcess("late", env, tmp_path / "worker.log")
        proxy: DelayProxy | None = None
        try:
            worker.start()
            wait_until(lambda: "waiting for its database" in worker.log(), timeout=60, what="database wait")
            assert worker.alive() and "ready" not in worker.log()
            proxy = DelayProxy((postgres.host or "127.0.0.1", postgres.port or 5432), delay=0, fraction=0,
                               port=db_port).start()  # fmt: skip
            wait_until(lambda: "waiting for its lease backend" in worker.log(), timeout=60, what="lease wait")
            assert "ready" not in worker.log()
            lease_redis.start()
            worker.wait_ready()
            lines = [line for line in worker.log().splitlines() if line.strip()]
            entries = [json.loads(line) for line in lines]  # a line that is not JSON fails here
            assert all({"time", "level", "logger", "message"} <= set(entry) for entry in entries)
            events = [entry.get("event") for entry in entries]
            assert "waiting_for_backend" in events and "schema_ahead" in events and "worker_ready" in events
            assert events.index("schema_ahead") < events.index("worker_ready")
            ahead = next(e for e in entries if e.get("event") == "schema_ahead")["message"]
            assert f"at revision {NEWER}, newer than this code's {HEAD}" in ahead
            stop_all([worker])  # a warm shutdown: Celery's own lines, written past logging, are JSON too
            stopped = [json.loads(line) for line in worker.log().splitlines() if line.strip()]
            assert any("Warm shutdown" in entry["message"] for entry in stopped), stopped[-3:]
        finally:
            stop_all([worker])
            lease_redis.stop()
            if proxy is not None:
                proxy.close()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "broker") as server:
        yield server


def test_every_request_reaches_an_outcome_when_a_client_cannot_be_built(
    tmp_path: Path, broker: RedisServer
) -> None:
    """A lease client that cannot be built in a running worker dead-letters each request with the reason;
    a database client that cannot be built keeps the request (there is nowhere to record an outcome), and
    a worker that can build it gives the request its outcome."""
    url = f"sqlite:///{tmp_path / 'inventory.sqlite3'}"
    inventory = Inventory.from_url(url, migrate=True)
    inventory.add_sku("WIDGET", on_hand=10)
    settings = {
        "RESERVATIONS_DATABASE_URL": url,
        "RESERVATIONS_BROKER_URL": broker.url(0),
        "RESERVATIONS_RESULT_BACKEND": broker.url(1),
    }
    client = ReservationClient(create_app(Settings.from_env(settings)))

    def worker(name: str, failpoints: str = "") -> CeleryProcess:
        env = worker_env({**settings, "RESERVATIONS_FAILPOINTS": failpoints} if failpoints else settings)
        started = CeleryProcess(name, env, tmp_path / f"{name}.log")
        started.start()
        started.wait_ready()
        return started

    running: list[CeleryProcess] = []
    try:
        running = [worker("nolease", "build_leases=raise")]
        handles = [client.enqueue_reservation_sync("WIDGET", 1, idempotency_key=f"k-{n}") for n in range(3)]
        for handle in handles:
            outcome = handle.result_sync(timeout=30)
            assert outcome.status == RequestStatus.DEAD_LETTERED, outcome
            assert outcome.detail["reason"] == "lease backend client cannot be built"
            assert "failpoint build_leases" in outcome.detail["error"]
        stop_all(running)

        running = [worker("nodb", "build_inventory=raise")]
        kept = client.enqueue_reservation_sync("WIDGET", 2, idempotency_key="k-kept")
        # The request comes back to the worker again and again, still without an outcome.
        wait_until(
            lambda: running[0].log().count("kept for a later attempt") >= 2,
            timeout=60,
            what="the request kept",
        )
        assert inventory.request_outcome("k-kept") is None
        stop_all(running)

        running = [worker("healthy")]
        outcome = kept.result_sync(timeout=30)
        assert outcome.status == RequestStatus.RESERVED, outcome
        assert inventory.stock("WIDGET").available == 8
    finally:
        stop_all(running)
        client.close()
        client.app.close()
        inventory.close()


@pytest.mark.parametrize(
    ("spec", "folder", "problem"),
    [
        ("nowhere=stop", "", "bad failpoint 'nowhere=stop'"),
        ("before_write=explode", "", "bad failpoint"),
        ("renew=stop", "", "skip is renew's action"),
        ("before_write=skip", "", "skip is renew's action"),
        ("before_write=stop,once", "", "'once' needs RESERVATIONS_FAILPOINT_DIR"),
    ],
)
def test_a_failpoint_a_worker_could_not_reach_is_refused_at_start(
    spec: str, folder: str, problem: str
) -> None:
    found = failpoints.check(spec, folder)
    assert found is not None and found.startswith("RESERVATIONS_FAILPOINTS: ") and problem in found
    assert failpoints.check("before_write=stop,once;renew=skip", "/tmp/points") is None
