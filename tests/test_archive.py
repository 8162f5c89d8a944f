"""History partitions and ``reservations archive``: revision 0010 partitions a PostgreSQL database that
already holds rows (every row kept, the append-only trigger still refusing, code of 0009 still running on
it); whole days leave for gzip CSV files that hold exactly the rows that left, each SKU's checkpoint stays,
and the audit and the token history still hold; a second run does nothing, a run stopped after the detach
is taken up; on SQLite the rows are copied out and then deleted through the path the trigger leaves open
to archived spans only.
"""

from __future__ import annotations

import csv
import fcntl
import gzip
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fencing import LeaseManager
from fencing.engines import make_engine
from reservations import Inventory, archive, schema, scope_of
from reservations.models import sku_history, task_attempts
from testing.stores import migrate_pg_schema, schema_of
from testing.support import cli, run

ROOT = Path(__file__).resolve().parent.parent
# The commit that added revision 0009: the code that ran on it, to run on 0010.
CODE_OF_0009 = "d943fdb6ae7a11467fd54d20cd60433ded39125c"


@pytest.fixture
def engine_of() -> Iterator[Any]:
    engines: list[sa.Engine] = []

    def make(url: str) -> sa.Engine:
        engines.append(make_engine(url))
        return engines[-1]

    yield make
    for engine in engines:
        engine.dispose()


def rows(engine: sa.Engine, table: sa.Table) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(table).order_by(table.c.id))]


def write_some(inventory: Inventory, leases: LeaseManager) -> int:
    """Stock changes under two tokens of WIDGET and one of GADGET, through the real code; the highest
    token of WIDGET."""
    inventory.add_sku("WIDGET", on_hand=10)
    inventory.add_sku("GADGET", on_hand=5)
    first = leases.acquire(scope_of("WIDGET"), ttl=30, holder="host-a:1:task-a")
    held = inventory.reserve(first, "WIDGET", 3, key="order-1")
    inventory.confirm(first, held.reservation_ids[0], key="confirm-1")
    inventory.restock(first, "WIDGET", 4, key="restock-1")
    leases.release(first)
    second = leases.acquire(scope_of("WIDGET"), ttl=30, holder="host-b:2:task-b")
    inventory.reserve(second, "WIDGET", 2, key="order-2")
    gadget = leases.acquire(scope_of("GADGET"), ttl=30, holder="host-a:1:task-c")
    inventory.reserve(gadget, "GADGET", 1, key="order-3")
    leases.release(gadget)
    for key in ("order-1", "order-2", "order-3"):
        inventory.record_attempt(key, "reserve", "applied", task_id=f"task-{key}", worker="host-a")
    return second.token


def day_start(days_from_today: int) -> datetime:
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today + timedelta(days=days_from_today)


def ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def refused_write(at_ms: int, highest: int | None = 2) -> sa.Insert:
    """A refused stale write of WIDGET at ``at_ms``, written directly: the database clock cannot be set, and
    a day before the test's needs a row of its own."""
    return sa.insert(sku_history).values(
        sku="WIDGET", at_ms=at_ms, kind="rejected", operation="reserve", token=1,
        on_hand_delta=0, reserved_delta=0, highest_token=highest,
    )  # fmt: skip


def archived(url: str, before: datetime, folder: Path, *, dry_run: bool = False) -> list[dict[str, Any]]:
    """The spans an archive run up to ``before`` made, run as of tomorrow (``now_ms``): what the test
    wrote through the real code today is a past day's then. The command line refuses the current day
    (test_the_current_day_and_the_future_are_refused_with_nothing_written)."""
    engine = make_engine(url)
    try:
        report = archive.archive(
            engine, before_ms=ms(before), to=folder, dry_run=dry_run, now_ms=ms(day_start(1))
        )
    finally:
        engine.dispose()
    return [asdict(span) for span in report.spans]


def archive_file(path: str) -> tuple[list[dict[str, str]], str]:
    """The rows of an archive file and the SHA-256 of its CSV."""
    with gzip.open(path, "rb") as raw:
        data = raw.read()
    return list(csv.DictReader(data.decode().splitlines(keepends=True))), hashlib.sha256(data).hexdigest()


