"""The inventory tables, as the code reads and writes them (the Alembic migrations in
``reservations/migrations`` create them). Times are database-clock milliseconds since the epoch.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlmodel import Field, SQLModel

from fencing.fence import FENCE_LEASE_COLUMN, FENCE_TOKEN_COLUMN
from reservations.statuses import ReservationStatus

HELD, CONFIRMED, RELEASED, EXPIRED = tuple(ReservationStatus)
RESERVATION_STATUSES = tuple(ReservationStatus)


def _bigint(nullable: bool = False, **kwargs: Any) -> sa.Column[int]:
    return sa.Column(sa.BigInteger, nullable=nullable, **kwargs)


def _row_id() -> sa.Column[int]:
    """An id numbered by the database in insert order (an INTEGER primary key on SQLite)."""
    return sa.Column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True)


def _table(model: type[SQLModel]) -> sa.Table:
    """The model's Core table, which the hot path's statements use (SQLModel leaves ``__table__``
    untyped)."""
    table = sa.inspect(model).local_table
    if not isinstance(table, sa.Table):
        raise TypeError(f"{model.__name__} is not mapped to a table")
    return table


class Stock(SQLModel, table=True):
    """One row per SKU; the row every stock change is fenced on. ``available`` is stored, not derived, so
    the fenced UPDATE can test it in its own WHERE clause; the CHECK keeps it equal to ``on_hand -
    reserved``."""

    __tablename__ = "stock"
    __table_args__ = (
        sa.CheckConstraint("available >= 0", name="ck_stock_available_nonnegative"),
        sa.CheckConstraint("reserved >= 0", name="ck_stock_reserved_nonnegative"),
        sa.CheckConstraint("on_hand = available + reserved", name="ck_stock_conservation"),
    )

    sku: str = Field(primary_key=True, max_length=64)
    # No database default: every insert states the three counts (revision 0001 created them without one).
    on_hand: int = Field(default=0, sa_column=_bigint())
    reserved: int = Field(default=0, sa_column=_bigint())
    available: int = Field(default=0, sa_column=_bigint())
    fence_token: int = Field(
        default=0, sa_column=sa.Column(FENCE_TOKEN_COLUMN, sa.BigInteger, nullable=False, server_default="0")
    )
    fence_lease_id: str | None = Field(
        default=None, sa_column=sa.Column(FENCE_LEASE_COLUMN, sa.String(32), nullable=True)
    )
    updated_ms: int = Field(default=0, sa_column=_bigint(server_default="0"))
    # Maintained by a trigger on reservations (never written by the code): the units of the SKU's held
    # reservations, which the trigger keeps equal to ``reserved``.
    held_units: int = Field(default=0, sa_column=_bigint(server_default="0"))


class Reservation(SQLModel, table=True):
    """Units set aside for one request. ``held`` is the only status that counts in ``stock.reserved``;
    the final statuses never change again (a trigger refuses it)."""

    __tablename__ = "reservations"
    __table_args__ = (
        sa.CheckConstraint("quantity > 0", name="ck_reservations_quantity_positive"),
        sa.CheckConstraint(
            "status IN ('held', 'confirmed', 'released', 'expired')", name="ck_reservations_status"
        ),
        sa.Index("ix_reservations_sku_status", "sku", "status"),
        sa.Index("ix_reservations_status_hold", "status", "hold_expires_ms"),
    )

    id: str = Field(primary_key=True, max_length=34)
    sku: str = Field(foreign_key="stock.sku", max_length=64)
    quantity: int = Field(sa_column=_bigint())
    status: str = Field(default=HELD, max_length=16)
    hold_expires_ms: int | None = Field(default=None, sa_column=_bigint(nullable=True))
    # The request's key; an order's lines use "<order key> <sku>" (a space never occurs in a key).
    idempotency_key: str = Field(max_length=300, unique=True)
    order_key: str | None = Field(default=None, max_length=200, index=True)
    token: int = Field(sa_column=_bigint())
    lease_id: str = Field(max_length=32)
    created_ms: int = Field(sa_column=_bigint())
    final_ms: int | None = Field(default=None, sa_column=_bigint(nullable=True))
    final_token: int | None = Field(default=None, sa_column=_bigint(nullable=True))
    final_key: str | None = Field(default=None, max_length=200)


class IdempotencyRecord(SQLModel, table=True):
    """A request's key, its fingerprint and its stored outcome, committed with the stock change."""

    __tablename__ = "idempotency_keys"

    key: str = Field(primary_key=True, max_length=200)
    fingerprint: str = Field(max_length=64)
    operation: str = Field(max_length=32)
    outcome: str  # JSON
    token: int | None = Field(default=None, sa_column=_bigint(nullable=True))
    created_ms: int = Field(sa_column=_bigint(index=True))


