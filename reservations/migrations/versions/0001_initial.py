"""Initial schema: SQL lease backend, stock with fence columns, reservations, idempotency, history,
and the triggers that hold the fence and the reservation lifecycle in the database itself.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _id_column() -> sa.Column[int]:
    return sa.Column(
        "id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True
    )


# A trigger, not only the guard, keeps the fence from moving backwards: a future code path that forgets
# the guard still cannot lower a row's highest accepted token.
_PG_TRIGGERS = [
    """
    CREATE FUNCTION stock_fence_never_lowers() RETURNS trigger AS $$
    BEGIN
      IF NEW.fence_token < OLD.fence_token THEN
        RAISE EXCEPTION 'fence token of SKU % would go back from % to %',
          OLD.sku, OLD.fence_token, NEW.fence_token USING ERRCODE = 'check_violation';
      END IF;
      RETURN NEW;
    END $$ LANGUAGE plpgsql
    """,
    """
    CREATE TRIGGER stock_fence_never_lowers BEFORE UPDATE ON stock
    FOR EACH ROW EXECUTE FUNCTION stock_fence_never_lowers()
    """,
    """
    CREATE FUNCTION reservation_lifecycle() RETURNS trigger AS $$
    BEGIN
      IF OLD.status <> 'held' THEN
        RAISE EXCEPTION 'reservation % is final (%)', OLD.id, OLD.status USING ERRCODE = 'check_violation';
      END IF;
      IF NEW.sku <> OLD.sku OR NEW.quantity <> OLD.quantity THEN
        RAISE EXCEPTION 'reservation % cannot change SKU or quantity', OLD.id
          USING ERRCODE = 'check_violation';
      END IF;
      RETURN NEW;
    END $$ LANGUAGE plpgsql
    """,
    """
    CREATE TRIGGER reservation_lifecycle BEFORE UPDATE ON reservations
    FOR EACH ROW EXECUTE FUNCTION reservation_lifecycle()
    """,
    # Units are counted once: after any reservation change, the SKU's reserved units equal the sum of
    # its held reservations. Stock changes first in every operation, so this holds at each check.
    """
    CREATE FUNCTION reservation_units_counted_once() RETURNS trigger AS $$
    DECLARE held_units bigint; stock_reserved bigint;
    BEGIN
      SELECT COALESCE(SUM(quantity), 0) INTO held_units FROM reservations
        WHERE sku = NEW.sku AND status = 'held';
      SELECT reserved INTO stock_reserved FROM stock WHERE sku = NEW.sku;
      IF held_units <> stock_reserved THEN
        RAISE EXCEPTION 'SKU %: reserved % but held reservations total %', NEW.sku, stock_reserved,
          held_units USING ERRCODE = 'check_violation';
      END IF;
      RETURN NULL;
    END $$ LANGUAGE plpgsql
    """,
    """
    CREATE TRIGGER reservation_units_counted_once AFTER INSERT OR UPDATE ON reservations
    FOR EACH ROW EXECUTE FUNCTION reservation_units_counted_once()
    """,
    """
    CREATE FUNCTION sku_history_append_only() RETURNS trigger AS $$
    BEGIN
      RAISE EXCEPTION 'sku_history is append-only' USING ERRCODE = 'check_violation';
    END $$ LANGUAGE plpgsql
    """,
    """
    CREATE TRIGGER sku_history_append_only BEFORE UPDATE OR DELETE ON sku_history
    FOR EACH ROW EXECUTE FUNCTION sku_history_append_only()
    """,
]

_SQLITE_TRIGGERS = [
    """
    CREATE TRIGGER stock_fence_never_lowers BEFORE UPDATE OF fence_token ON stock
    WHEN NEW.fence_token < OLD.fence_token
    BEGIN SELECT RAISE(ABORT, 'fence token would go back'); END
    """,
    """
    CREATE TRIGGER reservation_lifecycle BEFORE UPDATE ON reservations
    WHEN OLD.status <> 'held' OR NEW.sku <> OLD.sku OR NEW.quantity <> OLD.quantity
    BEGIN SELECT RAISE(ABORT, 'reservation is final or would change SKU or quantity'); END
    """,
    """
    CREATE TRIGGER reservation_units_counted_once_insert AFTER INSERT ON reservations
    WHEN (SELECT reserved FROM stock WHERE sku = NEW.sku) <>
         (SELECT COALESCE(SUM(quantity), 0) FROM reservations WHERE sku = NEW.sku AND status = 'held')
    BEGIN SELECT RAISE(ABORT, 'reserved units differ from held reservations'); END
    """,
    """
    CREATE TRIGGER reservation_units_counted_once_update AFTER UPDATE ON reservations
    WHEN (SELECT reserved FROM stock WHERE sku = NEW.sku) <>
         (SELECT COALESCE(SUM(quantity), 0) FROM reservations WHERE sku = NEW.sku AND status = 'held')
    BEGIN SELECT RAISE(ABORT, 'reserved units differ from held reservations'); END
    """,
    """
    CREATE TRIGGER sku_history_no_update BEFORE UPDATE ON sku_history
    BEGIN SELECT RAISE(ABORT, 'sku_history is append-only'); END
    """,
    """
    CREATE TRIGGER sku_history_no_delete BEFORE DELETE ON sku_history
    BEGIN SELECT RAISE(ABORT, 'sku_history is append-only'); END
    """,
]


def upgrade() -> None:
    op.create_table(
        "fencing_leases",
        sa.Column("scope", sa.String(200), primary_key=True),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("lease_id", sa.String(32)),
        sa.Column("holder", sa.String(200)),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("acquired_ms", sa.BigInteger),
        sa.Column("expires_ms", sa.BigInteger, nullable=False),
        sa.Column("previous_end", sa.String(16)),
        sa.CheckConstraint("token >= 0", name="ck_fencing_leases_token"),
    )
    op.create_table(
        "fencing_lease_events",
        _id_column(),
        sa.Column("scope", sa.String(200), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("lease_id", sa.String(32)),
        sa.Column("holder", sa.String(200)),
        sa.Column("at_ms", sa.BigInteger, nullable=False),
        sa.Column("previous_token", sa.BigInteger),
        sa.Column("previous_end", sa.String(16)),
        sa.Column("detail", sa.Text),
    )
    op.create_index("ix_fencing_lease_events_scope_id", "fencing_lease_events", ["scope", "id"])

    op.create_table(
        "stock",
        sa.Column("sku", sa.String(64), primary_key=True),
        sa.Column("on_hand", sa.Integer, nullable=False),
        sa.Column("reserved", sa.Integer, nullable=False),
        sa.Column("available", sa.Integer, nullable=False),
        sa.Column("fence_token", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("fence_lease_id", sa.String(32)),
        sa.Column("updated_ms", sa.BigInteger, nullable=False, server_default="0"),
        sa.CheckConstraint("available >= 0", name="ck_stock_available_nonnegative"),
        sa.CheckConstraint("reserved >= 0", name="ck_stock_reserved_nonnegative"),
        sa.CheckConstraint("on_hand = available + reserved", name="ck_stock_conservation"),
    )
    op.create_table(
        "reservations",
        sa.Column("id", sa.String(34), primary_key=True),
        sa.Column("sku", sa.String(64), sa.ForeignKey("stock.sku"), nullable=False),
        sa.Column("quantity", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("hold_expires_ms", sa.BigInteger),
        sa.Column("idempotency_key", sa.String(300), nullable=False, unique=True),
        sa.Column("order_key", sa.String(200)),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("lease_id", sa.String(32), nullable=False),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("final_ms", sa.BigInteger),
        sa.Column("final_token", sa.BigInteger),
        sa.Column("final_key", sa.String(200)),
        sa.CheckConstraint("quantity > 0", name="ck_reservations_quantity_positive"),
        sa.CheckConstraint(
            "status IN ('held', 'confirmed', 'released', 'expired')", name="ck_reservations_status"
        ),
    )
    op.create_index("ix_reservations_sku_status", "reservations", ["sku", "status"])
    op.create_index("ix_reservations_status_hold", "reservations", ["status", "hold_expires_ms"])
    op.create_index("ix_reservations_order_key", "reservations", ["order_key"])
    op.create_table(
        "idempotency_keys",
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("operation", sa.String(32), nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("token", sa.BigInteger),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_idempotency_keys_created_ms", "idempotency_keys", ["created_ms"])
    op.create_table(
        "sku_history",
        _id_column(),
        sa.Column("sku", sa.String(64), nullable=False),
        sa.Column("at_ms", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("operation", sa.String(32), nullable=False),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("lease_id", sa.String(32)),
        sa.Column("holder", sa.String(200)),
        sa.Column("quantity", sa.Integer),
        sa.Column("idempotency_key", sa.String(200)),
        sa.Column("reservation_id", sa.String(34)),
        sa.Column("on_hand_delta", sa.Integer, nullable=False),
        sa.Column("reserved_delta", sa.Integer, nullable=False),
        sa.Column("highest_token", sa.BigInteger),
        sa.Column("detail", sa.Text),
    )
    op.create_index("ix_sku_history_sku_id", "sku_history", ["sku", "id"])

    triggers = _PG_TRIGGERS if op.get_bind().dialect.name == "postgresql" else _SQLITE_TRIGGERS
    for statement in triggers:
        op.execute(statement)


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        for function in (
            "stock_fence_never_lowers",
            "reservation_lifecycle",
            "reservation_units_counted_once",
            "sku_history_append_only",
        ):
            op.execute(f"DROP FUNCTION IF EXISTS {function}() CASCADE")
    for table in (
        "sku_history",
        "idempotency_keys",
        "reservations",
        "stock",
        "fencing_lease_events",
        "fencing_leases",
    ):
        op.drop_table(table)