def assert_archive_holds(span: dict[str, Any], left: list[tuple[Any, ...]]) -> None:
    """The span's file holds exactly ``left`` (by id), as many as the JSON and the manifest say, and its
    checksum is the manifest's."""
    found, checksum = archive_file(span["file"])
    manifest = json.loads(Path(span["file"]).with_name(span["partition"] + ".json").read_text())
    assert [int(r["id"]) for r in found] == [r[0] for r in left]
    assert len(found) == span["rows"] == manifest["rows"]
    assert checksum == span["sha256"] == manifest["sha256"]


# -- the migration -------------------------------------------------------------------------------------


def test_0010_partitions_a_database_with_rows_and_code_of_0009_runs_on_it(
    pg_url: str, engine_of: Any, tmp_path: Path
) -> None:
    schema.upgrade(pg_url, "0009")
    engine = engine_of(pg_url)
    three_days_ago = ms(day_start(-3)) + 5000
    with Inventory.from_url(pg_url) as inventory, LeaseManager.from_url(pg_url) as leases:
        write_some(inventory, leases)
    with engine.begin() as conn:  # rows of days before the migration: their days get partitions
        conn.execute(refused_write(three_days_ago))
        conn.execute(
            sa.insert(task_attempts).values(
                key="old", operation="reserve", result="busy", at_ms=three_days_ago
            )
        )
    history, attempts = rows(engine, sku_history), rows(engine, task_attempts)

    schema.upgrade(pg_url)

    assert (rows(engine, sku_history), rows(engine, task_attempts)) == (history, attempts)
    old_day = archive.partition_name("sku_history", day_start(-3).date())
    with engine.connect() as conn:
        kinds = dict(
            conn.execute(
                sa.text(
                    "SELECT relname, relkind FROM pg_class"
                    " WHERE relnamespace = current_schema()::regnamespace"
                    " AND relname IN ('sku_history', 'task_attempts')"
                )
            ).all()
        )
        in_old_day = conn.execute(sa.select(sa.func.count()).select_from(sa.table(old_day))).scalar_one()
    assert kinds == {"sku_history": "p", "task_attempts": "p"} and in_old_day == 1
    for statement in ("UPDATE sku_history SET token = 0", "DELETE FROM sku_history"):
        with pytest.raises(sa.exc.IntegrityError, match="append-only"), engine.begin() as conn:
            conn.execute(sa.text(statement))
    assert rows(engine, sku_history) == history

    # The code that ran on 0009, as released, on the partitioned schema: it may start (0010 declares it
    # compatible), writes, and its audit finds everything consistent.
    subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "archive",
            "-o",
            str(tmp_path / "code.tar"),
            CODE_OF_0009,
            "fencing",
            "reservations",
        ],
        check=True,
    )
    subprocess.run(["tar", "-xf", str(tmp_path / "code.tar"), "-C", str(tmp_path)], check=True)
    script = f"""
from fencing import LeaseManager
from reservations import Inventory, schema, scope_of
url = {pg_url!r}
assert schema.fit(url).ok, schema.fit(url).message
with Inventory.from_url(url) as inventory, LeaseManager.from_url(url) as leases:
    inventory.add_sku("SPROCKET", on_hand=1)
    lease = leases.acquire(scope_of("SPROCKET"), ttl=30, holder="old-code")
    inventory.restock(lease, "SPROCKET", 2, key="old-code-restock")
    inventory.record_attempt("old-code-restock", "restock", "applied")
    assert inventory.invariant_violations() == [], inventory.invariant_violations()
    print(schema.head())
"""
    old = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (old.returncode, old.stdout.strip()) == (0, "0009"), old.stderr
    assert len(rows(engine, sku_history)) == len(history) + 2
    assert rows(engine, sku_history)[-1][0] > history[-1][0]  # the one sequence goes on


# -- archiving on PostgreSQL ---------------------------------------------------------------------------


@pytest.fixture
def pg_inventory(pg_url: str) -> str:
    migrate_pg_schema(schema_of(pg_url))
    return pg_url