class SkuHistory(SQLModel, table=True):
    """Append-only: every accepted stock change (with its deltas) and every refused stale write.

    On PostgreSQL partitioned per UTC day (reservations.archive), its primary key ``(id, at_ms)`` as
    partitioning requires; ``id`` still comes from one sequence, so it stays unique and in insert order
    across partitions, and the code keeps ordering and naming entries by it."""

    __tablename__ = "sku_history"
    # SQLite: AUTOINCREMENT, so an id never comes again once archived rows are deleted (revision 0010).
    __table_args__ = (sa.Index("ix_sku_history_sku_id", "sku", "id"), {"sqlite_autoincrement": True})

    id: int | None = Field(default=None, sa_column=_row_id())
    sku: str = Field(max_length=64)
    at_ms: int = Field(sa_column=_bigint())
    kind: str = Field(max_length=16)  # "write" or "rejected"
    operation: str = Field(max_length=32)
    token: int = Field(sa_column=_bigint())
    lease_id: str | None = Field(default=None, max_length=32)
    holder: str | None = Field(default=None, max_length=200)
    quantity: int | None = Field(default=None, sa_column=_bigint(nullable=True))
    idempotency_key: str | None = Field(default=None, max_length=200)
    reservation_id: str | None = Field(default=None, max_length=34)
    on_hand_delta: int = Field(default=0, sa_column=_bigint())
    reserved_delta: int = Field(default=0, sa_column=_bigint())
    highest_token: int | None = Field(default=None, sa_column=_bigint(nullable=True))
    detail: str | None = None


stock = _table(Stock)
reservations = _table(Reservation)
idempotency_keys = _table(IdempotencyRecord)
sku_history = _table(SkuHistory)


class RequestOutcome(SQLModel, table=True):
    """The one final outcome of a request, by its idempotency key: written once, never changed."""

    __tablename__ = "request_outcomes"

    key: str = Field(primary_key=True, max_length=200)
    operation: str = Field(max_length=32)
    status: str = Field(max_length=32)  # reserved, confirmed, released, restocked, insufficient_stock, ...
    detail: str  # JSON
    task_id: str | None = Field(default=None, max_length=64)
    worker: str | None = Field(default=None, max_length=200)
    epochs: int = 0
    at_ms: int = Field(sa_column=_bigint())
    # The fingerprint of the request that produced this outcome (as in the idempotency records): a
    # request that names the same key with different arguments is a conflict, not this outcome's owner.
    fingerprint: str | None = Field(default=None, max_length=64)


class TaskAttempt(SQLModel, table=True):
    """One attempt at a request: applied, replayed, lost ownership, busy, transient failure, ...

    Partitioned like ``sku_history`` on PostgreSQL (revision 0010), by ``at_ms``, per UTC day."""

    __tablename__ = "task_attempts"
    __table_args__ = (sa.Index("ix_task_attempts_key_id", "key", "id"), {"sqlite_autoincrement": True})

    id: int | None = Field(default=None, sa_column=_row_id())
    key: str = Field(max_length=200)
    operation: str = Field(max_length=32)
    task_id: str | None = Field(default=None, max_length=64)
    worker: str | None = Field(default=None, max_length=200)
    token: int | None = Field(default=None, sa_column=_bigint(nullable=True))
    result: str = Field(max_length=32)
    detail: str | None = None
    at_ms: int = Field(sa_column=_bigint())


request_outcomes = _table(RequestOutcome)
task_attempts = _table(TaskAttempt)


class SkuCheckpoint(SQLModel, table=True):
    """A SKU's stock as its history explained it up to ``through_ms`` (exclusive), written as that history
    left for the archive (reservations.archive). Never changed."""

    __tablename__ = "sku_checkpoints"

    sku: str = Field(primary_key=True, max_length=64)
    through_ms: int = Field(sa_column=sa.Column(sa.BigInteger, primary_key=True))
    on_hand: int = Field(sa_column=_bigint())
    reserved: int = Field(sa_column=_bigint())
    # The highest token an accepted write carried (0: none but the creation), and the newest history row
    # of the SKU that left (SQLite's append-only trigger lets only rows up to it go).
    highest_token: int = Field(sa_column=_bigint())
    last_id: int = Field(sa_column=_bigint())
    archived_ms: int = Field(sa_column=_bigint())
    archive: str | None = Field(default=None, max_length=200)  # the archive file's name


