"""``reservations tokens`` accounts for every token a SKU issued, on SQLite and PostgreSQL: a holder that
wrote nothing (a reservation short of units writes only its request's outcome) shows with that outcome,
found by the task its holder names; with leases on Redis, which keeps a SKU's last 4 epochs, the tokens
neither the history nor the lease log records are counted, beside the SKU's outcomes that carry no token.
"""

from __future__ import annotations

import json
from typing import Any

from fencing import LeaseManager
from reservations import Inventory, scope_of
from testing.stores import REDIS_URL
from testing.support import run

WORKER = "host-w:4242"


def _serve(inventory: Inventory, leases: LeaseManager) -> None:
    """Ten tokens of HOT (2 on hand): two reservations, six answered insufficient_stock, and two leases
    of the expiry sweep that found nothing to do."""
    inventory.add_sku("HOT", on_hand=2)
    for n in range(8):
        task = f"task-{n}"
        lease = leases.acquire(scope_of("HOT"), ttl=30, holder=f"{WORKER}:{task}")
        inventory.reserve_request(lease, "HOT", 1, key=f"order-{n}", task_id=task, worker=WORKER)
        leases.release(lease)
    for _ in range(2):
        leases.release(leases.acquire(scope_of("HOT"), ttl=30, holder=f"{WORKER}:expiry"))


def _tokens(env: dict[str, str]) -> dict[str, Any]:
    done = run("tokens", "HOT", "--json", env=env)
    assert done.returncode == 0, done.stderr
    shown: dict[str, Any] = json.loads(done.stdout)
    return shown


def test_a_holder_that_wrote_nothing_shows_its_requests_outcome(
    inventory: Inventory, leases: LeaseManager, inventory_url: str
) -> None:
    _serve(inventory, leases)  # the lease history on the database keeps every epoch
    env = {"RESERVATIONS_DATABASE_URL": inventory_url}
    shown = _tokens(env)
    by_token = {e["token"]: e for e in shown["epochs"]}
    assert sorted(by_token) == list(range(1, 11))
    assert [by_token[t]["outcome"]["status"] for t in range(1, 9)] == ["reserved"] * 2 + [
        "insufficient_stock"
    ] * 6
    assert by_token[5]["outcome"]["key"] == "order-4" and by_token[5]["outcome"]["worker"] == WORKER
    assert by_token[9]["outcome"] is None and by_token[9]["writes"] == []
    assert shown["issued"] == {
        "highest_token": 10,
        "after_token": 0,
        "with_records": 2,
        "lease_history_only": 8,
        "without_records": 0,
    }
    assert shown["tokenless_outcomes"] == []  # each is its token's, shown in the epoch

    table = run("tokens", "HOT", env=env, columns=120).stdout
    assert "= insufficient_stock (order-4)" in table and "host-w:4242" in table
    assert (
        "10 token(s) issued up to 10: 2 wrote or were refused, 8 known to the lease history alone, 0" in table
    )


def test_tokens_the_lease_log_dropped_are_counted_with_the_outcomes_that_carry_none(
    inventory: Inventory, inventory_url: str, redis_prefix: str
) -> None:
    with LeaseManager.from_url(REDIS_URL, prefix=redis_prefix) as leases:  # keeps the last 4 epochs
        _serve(inventory, leases)
    env = {
        "RESERVATIONS_DATABASE_URL": inventory_url,
        "RESERVATIONS_LEASE_URL": REDIS_URL,
        "RESERVATIONS_LEASE_PREFIX": redis_prefix,
    }
    shown = _tokens(env)
    # The log's oldest epoch (7) records how the one before it ended: token 6 shows, without a holder.
    assert [e["token"] for e in shown["epochs"]] == [1, 2, 6, 7, 8, 9, 10]
    assert shown["epochs"][2]["holder"] is None and shown["epochs"][2]["outcome"] is None
    assert [e["outcome"]["status"] for e in shown["epochs"][3:5]] == ["insufficient_stock"] * 2
    assert shown["issued"] == {
        "highest_token": 10,
        "after_token": 0,
        "with_records": 2,
        "lease_history_only": 5,
        "without_records": 3,
    }
    assert [o["key"] for o in shown["tokenless_outcomes"]] == ["order-2", "order-3", "order-4", "order-5"]
    assert {o["status"] for o in shown["tokenless_outcomes"]} == {"insufficient_stock"}

    line = " ".join(run("tokens", "HOT", env=env, columns=200).stdout.split())
    assert (
        "10 token(s) issued up to 10: 2 wrote or were refused, 5 known to the lease history alone, 3 issued"
        " without reaching the database; request outcomes of the SKU recorded without a token: 4"
        " insufficient_stock"
    ) in line


def test_the_outcomes_without_a_token_are_the_newest_limit(
    inventory: Inventory, leases: LeaseManager
) -> None:
    _serve(inventory, leases)
    every = inventory.outcomes_for_tokens("HOT", [])
    assert sorted(o.key for o in every) == [f"order-{n}" for n in range(2, 8)]  # the short ones only
    newest = inventory.outcomes_for_tokens("HOT", [], limit=2)
    assert len(newest) == 2 and min(o.at for o in newest) >= max(o.at for o in every if o not in newest)
    # A holder's task is found whatever the limit: order-0 reserved under task-0's lease.
    found = inventory.outcomes_for_tokens("HOT", ["task-0"], limit=1)
    assert "order-0" in [o.key for o in found] and len(found) == 2