def test_archive_round_trip_on_postgresql(pg_inventory: str, engine_of: Any, tmp_path: Path) -> None:
    url, folder = pg_inventory, tmp_path / "archive"
    env = {"RESERVATIONS_DATABASE_URL": url}
    engine = engine_of(url)
    with Inventory.from_url(url) as inventory, LeaseManager.from_url(url) as leases:
        highest = write_some(inventory, leases)
    # A refused write two days ago, in a partition of that day: two days of history leave.
    two_days_ago = day_start(-2)
    old_day = archive.partition_name("sku_history", two_days_ago.date())
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f'CREATE TABLE "{old_day}" PARTITION OF sku_history'
                f" FOR VALUES FROM ({ms(two_days_ago)}) TO ({ms(day_start(-1))})"
            )
        )
        conn.execute(refused_write(ms(two_days_ago) + 1))
    history, attempts = rows(engine, sku_history), rows(engine, task_attempts)
    end_of_today = day_start(1)  # today's partitions go too

    dry = archived(url, end_of_today, folder, dry_run=True)
    assert [s["rows"] for s in dry] == [1, len(history) - 1, len(attempts)]
    assert not folder.exists() and rows(engine, sku_history) == history

    spans = {s["partition"]: s for s in archived(url, end_of_today, folder)}
    today = archive.partition_name("sku_history", day_start(0).date())
    assert list(spans) == [old_day, today, archive.partition_name("task_attempts", day_start(0).date())]
    assert_archive_holds(spans[old_day], history[:0] + [r for r in history if r[2] < ms(day_start(-1))])
    assert_archive_holds(spans[today], [r for r in history if r[2] >= ms(day_start(0))])
    assert_archive_holds(spans[archive.partition_name("task_attempts", day_start(0).date())], attempts)
    assert spans[today]["checkpoints"] == 2
    assert rows(engine, sku_history) == [] and rows(engine, task_attempts) == []

    audited = run("audit", env=env)
    assert audited.returncode == 0, audited.stdout + audited.stderr
    tokens = run("tokens", "WIDGET", env=env, columns=200)
    assert tokens.returncode == 0 and f"tokens up to {highest} archived" in tokens.stdout, tokens.stdout
    shown = json.loads(run("tokens", "WIDGET", "--json", env=env).stdout)["archived"]
    assert (shown["highest_token"], shown["on_hand"], shown["reserved"]) == (highest, 11, 2)

    # Writes go on after the archive (into DEFAULT: an archived day is not partitioned again) and the
    # audit still adds them to the checkpoints; a write behind the checkpoint's token is still caught.
    with Inventory.from_url(url) as inventory, LeaseManager.from_url(url) as leases:
        lease = leases.acquire(scope_of("GADGET"), ttl=30, holder="host-a:1:task-d")
        inventory.restock(lease, "GADGET", 3, key="restock-2")
    assert run("audit", env=env).returncode == 0
    assert archived(url, end_of_today, folder) == []  # nothing more
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{name}{ext}" for name in spans for ext in (".csv.gz", ".json")
    )


def test_a_run_stopped_after_the_detach_is_taken_up(
    pg_inventory: str, engine_of: Any, tmp_path: Path
) -> None:
    url, folder = pg_inventory, tmp_path / "archive"
    env = {"RESERVATIONS_DATABASE_URL": url}
    engine = engine_of(url)
    with Inventory.from_url(url) as inventory, LeaseManager.from_url(url) as leases:
        write_some(inventory, leases)
    history = rows(engine, sku_history)
    today = archive.partition_name("sku_history", day_start(0).date())
    # Step 1 alone, as a run that died right after it leaves it: the partition detached, the checkpoints
    # written, no file. The stock is explained all the same.
    assert archive.detach(engine, today) == 2
    assert rows(engine, sku_history) == [] and run("audit", env=env).returncode == 0

    done = run(
        "archive", "--before", day_start(-5).date().isoformat(), "--to", str(folder), "--json", env=env
    )
    assert done.returncode == 0, done.stderr
    (span,) = json.loads(done.stdout)["archived"]  # only the detached one: the cutoff is days ago
    assert (span["partition"], span["resumed"], span["checkpoints"]) == (today, True, 2)
    assert_archive_holds(span, history)
    with engine.connect() as conn:
        assert not sa.inspect(conn).has_table(today)
    assert run("audit", env=env).returncode == 0


# -- SQLite --------------------------------------------------------------------------------------------


@pytest.fixture
def sqlite_url(tmp_path: Path, migrated_sqlite: Path) -> str:
    path = tmp_path / "inventory.sqlite3"
    path.write_bytes(migrated_sqlite.read_bytes())
    return f"sqlite:///{path}"