sku_checkpoints = _table(SkuCheckpoint)


class PendingReservation(SQLModel, table=True):
    """A reservation that found its SKU's lease busy, waiting for the holder (reservations.pending)."""

    __tablename__ = "pending_reservations"
    __table_args__ = (
        sa.CheckConstraint("quantity > 0", name="ck_pending_reservations_quantity_positive"),
        sa.Index("ix_pending_reservations_sku_id", "sku", "id"),
    )

    id: int | None = Field(default=None, sa_column=_row_id())
    key: str = Field(max_length=200, unique=True)
    sku: str = Field(max_length=64)
    quantity: int = Field(sa_column=_bigint())
    hold_ms: int | None = Field(default=None, sa_column=_bigint(nullable=True))
    task_id: str | None = Field(default=None, max_length=64)
    epochs: int = 0
    enqueued_ms: int = Field(sa_column=_bigint())


pending_reservations = _table(PendingReservation)


# One row, rewritten by every migration run: the schema's revision and the oldest code revision that still
# runs on it (reservations.schema).
schema_compatibility = sa.Table(
    "schema_compatibility",
    SQLModel.metadata,
    sa.Column("revision", sa.Text, primary_key=True),
    sa.Column("oldest_code", sa.Text, nullable=False),
)


class RequestRedrive(SQLModel, table=True):
    """The link from a dead-lettered request's key (``origin_key``) to its re-drive (reservations.redrives),
    numbered per origin: a second claim of the same number is refused by the key."""

    __tablename__ = "request_redrives"
    __table_args__ = (sa.UniqueConstraint("origin_key", "number", name="uq_request_redrives_origin_number"),)

    redrive_key: str = Field(primary_key=True, max_length=200)
    origin_key: str = Field(max_length=200)
    number: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    operation: str = Field(max_length=32)
    at_ms: int = Field(sa_column=_bigint())
    # Who asked for it (the operator's user and host, as the command line gives it).
    by: str | None = Field(default=None, max_length=200)


request_redrives = _table(RequestRedrive)


class AcceptedRequest(SQLModel, table=True):
    """A request as a producer recorded it before publishing (reservations.acceptance), once per key. The
    relay publishes it again when ``next_look_ms`` comes without an outcome (NULL: nothing to look at)."""

    __tablename__ = "accepted_requests"
    __table_args__ = (
        sa.Index("ix_accepted_requests_at_ms", "at_ms"),
        sa.Index("ix_accepted_requests_next_look_ms", "next_look_ms"),
    )

    key: str = Field(primary_key=True, max_length=200)
    operation: str = Field(max_length=32)
    fingerprint: str = Field(max_length=64)
    at_ms: int = Field(sa_column=_bigint())
    deadline_ms: int | None = Field(default=None, sa_column=_bigint(nullable=True))
    # The caller's space: an HTTP caller's name ("*" for an anonymous one); NULL for the operator's
    # space (the library client, the command line, re-drives).
    caller: str | None = Field(default=None, max_length=64)
    request_type: str | None = Field(default=None, max_length=32)
    arguments: str | None = None  # JSON, as published
    task_id: str | None = Field(default=None, max_length=64)
    message_format: int | None = None
    publishes: int = Field(default=0, sa_column=sa.Column(sa.Integer, nullable=False, server_default="0"))
    next_look_ms: int | None = Field(default=None, sa_column=_bigint(nullable=True))


accepted_requests = _table(AcceptedRequest)


class OperatorAction(SQLModel, table=True):
    """What an operator did by hand (reservations.actions): a re-drive, a republish, a lease broken, a
    request cancelled; who did it, when, on what and why. Written after the action took effect, never
    changed."""

    __tablename__ = "operator_actions"
    __table_args__ = (
        sa.Index("ix_operator_actions_at_ms", "at_ms"),
        sa.Index("ix_operator_actions_target", "target"),
    )

    id: int | None = Field(default=None, sa_column=_row_id())
    at_ms: int = Field(sa_column=_bigint())
    action: str = Field(max_length=32)
    target: str = Field(max_length=200)  # a request's key, or a SKU
    by: str = Field(max_length=200)
    reason: str = Field(max_length=500)
    detail: str | None = None  # JSON: what the action found and did


operator_actions = _table(OperatorAction)
