"""Database errors reach the domain as typed errors, mapped once by constraint name: a taken key as
KeyTaken (naming which of the request's rows), a refused CHECK or trigger as ConstraintRefused (naming the
audit's rule where the constraint states one), a missing schema as SchemaMissing. Both databases.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from fencing import BackendUnavailable, SchemaMissing
from fencing.plan import Plan
from fencing.sql import Rows, db_now_ms
from reservations import Inventory
from reservations.audit import Rule
from reservations.errors import ConstraintRefused, KeyTaken
from reservations.models import idempotency_keys, request_outcomes, sku_history, stock


def _twice(statement: sa.Executable) -> Plan[None]:
    yield statement
    yield statement


def _one(statement: sa.Executable) -> Plan[None]:
    yield statement


def _rows(statement: sa.Executable) -> Plan[Rows]:
    found: Rows = yield statement
    return found


def _record(key: str) -> sa.Executable:
    return sa.insert(idempotency_keys).values(
        key=key, fingerprint="f", operation="reserve", outcome="{}", created_ms=db_now_ms()
    )


def test_a_taken_idempotency_key_is_key_taken_naming_the_record(inventory: Inventory) -> None:
    with pytest.raises(KeyTaken) as caught:
        inventory.executor.run(_twice(_record("k-1")))
    assert caught.value.where == "record"
    assert inventory.executor.run(_rows(sa.select(idempotency_keys.c.key))).rows == []  # rolled back


def test_a_taken_outcome_key_is_key_taken_naming_the_outcome(inventory: Inventory) -> None:
    row = sa.insert(request_outcomes).values(
        key="k-2", operation="reserve", status="invalid", detail="{}", epochs=0, at_ms=db_now_ms()
    )
    with pytest.raises(KeyTaken) as caught:
        inventory.executor.run(_twice(row))
    assert caught.value.where == "outcome"


def test_a_refused_check_names_its_constraint_and_rule(inventory: Inventory) -> None:
    inventory.add_sku("A", on_hand=2)
    below_zero = (
        sa.update(stock)
        .where(stock.c.sku == "A")
        .values(on_hand=stock.c.on_hand - 3, available=stock.c.available - 3)
    )
    with pytest.raises(ConstraintRefused) as caught:
        inventory.executor.run(_one(below_zero))
    assert caught.value.constraint == "ck_stock_available_nonnegative"
    assert caught.value.rule is Rule.OVERSELL
    assert inventory.stock("A").available == 2  # nothing written


def test_a_trigger_refusal_is_constraint_refused_without_a_rule(inventory: Inventory) -> None:
    inventory.add_sku("A", on_hand=2)
    with pytest.raises(ConstraintRefused) as caught:
        inventory.executor.run(_one(sa.delete(sku_history)))
    assert caught.value.rule is None
    assert "append-only" in caught.value.detail
    assert len(inventory.history("A")) == 1


@pytest.fixture(params=["sqlite", "postgresql"])
def unmigrated_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_url"))
    return f"sqlite:///{tmp_path / 'empty.sqlite3'}"


def test_a_database_without_the_schema_is_schema_missing(unmigrated_url: str) -> None:
    with Inventory.from_url(unmigrated_url) as inventory, pytest.raises(SchemaMissing) as caught:
        inventory.stock("A")
    assert caught.value.problem == "missing"
    # Still a kind of unavailability: a worker retries it while the upgrade runs.
    assert isinstance(caught.value, BackendUnavailable)


def test_an_inventory_built_on_its_own_executor_maps_errors_too(inventory_url: str) -> None:
    from fencing.engines import make_engine
    from fencing.sql import SyncSqlExecutor

    executor = SyncSqlExecutor(make_engine(inventory_url), lambda seconds: None)
    with Inventory(executor, url=inventory_url) as inventory, pytest.raises(KeyTaken):
        inventory.executor.run(_twice(_record("k-3")))