def test_on_sqlite_rows_are_copied_out_then_deleted(sqlite_url: str, engine_of: Any, tmp_path: Path) -> None:
    url, folder = sqlite_url, tmp_path / "archive"
    env = {"RESERVATIONS_DATABASE_URL": url}
    engine = engine_of(url)
    with Inventory.from_url(url) as inventory, LeaseManager.from_url(url) as leases:
        highest = write_some(inventory, leases)
    history, attempts = rows(engine, sku_history), rows(engine, task_attempts)
    # Not archived, not deletable: the trigger lets only archived rows go.
    with pytest.raises(sa.exc.IntegrityError, match="append-only"), engine.begin() as conn:
        conn.execute(sa.delete(sku_history))

    assert archived(url, day_start(1), folder, dry_run=True) != [] and not folder.exists()

    spans = archived(url, day_start(1), folder)
    assert [s["table"] for s in spans] == ["sku_history", "task_attempts"]
    assert_archive_holds(spans[0], history)
    assert_archive_holds(spans[1], attempts)
    assert rows(engine, sku_history) == [] and rows(engine, task_attempts) == []
    assert run("audit", env=env).returncode == 0
    tokens = run("tokens", "WIDGET", env=env, columns=200)
    assert f"tokens up to {highest} archived" in tokens.stdout, tokens.stdout

    with Inventory.from_url(url) as inventory, LeaseManager.from_url(url) as leases:
        lease = leases.acquire(scope_of("GADGET"), ttl=30, holder="host-a:1:task-d")
        inventory.restock(lease, "GADGET", 3, key="restock-2")
    assert run("audit", env=env).returncode == 0
    # A row written after the archive is not covered by a checkpoint: still refused.
    with pytest.raises(sa.exc.IntegrityError, match="append-only"), engine.begin() as conn:
        conn.execute(sa.delete(sku_history))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--before", "last tuesday"], "--before 'last tuesday'"),
        (["--before", "1d", "--to", "{file}"], "is not a directory"),
    ],
)
def test_bad_input_is_refused_with_nothing_written(
    sqlite_url: str, engine_of: Any, tmp_path: Path, args: list[str], says: str
) -> None:
    env = {"RESERVATIONS_DATABASE_URL": sqlite_url}
    with Inventory.from_url(sqlite_url) as inventory:
        inventory.add_sku("WIDGET", on_hand=1)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    args = [a.replace("{file}", str(a_file)) for a in args]
    if "--to" not in args:
        args += ["--to", str(tmp_path / "archive")]
    done = run("archive", *args, env=env)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert not (tmp_path / "archive").exists()
    assert len(rows(engine_of(sqlite_url), sku_history)) == 1


def test_partitions_are_made_ahead_except_for_a_day_already_in_default(
    pg_inventory: str, engine_of: Any
) -> None:
    engine = engine_of(pg_inventory)
    ahead = {d: archive.partition_name("sku_history", day_start(d).date()) for d in (3, 4)}
    with engine.begin() as conn:
        for name in ahead.values():
            conn.execute(sa.text(f'DROP TABLE "{name}"'))
        # A row of day 4 written while it had no partition: in DEFAULT, where it stays.
        conn.execute(refused_write(ms(day_start(4)) + 1, highest=None))
    assert archive.prepare_partitions(engine) == [ahead[3]]
    assert archive.prepare_partitions(engine) == []
    with engine.connect() as conn:
        assert sa.inspect(conn).has_table(ahead[3]) and not sa.inspect(conn).has_table(ahead[4])


# -- faults: each ends in one line and its exit code, and loses nothing ----------------------------------


