"""History that can be archived: on PostgreSQL ``sku_history`` and ``task_attempts`` become tables range
partitioned by ``at_ms``, one partition per UTC day plus a DEFAULT partition, and ``sku_checkpoints`` holds
each SKU's stock and highest accepted token as of the end of the history archived before it
(reservations.archive).

The rows move: each table is renamed aside, a partitioned table of the same columns takes its name, the
days from the oldest row's to a week ahead get their partitions, the rows are copied in, and the primary
key (which must hold the partition key: ``(id, at_ms)``), the index, the sequence's owner and the
append-only trigger are set on the new table before the old one is dropped. One transaction: the rename
locks the table, so no write lands in the old one meanwhile. Its time grows with the rows (a copy and an
index build): migrate in a quiet hour.

SQLite has no partitioning: its tables stay, ``sku_checkpoints`` is added, and the append-only trigger
lets a row be deleted once a checkpoint of its own SKU covers its time and id (what ``reservations archive``
does there after writing the rows to the archive file).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Code of 0009 inserts and reads these tables by the same columns, and PostgreSQL routes each insert to
# its partition: workers of 0009 keep serving. Its audit and token history know nothing of checkpoints,
# so run `reservations archive` only once every command line is of 0010 (docs/operations.md).
oldest_compatible_code = "0009"

DAY_MS = 86_400_000
# Partitions made ahead of the clock; the hourly `reservations.purge` keeps the window this wide.
DAYS_AHEAD = 7

# (table, its index on (<column>, id)): the two history tables that grow with every request.
_PARTITIONED = (
    ("sku_history", "ix_sku_history_sku_id", "sku"),
    ("task_attempts", "ix_task_attempts_key_id", "key"),
)

_PG_APPEND_ONLY = """
    CREATE TRIGGER sku_history_append_only BEFORE UPDATE OR DELETE ON sku_history
    FOR EACH ROW EXECUTE FUNCTION sku_history_append_only()
    """

# A row may go once a checkpoint of its SKU covers it, by time and by id (a row written into the same
# day after the archive is not covered): the checkpoint then explains the stock in its place.
_SQLITE_DELETE_ARCHIVED_ONLY = """
    CREATE TRIGGER sku_history_no_delete BEFORE DELETE ON sku_history
    WHEN NOT EXISTS (SELECT 1 FROM sku_checkpoints
                     WHERE sku = OLD.sku AND through_ms > OLD.at_ms AND last_id >= OLD.id)
    BEGIN SELECT RAISE(ABORT, 'sku_history is append-only'); END
    """
_SQLITE_NO_UPDATE = """
    CREATE TRIGGER sku_history_no_update BEFORE UPDATE ON sku_history
    BEGIN SELECT RAISE(ABORT, 'sku_history is append-only'); END
    """
_SQLITE_NO_DELETE = """
    CREATE TRIGGER sku_history_no_delete BEFORE DELETE ON sku_history
    BEGIN SELECT RAISE(ABORT, 'sku_history is append-only'); END
    """


def _day_of(ms: int) -> date:
    return datetime.fromtimestamp(ms / 1000, UTC).date()


def _day_ms(day: date) -> int:
    return int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()) * 1000


def _partition_ddl(table: str, day: date) -> str:
    # Names and bounds come from a date, never from input.
    return (
        f'CREATE TABLE "{table}_p{day:%Y%m%d}" PARTITION OF "{table}" '
        f"FOR VALUES FROM ({_day_ms(day)}) TO ({_day_ms(day + timedelta(days=1))})"
    )


def _partition(table: str, index: str, column: str) -> None:
    bind = op.get_bind()
    aside = f"{table}_0009"
    op.execute(f'ALTER TABLE "{table}" RENAME TO "{aside}"')
    op.execute(f'ALTER TABLE "{aside}" RENAME CONSTRAINT "{table}_pkey" TO "{aside}_pkey"')
    op.execute(f'ALTER INDEX "{index}" RENAME TO "{index}_0009"')
    op.execute(f'CREATE TABLE "{table}" (LIKE "{aside}" INCLUDING DEFAULTS) PARTITION BY RANGE (at_ms)')
    op.execute(f'CREATE TABLE "{table}_default" PARTITION OF "{table}" DEFAULT')
    now_ms, oldest_ms = bind.execute(
        sa.select(
            sa.cast(sa.extract("epoch", sa.func.statement_timestamp()) * 1000, sa.BigInteger),
            sa.select(sa.func.min(sa.column("at_ms"))).select_from(sa.table(aside)).scalar_subquery(),
        )
    ).one()
    today = _day_of(now_ms)
    day = min(today, _day_of(oldest_ms)) if oldest_ms is not None else today
    while day <= today + timedelta(days=DAYS_AHEAD):
        op.execute(_partition_ddl(table, day))
        day += timedelta(days=1)
    op.execute(f'INSERT INTO "{table}" SELECT * FROM "{aside}"')  # noqa: S608  (names of this module's)
    # After the copy: one index build per partition beats maintaining the index row by row.
    op.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{table}_pkey" PRIMARY KEY (id, at_ms)')
    op.execute(f'CREATE INDEX "{index}" ON "{table}" ({column}, id)')
    # The ids keep coming from the one sequence (unique across partitions, in insert order): it must
    # outlive the old table, which owned it.
    op.execute(f'ALTER SEQUENCE "{table}_id_seq" OWNED BY "{table}".id')
    op.execute(f'DROP TABLE "{aside}"')


def _unpartition(table: str, index: str, column: str) -> None:
    aside = f"{table}_0010"
    op.execute(f'ALTER TABLE "{table}" RENAME TO "{aside}"')
    op.execute(f'ALTER TABLE "{aside}" RENAME CONSTRAINT "{table}_pkey" TO "{aside}_pkey"')
    op.execute(f'ALTER INDEX "{index}" RENAME TO "{index}_0010"')
    op.execute(f'CREATE TABLE "{table}" (LIKE "{aside}" INCLUDING DEFAULTS)')
    op.execute(f'INSERT INTO "{table}" SELECT * FROM "{aside}"')  # noqa: S608  (names of this module's)
    op.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{table}_pkey" PRIMARY KEY (id)')
    op.execute(f'CREATE INDEX "{index}" ON "{table}" ({column}, id)')
    op.execute(f'ALTER SEQUENCE "{table}_id_seq" OWNED BY "{table}".id')
    op.execute(f'DROP TABLE "{aside}"')  # its partitions with it


def upgrade() -> None:
    op.create_table(
        "sku_checkpoints",
        sa.Column("sku", sa.String(64), primary_key=True),
        sa.Column("through_ms", sa.BigInteger, primary_key=True),
        sa.Column("on_hand", sa.BigInteger, nullable=False),
        sa.Column("reserved", sa.BigInteger, nullable=False),
        sa.Column("highest_token", sa.BigInteger, nullable=False),
        sa.Column("last_id", sa.BigInteger, nullable=False),
        sa.Column("archived_ms", sa.BigInteger, nullable=False),
        sa.Column("archive", sa.String(200), nullable=True),
    )
    if op.get_bind().dialect.name != "postgresql":
        # AUTOINCREMENT: SQLite otherwise gives a new row the largest id left plus one, so once archived
        # rows are deleted an id would come again (naming two rows, or going back behind a checkpoint).
        for table in ("sku_history", "task_attempts"):
            with op.batch_alter_table(
                table, recreate="always", table_kwargs={"sqlite_autoincrement": True}
            ) as batch:
                batch.alter_column("id", existing_type=sa.Integer, autoincrement=True)
        op.execute(_SQLITE_NO_UPDATE)  # the copy dropped the old table's triggers
        op.execute(_SQLITE_DELETE_ARCHIVED_ONLY)
        return
    for table, index, column in _PARTITIONED:
        _partition(table, index, column)
    op.execute(_PG_APPEND_ONLY)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        op.execute("DROP TRIGGER sku_history_no_delete")
        op.execute(_SQLITE_NO_DELETE)
    else:
        for table, index, column in _PARTITIONED:
            _unpartition(table, index, column)
        op.execute(_PG_APPEND_ONLY)
    op.drop_table("sku_checkpoints")
