"""Archiving the history: whole UTC days of ``sku_history`` and ``task_attempts`` leave the database for
one gzip CSV file each (with a JSON manifest), and each SKU's stock as that history explained it stays
behind as a checkpoint (``sku_checkpoints``), from which the audit and the token history start.

On PostgreSQL a day is a partition: detach it and write the checkpoints in one transaction, copy it out
and read the file back, drop it; a run that stops after the detach is taken up by the next. SQLite has no
partitions: the day's rows are written out first, then checked, checkpointed and deleted in one
transaction. The steps, what a stopped run leaves and what a run refuses: docs/operations.md, "History
partitions and archiving".
"""

from __future__ import annotations

import csv
import fcntl
import gzip
import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Generator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from fencing.sql import db_now_ms
from reservations.errors import ArchiveBusy, ArchiveInterrupted, InvalidRequest
from reservations.models import sku_checkpoints, sku_history, task_attempts
from reservations.reads import NEWEST_CHECKPOINTS

DAY_MS = 86_400_000
DAYS_AHEAD = 7  # partitions kept ready ahead of the clock (revision 0010 makes the first week)
TABLES = (sku_history, task_attempts)
_DAY_PARTITION = re.compile(r"^(sku_history|task_attempts)_p([0-9]{8})$")


def day_ms(day: date) -> int:
    return int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()) * 1000


def day_of(ms: int) -> date:
    return datetime.fromtimestamp(ms / 1000, UTC).date()