@contextmanager
def mounted(where: Path, *options: str) -> Iterator[Path]:
    """A tmpfs of the test's own at ``where`` (``size=256k``, ``ro``...), unmounted afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"no tmpfs of our own here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(params=["sqlite", "postgresql"])
def any_url(request: pytest.FixtureRequest) -> str:
    """A migrated database holding WIDGET, written today through the real code."""
    url = str(request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_inventory"))
    with Inventory.from_url(url) as inventory:
        inventory.add_sku("WIDGET", on_hand=5)
    return url


def test_the_current_day_and_the_future_are_refused_with_nothing_written(
    any_url: str, engine_of: Any, tmp_path: Path
) -> None:
    # Archived, today's partition would leave while rows are still written to the day: they would go to
    # the default partition, which no run archives; days to come would leave as empty files.
    folder, env = tmp_path / "archive", {"RESERVATIONS_DATABASE_URL": any_url}
    history = rows(engine_of(any_url), sku_history)
    for before in (day_start(0) + timedelta(hours=1), day_start(1), datetime(2099, 1, 1, tzinfo=UTC)):
        done = run("archive", "--before", before.isoformat(), "--to", str(folder), env=env)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "in the current UTC day or later" in one_line(done.stderr)
    assert not folder.exists() and rows(engine_of(any_url), sku_history) == history


def test_a_to_that_cannot_be_written_is_one_line_with_nothing_changed(
    sqlite_url: str, engine_of: Any, tmp_path: Path
) -> None:
    engine, env = engine_of(sqlite_url), {"RESERVATIONS_DATABASE_URL": sqlite_url}
    with engine.begin() as conn:
        conn.execute(refused_write(ms(day_start(-2)) + 1))
    history = rows(engine, sku_history)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with mounted(tmp_path / "read-only", "ro", "size=64k") as read_only:
        for to, says in ((a_file / "archive", "Not a directory"), (read_only, "Read-only file system")):
            done = run("archive", "--before", "1d", "--to", str(to), env=env)
            assert done.returncode == 2, done.stdout + done.stderr
            line = one_line(done.stderr)
            assert f"--to {to} cannot be written: {says}" in line, line
    assert rows(engine, sku_history) == history
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(sa.table("sku_checkpoints"))).scalar() == 0


def test_a_full_disk_stops_the_run_in_one_line_and_the_next_run_takes_the_day_up(
    pg_inventory: str, engine_of: Any, tmp_path: Path
) -> None:
    # Many rows in a day two days ago: its copy streams far past what the disk holds. The run used to
    # hang for ever there (the pool's rollback waited on the copy still streaming).
    engine, env = engine_of(pg_inventory), {"RESERVATIONS_DATABASE_URL": pg_inventory}
    low = day_start(-2)
    day = archive.partition_name("sku_history", low.date())
    many = 60_000
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f'CREATE TABLE "{day}" PARTITION OF sku_history'
                f" FOR VALUES FROM ({ms(low)}) TO ({ms(day_start(-1))})"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO sku_history (sku, at_ms, kind, operation, token, on_hand_delta, reserved_delta,"
                " highest_token, holder) SELECT 'WIDGET', :low + i, 'rejected', 'reserve', 1, 0, 0, 2,"
                " md5(i::text) || md5((i + 1)::text) FROM generate_series(1, :many) i"
            ),
            {"low": ms(low), "many": many},
        )
    before = day_start(-1).date().isoformat()
    with mounted(tmp_path / "small", "size=256k") as small:
        done = cli("archive", "--before", before, "--to", str(small), env=env)  # a subprocess, with a timeout
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"archiving {day} stopped: cannot write" in one_line(done.stderr)
        assert "No space left on device" in done.stderr
        assert list(small.iterdir()) == []  # the partial file went
    # The day left the table it was in (detached, its checkpoints written); the next run copies it.
    again = run("archive", "--before", before, "--to", str(tmp_path / "roomy"), "--json", env=env)
    assert again.returncode == 0, again.stderr
    (span,) = json.loads(again.stdout)["archived"]
    assert (span["partition"], span["rows"], span["resumed"]) == (day, many, True)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_runs_of_one_database_exclude_each_other(
    backend: str, request: pytest.FixtureRequest, engine_of: Any, tmp_path: Path
) -> None:
    url = str(request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_inventory"))
    env, folder = {"RESERVATIONS_DATABASE_URL": url}, tmp_path / "archive"
    with ExitStack() as held:  # another run's lock, taken as that run takes it
        if backend == "postgresql":
            conn = held.enter_context(engine_of(url).connect())
            key = "hashtext(current_schema() || '.reservations.archive')"
            conn.execute(sa.text(f"SELECT pg_advisory_lock({key})"))
            held.callback(conn.execute, sa.text(f"SELECT pg_advisory_unlock({key})"))
        else:
            lock = held.enter_context(open(f"{sa.engine.make_url(url).database}.archive-lock", "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        done = run("archive", "--before", "1d", "--to", str(folder), env=env)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "another archive run of" in one_line(done.stderr)
        assert not folder.exists()
    done = run("archive", "--before", "1d", "--to", str(folder), env=env)
    assert done.returncode == 0, done.stderr
