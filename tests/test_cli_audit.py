"""``reservations audit``: the inventory's invariant check from the command line, on SQLite and PostgreSQL.
A consistent inventory exits 0; a history row the schema allows but the stock does not explain, an
accepted write behind an earlier token, or a replenishment that ordered past its par, is listed (rule,
SKU, message) and exits 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from fencing import LeaseManager
from fencing.engines import make_engine
from reservations import Inventory, audit, scope_of
from testing.support import cli, run


@pytest.fixture
def env(inventory: Inventory, leases: LeaseManager, inventory_url: str) -> dict[str, str]:
    """WIDGET (10 on hand, 2 reserved under a lease token) and GADGET (5 on hand), written through the
    inventory, so every invariant holds."""
    inventory.add_sku("WIDGET", on_hand=10)
    inventory.add_sku("GADGET", on_hand=5)
    lease = leases.acquire(scope_of("WIDGET"), ttl=30, holder="host-a:101:task-a")
    inventory.reserve(lease, "WIDGET", 2, key="order-1")
    return {"RESERVATIONS_DATABASE_URL": inventory_url}


@pytest.fixture
def engine(inventory_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(inventory_url)
    yield engine
    engine.dispose()


def _append_history(engine: sa.Engine, sku: str, token: int, on_hand_delta: int) -> None:
    """An accepted write appended to the history behind the inventory's back: the history is append-only
    and has no constraint tying it to the stock, so only the audit can notice."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO sku_history (sku, at_ms, kind, operation, token, quantity, idempotency_key,"
                " on_hand_delta, reserved_delta)"
                " VALUES (:sku, 1, 'write', 'restock', :token, :delta, 'ghost-restock', :delta, 0)"
            ),
            {"sku": sku, "token": token, "delta": on_hand_delta},
        )


def test_a_consistent_inventory_exits_0(env: dict[str, str]) -> None:
    done = run("audit", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "consistent: every invariant holds" in done.stdout
    done = run("audit", "--sku", "WIDGET", "--json", env=env)
    assert (done.returncode, json.loads(done.stdout)) == (0, [])


def test_history_that_does_not_explain_the_stock_exits_1(env: dict[str, str], engine: sa.Engine) -> None:
    _append_history(engine, "GADGET", token=0, on_hand_delta=7)
    done = run("audit", "--json", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert json.loads(done.stdout) == [
        {"rule": "conservation", "sku": "GADGET", "message": "history explains (12, 0) not (5, 0)"}
    ]
    # The installed script, as an operator runs it: a table within 80 columns, then exit 1.
    done = cli("audit", env=env, columns=80)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "conservation" in done.stdout and "GADGET" in done.stdout
    assert "1 invariant violation(s)" in done.stdout and done.stderr == ""
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    # Another SKU's violation does not fail the check of WIDGET.
    assert run("audit", "--sku", "WIDGET", env=env).returncode == 0


def test_a_write_accepted_behind_an_earlier_token_exits_1(env: dict[str, str], engine: sa.Engine) -> None:
    _append_history(engine, "WIDGET", token=0, on_hand_delta=0)
    done = run("audit", "--sku", "WIDGET", "--json", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert [(v["rule"], v["sku"]) for v in json.loads(done.stdout)] == [("token_order", "WIDGET")]


def test_a_replenishment_past_par_exits_1(
    env: dict[str, str], inventory: Inventory, leases: LeaseManager
) -> None:
    """The holder reads 5 on hand, books a delivery of 50 under the same lease, then replenishes to par 20
    from its read: 15 ordered on top of 55. The fence has nothing to refuse (one lease); the history row
    records the par and the on hand seen, and the audit replays what was on hand when it was written."""
    lease = leases.acquire(scope_of("GADGET"), ttl=30, holder="host-b:202:task-b")
    seen = inventory.look(lease, "GADGET")
    inventory.restock(lease, "GADGET", 50, key="delivery")
    inventory.replenish(lease, "GADGET", 20, key="par-20", seen=seen)
    done = run("audit", "--json", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert json.loads(done.stdout) == [
        {
            "rule": "past_par",
            "sku": "GADGET",
            "message": "replenish 'par-20' ordered 15 for par 20 having seen 5 on hand, leaving 70",
        }
    ]
    # Decided from a read of the level it writes on, a replenishment stays within par.
    inventory.replenish(lease, "GADGET", 80, key="par-80", seen=inventory.look(lease, "GADGET"))
    assert len(json.loads(run("audit", "--json", env=env).stdout)) == 1


@pytest.mark.parametrize("inventory_url", ["postgresql"], indirect=True)
def test_an_audit_reads_one_moment_while_a_worker_writes(
    env: dict[str, str], inventory: Inventory, leases: LeaseManager
) -> None:
    """A reservation committed between the audit's read of the stock and its read of the history is in
    neither: a live inventory audits consistent. (Only PostgreSQL lets a write land between the two reads;
    SQLite's transaction holds its write lock, so there the writer waits for the audit.)"""
    lease = leases.acquire(scope_of("GADGET"), ttl=30, holder="host-b:202:task-b")
    plan = audit.invariant_violations()
    with inventory.executor.unit() as handle:
        handle(next(plan))  # the snapshot, where the plan takes one
        levels = handle(plan.send(None))
        assert {r.sku for r in levels.rows} == {"WIDGET", "GADGET"}
        inventory.reserve(lease, "GADGET", 1, key="order-between")  # another connection, committed
        try:
            op = plan.send(levels)
            while True:
                op = plan.send(handle(op))
        except StopIteration as done:
            found = done.value
    assert found == []
    assert inventory.invariant_violations() == []  # and afterwards, with the reservation in both


def test_an_unknown_sku_is_exit_3(env: dict[str, str]) -> None:
    done = run("audit", "--sku", "NOPE", env=env)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "unknown SKU" in done.stderr
