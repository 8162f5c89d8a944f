"""The history's day partitions (PostgreSQL, revision 0010): ``sku_history`` and ``task_attempts`` are
range-partitioned by ``at_ms``, one partition per UTC day named ``<table>_pYYYYMMDD``, with a DEFAULT
partition for any write outside them. Partitions are made ahead of the clock by the hourly
``reservations.purge`` and by every archive run (:mod:`reservations.archive`); SQLite has none.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta

import sqlalchemy as sa

from fencing.sql import db_now_ms
from reservations.errors import InvalidRequest
from reservations.models import sku_checkpoints, sku_history, task_attempts

DAY_MS = 86_400_000
# Partitions kept ready ahead of the clock (revision 0010 makes the first week; the hourly
# `reservations.purge` and every archive run keep it this wide). A write past them lands in DEFAULT.
DAYS_AHEAD = 7
TABLES = (sku_history, task_attempts)
_DAY_PARTITION = re.compile(r"^(sku_history|task_attempts)_p([0-9]{8})$")


def day_ms(day: date) -> int:
    return int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()) * 1000


def day_of(ms: int) -> date:
    return datetime.fromtimestamp(ms / 1000, UTC).date()


def partition_name(table: str, day: date) -> str:
    if table not in ("sku_history", "task_attempts"):
        raise InvalidRequest(f"{table!r} is not a partitioned history table", field="table")
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