def partition_name(table: str, day: date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def parse_partition(name: str) -> tuple[str, date] | None:
    match = _DAY_PARTITION.match(name)
    if match is None:
        return None
    try:
        return match.group(1), datetime.strptime(match.group(2), "%Y%m%d").replace(tzinfo=UTC).date()
    except ValueError:  # p20261399: not one of ours
        return None


def ident(conn: sa.Connection, name: str) -> str:
    return conn.dialect.identifier_preparer.quote_identifier(name)


_TABLES_HERE = sa.text(
    """
    SELECT c.relname, parent.relname AS parent
    FROM pg_class c
    JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = current_schema()
    LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
    LEFT JOIN pg_class parent ON parent.oid = i.inhparent
    WHERE c.relkind = 'r' AND (c.relname LIKE 'sku\\_history\\_p%' OR c.relname LIKE 'task\\_attempts\\_p%')
    """
)


def day_tables(conn: sa.Connection) -> tuple[list[tuple[str, date]], list[tuple[str, date]]]:
    """(attached, detached) day partitions of the history tables in this schema."""
    attached: list[tuple[str, date]] = []
    detached: list[tuple[str, date]] = []
    for name, parent in conn.execute(_TABLES_HERE).all():
        parsed = parse_partition(name)
        if parsed is None:
            continue
        (attached if parent == parsed[0] else detached).append((name, parsed[1]))
    return attached, detached


def prepare_partitions(engine: sa.Engine, *, days_ahead: int = DAYS_AHEAD) -> list[str]:
    """Make the day partitions from today to ``days_ahead`` days ahead (database clock) that are missing;
    their names. A day whose rows already sit in the DEFAULT partition is left there (PostgreSQL would
    refuse the partition): those rows stay readable and counted, only never archived. Nothing on SQLite."""
    if engine.dialect.name != "postgresql":
        return []
    created: list[str] = []
    with engine.begin() as conn:
        today = day_of(conn.execute(sa.select(db_now_ms())).scalar_one())
        attached, detached = day_tables(conn)
        taken = {name for name, _ in attached + detached}
        # A day once archived is not partitioned again (a write dated in it lands in DEFAULT, counted but
        # never archived): its archive file is the day's, once.
        archived_until = conn.execute(sa.select(sa.func.max(sku_checkpoints.c.through_ms))).scalar() or 0
        for offset in range(days_ahead + 1):
            day = today + timedelta(days=offset)
            if day_ms(day) < archived_until:
                continue
            for table in TABLES:
                name = partition_name(table.name, day)
                if name in taken:
                    continue
                low, high = day_ms(day), day_ms(day + timedelta(days=1))
                stray = conn.execute(
                    sa.select(sa.literal(1))
                    .select_from(sa.table(f"{table.name}_default"))
                    .where(sa.column("at_ms") >= low, sa.column("at_ms") < high)
                    .limit(1)
                ).first()
                if stray is not None:
                    continue
                conn.execute(
                    sa.text(
                        f"CREATE TABLE {ident(conn, name)} PARTITION OF {ident(conn, table.name)} "
                        f"FOR VALUES FROM ({low}) TO ({high})"
                    )
                )
                created.append(name)
    return created


def default_rows(engine: sa.Engine) -> dict[str, int]:
    """Rows in each table's DEFAULT partition (PostgreSQL; none on SQLite): rows dated where no day
    partition was (a clock set far off, a day archived before), readable and counted but never archived."""
    if engine.dialect.name != "postgresql":
        return {table.name: 0 for table in TABLES}
    with engine.connect() as conn:
        return {
            table.name: int(
                conn.execute(
                    sa.select(sa.func.count()).select_from(sa.table(f"{table.name}_default"))
                ).scalar_one()
            )
            for table in TABLES
        }


@dataclass(frozen=True, slots=True)
class ArchivedSpan:
    """One day of one table: archived (or, in a dry run, to be)."""

    table: str
    partition: str  # sku_history_p20261204: the partition's name, and the archive file's stem
    from_ms: int
    to_ms: int  # exclusive
    rows: int
    checkpoints: int  # SKUs checkpointed (sku_history)
    file: str | None  # the archive file written (None in a dry run)
    sha256: str | None
    resumed: bool  # detached by an earlier run that stopped before dropping it


@dataclass(frozen=True, slots=True)
class ArchiveReport:
    before_ms: int  # days ending at or before it were archived
    dry_run: bool
    spans: list[ArchivedSpan] = field(default_factory=list)
    created: list[str] = field(default_factory=list)  # partitions made ahead


# -- checkpoints ---------------------------------------------------------------------------------------


def _write_checkpoints(conn: sa.Connection, source: sa.FromClause, to_ms: int, archive: str) -> int:
    """Each SKU of ``source`` (the rows leaving): its previous checkpoint plus these rows' deltas."""
    is_write = source.c.kind == "write"
    sums = conn.execute(
        sa.select(
            source.c.sku,
            sa.func.coalesce(sa.func.sum(sa.case((is_write, source.c.on_hand_delta), else_=0)), 0),
            sa.func.coalesce(sa.func.sum(sa.case((is_write, source.c.reserved_delta), else_=0)), 0),
            # The creation's token 0 is no owner's (the audit skips it too).
            sa.func.max(sa.case((sa.and_(is_write, source.c.operation != "create"), source.c.token))),
            sa.func.max(source.c.id),
        ).group_by(source.c.sku)
    ).all()
    if not sums:
        return 0
    before = {r.sku: r for r in conn.execute(NEWEST_CHECKPOINTS).all()}
    now = conn.execute(sa.select(db_now_ms())).scalar_one()
    rows = []
    for sku, on_hand, reserved, highest, last_id in sums:
        prior = before.get(sku)
        rows.append(
            {
                "sku": sku,
                "through_ms": to_ms,
                "on_hand": (prior.on_hand if prior else 0) + int(on_hand),
                "reserved": (prior.reserved if prior else 0) + int(reserved),
                "highest_token": max(prior.highest_token if prior else 0, int(highest or 0)),
                "last_id": max(prior.last_id if prior else 0, int(last_id or 0)),
                "archived_ms": now,
                "archive": archive,
            }
        )
    conn.execute(sa.insert(sku_checkpoints), rows)
    return len(rows)


# -- files ---------------------------------------------------------------------------------------------


def _write_durably(name: str, path: Path, chunks: Iterator[bytes], *, compress: bool) -> None:
    """``chunks`` to ``path`` through a temporary name, fsynced before and after the rename. A full disk, a
    read-only or vanished folder stops the span ``name`` (ArchiveInterrupted): its table keeps the rows."""
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as raw:
            sink: Any = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if compress else raw
            for chunk in chunks:
                sink.write(chunk)
            if compress:
                sink.close()
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(partial, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except BaseException as exc:
        with suppress(OSError):  # what a full disk let through goes: the next run writes it again
            partial.unlink()
        if isinstance(exc, OSError):
            raise ArchiveInterrupted(name, f"cannot write {path}: {exc.strerror or exc}") from exc
        raise


def _read_back(path: Path) -> tuple[str, int, int | None, int | None]:
    """(SHA-256 of the CSV, rows, first and last ``at_ms``) of an archive file, as a reader sees them."""
    digest = hashlib.sha256()
    with gzip.open(path, "rb") as raw:
        while chunk := raw.read(1 << 20):
            digest.update(chunk)
    rows, low, high = 0, None, None
    with gzip.open(path, "rt", newline="", encoding="utf-8") as text:
        for row in csv.DictReader(text):
            at = int(row["at_ms"])
            low, high = (at, at) if low is None or high is None else (min(low, at), max(high, at))
            rows += 1
    return digest.hexdigest(), rows, low, high


def _finish_file(
    folder: Path, table: str, name: str, low: int, high: int, chunks: Iterator[bytes], expected: int
) -> tuple[Path, str]:
    """Write the archive file and its manifest; raise unless the file holds ``expected`` rows."""
    digest = hashlib.sha256()

    def hashed() -> Iterator[bytes]:
        for chunk in chunks:
            digest.update(chunk)
            yield chunk

    path = folder / f"{name}.csv.gz"
    _write_durably(name, path, hashed(), compress=True)
    checksum, rows, low_seen, high_seen = _read_back(path)
    if rows != expected or checksum != digest.hexdigest():
        raise ArchiveInterrupted(name, f"the file holds {rows} rows, the table {expected}: kept the table")
    manifest = {
        "table": table,
        "partition": name,
        "file": path.name,
        "format": "csv, header row, gzip; NULL as an empty unquoted field",
        "from_ms": low,
        "to_ms": high,
        "rows": rows,
        "min_at_ms": low_seen,
        "max_at_ms": high_seen,
        "sha256": checksum,  # of the uncompressed CSV
    }
    manifest_file = iter([json.dumps(manifest, indent=2).encode() + b"\n"])
    _write_durably(name, folder / f"{name}.json", manifest_file, compress=False)
    return path, checksum


# -- the run -------------------------------------------------------------------------------------------


def archive(
    engine: sa.Engine, *, before_ms: int, to: Path, dry_run: bool = False, now_ms: int | None = None
) -> ArchiveReport:
    """Archive every whole UTC day of history that ends at or before ``before_ms`` into ``to``. A cutoff in
    the current UTC day or later is refused, and so is a second run of one database (ArchiveBusy); why:
    docs/operations.md, "History partitions and archiving". ``now_ms`` is when "now" is (the database's
    clock by default; a test's own, to archive what it wrote today)."""
    if isinstance(before_ms, bool) or not isinstance(before_ms, int):
        raise InvalidRequest("the cutoff must be milliseconds since the epoch", field="before")
    if not 0 <= before_ms < day_ms(date(9999, 12, 31)):
        raise InvalidRequest("the cutoff must lie between 1970 and 9999", field="before")
    if to.exists() and not to.is_dir():
        raise InvalidRequest(f"{to} is not a directory", field="to")
    if now_ms is None:
        with engine.connect() as conn:
            now_ms = int(conn.execute(sa.select(db_now_ms())).scalar_one())
    today = day_ms(day_of(now_ms))
    if before_ms > today:
        raise InvalidRequest(
            f"the cutoff {iso(before_ms)} is in the current UTC day or later, whose rows are still being "
            f"written: archive up to {iso(today)} at the latest",
            field="before",
        )
    report = ArchiveReport(before_ms=before_ms, dry_run=dry_run)
    postgres = engine.dialect.name == "postgresql"
    run = _archive_pg if postgres else _archive_sqlite
    if dry_run:
        run(engine, report, to)
        return report
    with _exclusive(engine):
        try:  # a folder under a file, on a read-only mount or refused otherwise is bad input
            to.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=to, prefix=".writable-"):
                pass
        except OSError as exc:
            raise InvalidRequest(f"--to {to} cannot be written: {exc.strerror or exc}", field="to") from None
        run(engine, report, to)
        if postgres:
            report.created.extend(prepare_partitions(engine))
    return report


def iso(ms: int) -> str:
    """Milliseconds since the epoch as an ISO time in UTC (``2026-12-05T00:00:00Z``)."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat().replace("+00:00", "Z")


@contextmanager
def _exclusive(engine: sa.Engine) -> Iterator[None]:
    """Hold the database's archive lock for the run, or raise ArchiveBusy: PostgreSQL's advisory lock of
    the schema's archive (a session lock, gone with the session of a run that died); on SQLite a lock on
    a file beside the database's. An in-memory database has no other run."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            key = conn.execute(sa.text("SELECT hashtext(current_schema() || '.reservations.archive')"))
            lock = key.scalar_one()
            if not conn.execute(sa.text("SELECT pg_try_advisory_lock(:key)"), {"key": lock}).scalar_one():
                raise ArchiveBusy(engine.url.render_as_string(hide_password=True))
            try:
                yield
            finally:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": lock})
                conn.commit()
        return
    database = engine.url.database
    if not database or database == ":memory:":
        yield
        return
    with open(f"{database}.archive-lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArchiveBusy(database) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def detach(engine: sa.Engine, name: str) -> int:
    """Step 1 on PostgreSQL: detach the day partition ``name`` and, of ``sku_history``, write the
    checkpoints of its SKUs, in one transaction; the number of checkpoints."""
    parsed = parse_partition(name)
    if parsed is None:
        raise InvalidRequest(f"{name!r} is not a day partition of the history", field="partition")
    table, day = parsed
    with engine.begin() as conn:
        # Waits for the inserts in flight into the partition; none come after it.
        conn.execute(sa.text(f"ALTER TABLE {ident(conn, table)} DETACH PARTITION {ident(conn, name)}"))
        if table != "sku_history":
            return 0
        leaving = sa.table(name, *(sa.column(c.name) for c in sku_history.c))
        return _write_checkpoints(conn, leaving, day_ms(day + timedelta(days=1)), f"{name}.csv.gz")


def _copy_out(engine: sa.Engine, name: str) -> tuple[int, Generator[bytes, None, None], Any]:
    """(rows, CSV chunks, the connection to close) of a detached table, in one snapshot."""
    from psycopg import sql

    raw = engine.raw_connection()
    conn: Any = raw.driver_connection
    cursor = conn.cursor()
    table = sql.Identifier(name)
    # One transaction (the driver opens it) for the count and the copy. The table is detached: nothing
    # writes to it any more, so the two see the same rows.
    rows = cursor.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0]

    def chunks() -> Generator[bytes, None, None]:
        statement = sql.SQL("COPY (SELECT * FROM {} ORDER BY id) TO STDOUT WITH (FORMAT csv, HEADER true)")
        with cursor.copy(statement.format(table)) as copy:
            for chunk in copy:
                yield bytes(chunk)
        conn.commit()

    return int(rows), chunks(), raw


def _archive_pg(engine: sa.Engine, report: ArchiveReport, to: Path) -> None:
    with engine.connect() as conn:
        attached, detached = day_tables(conn)
    resumed = {name for name, _ in detached}
    due = [(name, day) for name, day in attached if day_ms(day + timedelta(days=1)) <= report.before_ms]
    for name, day in sorted(detached + due, key=lambda item: (item[1], item[0].startswith("task"))):
        table = name.rsplit("_p", 1)[0]
        low, high = day_ms(day), day_ms(day + timedelta(days=1))
        file_name = f"{name}.csv.gz"
        checkpoints = 0
        if report.dry_run:
            with engine.connect() as conn:
                rows = conn.execute(sa.select(sa.func.count()).select_from(sa.table(name))).scalar_one()
            report.spans.append(
                ArchivedSpan(table, name, low, high, int(rows), 0, None, None, name in resumed)
            )
            continue
        if name not in resumed:
            if (to / file_name).exists():
                # A day archived before whose partition came back (rows written with a clock set back):
                # its file is never overwritten, and nothing of the day moves until it is moved away.
                raise ArchiveInterrupted(name, f"{to / file_name} exists: move it away and run again")
            checkpoints = detach(engine, name)
        rows, chunks, raw = _copy_out(engine, name)
        try:
            path, checksum = _finish_file(to, table, name, low, high, chunks, rows)
        except BaseException:
            # The COPY may still be streaming on this connection (the file could not take it all), and
            # the rollback the pool makes when the connection comes back would wait for that stream for
            # ever. The connection is closed outright instead: the server ends the COPY and its
            # transaction, and the detached table stays for the next run.
            raw.invalidate()
            with suppress(Exception):
                chunks.close()
            raise
        finally:
            raw.close()
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {ident(conn, name)}"))
        if name in resumed and table == "sku_history":
            with engine.connect() as conn:
                checkpoints = conn.execute(
                    sa.select(sa.func.count()).where(sku_checkpoints.c.through_ms == high)
                ).scalar_one()
        report.spans.append(
            ArchivedSpan(table, name, low, high, rows, checkpoints, str(path), checksum, name in resumed)
        )


def _csv_chunks(header: list[str], rows: Any) -> Iterator[bytes]:
    """The rows as PostgreSQL's COPY ... csv HEADER writes them (NULL as an empty unquoted field)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow(["" if value is None else value for value in row])
        if buffer.tell() > 1 << 16:
            yield buffer.getvalue().encode()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue().encode()


def _archive_sqlite(engine: sa.Engine, report: ArchiveReport, to: Path) -> None:
    cutoff = day_ms(day_of(report.before_ms))  # whole days: those that end at or before the cutoff
    with engine.connect() as conn:
        days = sorted(
            {
                int(d)
                for table in TABLES
                for (d,) in conn.execute(
                    sa.select(table.c.at_ms / DAY_MS).where(table.c.at_ms < cutoff).distinct()
                ).all()
            }
        )
        archived = {r[0] for r in conn.execute(sa.select(sku_checkpoints.c.through_ms).distinct()).all()}
    for number in days:
        low, high = number * DAY_MS, (number + 1) * DAY_MS
        day = day_of(low)
        for table in TABLES:
            name = partition_name(table.name, day)
            span = sa.and_(table.c.at_ms >= low, table.c.at_ms < high)
            with engine.connect() as conn:
                rows = conn.execute(sa.select(sa.func.count()).where(span)).scalar_one()
            if rows == 0:
                continue
            if report.dry_run:
                report.spans.append(ArchivedSpan(table.name, name, low, high, rows, 0, None, None, False))
                continue
            if table is sku_history and high in archived and (to / f"{name}.csv.gz").exists():
                # Rows written into a day already archived (a clock set back): its file is not overwritten.
                raise ArchiveInterrupted(name, f"new rows in a day archived before; move {name}.csv.gz away")
            with engine.connect() as conn:
                result = conn.execute(sa.select(table).where(span).order_by(table.c.id))
                path, checksum = _finish_file(
                    to, table.name, name, low, high, _csv_chunks(list(result.keys()), result), rows
                )
            checkpoints = 0
            with engine.begin() as conn:
                now = conn.execute(sa.select(sa.func.count()).where(span)).scalar_one()
                if now != rows:
                    raise ArchiveInterrupted(name, f"{now - rows} rows arrived while it was written; rerun")
                if table is sku_history:
                    leaving = sa.select(table).where(span).subquery()
                    checkpoints = _write_checkpoints(conn, leaving, high, path.name)
                conn.execute(sa.delete(table).where(span))
            report.spans.append(
                ArchivedSpan(table.name, name, low, high, rows, checkpoints, str(path), checksum, False)
            )
