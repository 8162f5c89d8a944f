"""PostgreSQL checks held units once per statement instead of once per reservation row, so a batch of a hot
SKU's requests can be held with one stock change for their total and one insert of their reservations
(reservations.batching) and still be refused unless the SKU's reserved units equal its held reservations.

Statement-level triggers read the statement's rows from transition tables; in a statement of several
parts (a data-modifying CTE) they fire once it has finished, when the stock change is in place. SQLite has
no statement-level triggers and keeps the per-row check: it holds a batch's requests one at a time.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# Each function moves every touched SKU's held-units count by the statement's change to held
# reservations, then refuses the statement if any of those SKUs counts differently from its reserved units.
_UPGRADE = [
    "DROP TRIGGER reservation_units_counted_once ON reservations",
    """
    CREATE FUNCTION reservation_units_added() RETURNS trigger AS $$
    DECLARE bad record;
    BEGIN
      UPDATE stock SET held_units = stock.held_units + moved.delta
        FROM (SELECT sku, SUM(quantity) AS delta FROM added WHERE status = 'held' GROUP BY sku) moved
        WHERE stock.sku = moved.sku;
      SELECT sku, reserved, held_units INTO bad FROM stock
        WHERE sku IN (SELECT sku FROM added) AND held_units <> reserved LIMIT 1;
      IF FOUND THEN
        RAISE EXCEPTION 'SKU %: reserved % but held reservations total %', bad.sku, bad.reserved,
          bad.held_units USING ERRCODE = 'check_violation';
      END IF;
      RETURN NULL;
    END $$ LANGUAGE plpgsql
    """,
    """
    CREATE FUNCTION reservation_units_changed() RETURNS trigger AS $$
    DECLARE bad record;
    BEGIN
      UPDATE stock SET held_units = stock.held_units + moved.delta
        FROM (
          SELECT sku, SUM(delta) AS delta FROM (
            SELECT sku, CASE WHEN status = 'held' THEN quantity ELSE 0 END AS delta FROM after_change
            UNION ALL
            SELECT sku, CASE WHEN status = 'held' THEN -quantity ELSE 0 END FROM before_change
          ) AS deltas GROUP BY sku
        ) moved
        WHERE stock.sku = moved.sku;
      SELECT sku, reserved, held_units INTO bad FROM stock
        WHERE sku IN (SELECT sku FROM after_change UNION SELECT sku FROM before_change)
          AND held_units <> reserved LIMIT 1;
      IF FOUND THEN
        RAISE EXCEPTION 'SKU %: reserved % but held reservations total %', bad.sku, bad.reserved,
          bad.held_units USING ERRCODE = 'check_violation';
      END IF;
      RETURN NULL;
    END $$ LANGUAGE plpgsql
    """,
    """
    CREATE TRIGGER reservation_units_added AFTER INSERT ON reservations
    REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION reservation_units_added()
    """,
    """
    CREATE TRIGGER reservation_units_changed AFTER UPDATE ON reservations
    REFERENCING OLD TABLE AS before_change NEW TABLE AS after_change
    FOR EACH STATEMENT EXECUTE FUNCTION reservation_units_changed()
    """,
]

# The per-row function of revision 0004 stays in place while unused, for this downgrade.
_DOWNGRADE = [
    "DROP TRIGGER reservation_units_changed ON reservations",
    "DROP TRIGGER reservation_units_added ON reservations",
    "DROP FUNCTION reservation_units_changed()",
    "DROP FUNCTION reservation_units_added()",
    """
    CREATE TRIGGER reservation_units_counted_once AFTER INSERT OR UPDATE ON reservations
    FOR EACH ROW EXECUTE FUNCTION reservation_units_counted_once()
    """,
]


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in _UPGRADE:
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in _DOWNGRADE:
            op.execute(statement)
