"""The later steps as one statement on PostgreSQL: a confirm, a release, a restock, a count and a
replenishment, alone or as a queued request with its attempt and outcome, cost one round trip in
autocommit, and decide exactly what the multi-statement plan decides (the reference, and SQLite's path):
the same answers, the same refusals, the same rows. Races: tests/test_one_statement_races.py.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fencing import LeaseManager
from reservations import Inventory, Outcome
from reservations.counting import StockSeen, short_count
from reservations.request_outcomes import RequestReply
from reservations.validation import MAX_ON_HAND
from testing.one_statement import BIG, GADGET, NOPE, UNKNOWN, WHO, WIDGET, lease_for, newer_epoch, rows
from testing.stores import own_pg_schema


def described(value: Any) -> Any:
    if isinstance(value, RequestReply):
        result = asdict(value.result)
        result.pop("at")
        return {"result": result, "outcome": described(value.outcome)}
    if isinstance(value, Outcome | StockSeen):
        seen = asdict(value)
        seen.pop("version", None)  # a history row id: the two databases number their rows apart
        return seen
    return value


def scenario(inv: Inventory, leases: LeaseManager) -> list[Any]:
    """Every later step, its replays and its refusals, alone and as requests, then a stale epoch's."""
    events: list[Any] = []

    def note(label: str, step: Callable[[], Any]) -> Any:
        try:
            value = step()
        except Exception as exc:  # the refusal is what is compared
            events.append([label, type(exc).__name__, str(exc), getattr(exc, "replayed", None)])
            return None
        events.append([label, described(value)])
        return value

    inv.add_sku(WIDGET, on_hand=10)
    inv.add_sku(GADGET, on_hand=5)
    inv.add_sku(BIG, on_hand=1)
    a, g = lease_for(leases, WIDGET, "w1"), lease_for(leases, GADGET, "w1")
    big, nope = lease_for(leases, BIG, "w1"), lease_for(leases, NOPE, "w1")
    held = [
        note(f"hold-{n}", lambda n=n: inv.reserve(a, WIDGET, 1, key=f"hold-{n}")) for n in (1, 2, 3, 4, 5)
    ]
    ids = [outcome.reservation_id for outcome in held]
    other = note("hold-g", lambda: inv.reserve(g, GADGET, 1, key="hold-g")).reservation_id
    # confirm and release, replayed, and each refusal
    note("confirm", lambda: inv.confirm(a, ids[0], key="confirm-1"))
    note("confirm again", lambda: inv.confirm(a, ids[0], key="confirm-1"))
    note("confirm confirmed", lambda: inv.confirm(a, ids[0], key="confirm-1b"))
    note("release", lambda: inv.release(a, ids[1], key="release-2"))
    note("release under a confirm's key", lambda: inv.release(a, ids[1], key="confirm-1"))
    note("confirm unknown", lambda: inv.confirm(a, UNKNOWN, key="confirm-x"))
    note("confirm another SKU's", lambda: inv.confirm(a, other, key="confirm-g"))
    # restock, count and replenish, replayed, and each refusal
    note("restock", lambda: inv.restock(a, WIDGET, 5, key="restock-1"))
    note("restock again", lambda: inv.restock(a, WIDGET, 5, key="restock-1"))
    note("count near the limit", lambda: inv.count(big, BIG, MAX_ON_HAND - 1, key="count-big"))
    note("restock past the limit", lambda: inv.restock(big, BIG, 2, key="restock-big"))
    note("restock unknown", lambda: inv.restock(nope, NOPE, 1, key="restock-nope"))
    seen = note("look", lambda: inv.look(a, WIDGET))
    note("count below held", lambda: inv.count(a, WIDGET, 1, key="count-low", seen=seen))
    note("count", lambda: inv.count(a, WIDGET, 30, key="count-1", seen=seen))
    note("count again", lambda: inv.count(a, WIDGET, 30, key="count-1", seen=seen))
    seen = note("look", lambda: inv.look(a, WIDGET))
    note(
        "count short",
        lambda: inv.count(a, WIDGET, short_count(seen, 2), key="count-2", seen=seen, shrinkage=2),
    )
    seen = note("look", lambda: inv.look(a, WIDGET))
    note("replenish", lambda: inv.replenish(a, WIDGET, 40, key="replenish-1", seen=seen))
    note("replenish again", lambda: inv.replenish(a, WIDGET, 40, key="replenish-1", seen=seen))
    seen = note("look", lambda: inv.look(a, WIDGET))
    note("replenish at par", lambda: inv.replenish(a, WIDGET, 10, key="replenish-0", seen=seen))
    # as queued requests: fresh, ended, a key whose outcome was never written, a refusal
    note("q confirm", lambda: inv.confirm_request(a, ids[2], key="q-confirm", **WHO))
    note("q confirm ended", lambda: inv.confirm_request(a, ids[2], key="q-confirm", **WHO))
    note("q release", lambda: inv.release_request(a, ids[3], key="q-release", **WHO))
    note("q restock", lambda: inv.restock_request(a, WIDGET, 3, key="q-restock", **WHO))
    note("q restock ended", lambda: inv.restock_request(a, WIDGET, 3, key="q-restock", **WHO))
    seen = note("look", lambda: inv.look(a, WIDGET))
    note("q count", lambda: inv.count_request(a, WIDGET, 50, key="q-count", **WHO, seen=seen))
    seen = note("look", lambda: inv.look(a, WIDGET))
    note("q replenish", lambda: inv.replenish_request(a, WIDGET, 60, key="q-replenish", **WHO, seen=seen))
    note("restock unrecorded", lambda: inv.restock(a, WIDGET, 1, key="q-late"))
    note("q restock replayed", lambda: inv.restock_request(a, WIDGET, 1, key="q-late", **WHO))
    note("q confirm unknown", lambda: inv.confirm_request(a, UNKNOWN, key="q-unknown", **WHO))
    note("q count below held", lambda: inv.count_request(a, WIDGET, 0, key="q-low", **WHO))
    # a newer epoch writes; the old one is refused, then known lost; the key still answers first
    b = newer_epoch(leases, a, "w2")
    note("restock newer", lambda: inv.restock(b, WIDGET, 1, key="restock-b"))
    note("confirm stale", lambda: inv.confirm(a, ids[4], key="confirm-stale"))
    note("confirm lost", lambda: inv.confirm(a, ids[4], key="confirm-lost"))
    note("restock lost, replayed", lambda: inv.restock(a, WIDGET, 5, key="restock-1"))
    note("q confirm lost, ended", lambda: inv.confirm_request(a, ids[2], key="q-confirm", **WHO))
    note("restock of another scope", lambda: inv.restock(b, GADGET, 1, key="mismatch"))
    note("count from another epoch's read", lambda: inv.count(b, WIDGET, 20, key="count-4", seen=seen))
    g2 = newer_epoch(leases, g, "w2")
    note("restock gadget newer", lambda: inv.restock(g2, GADGET, 1, key="restock-g2"))
    note("q release stale", lambda: inv.release_request(g, other, key="q-stale", **WHO))
    note("q restock stale", lambda: inv.restock_request(g, GADGET, 1, key="q-stale-2", **WHO))
    note("confirm newer", lambda: inv.confirm(b, ids[4], key="confirm-b"))
    return events


def relabelled(value: Any) -> Any:
    """``value`` with reservation ids, and the fingerprints of requests that name one, named by their
    order of first appearance (the ids are random)."""

    def named(text: str, pattern: str, prefix: str) -> str:
        names: dict[str, str] = {}
        return re.sub(pattern, lambda m: names.setdefault(m[0], f"{prefix}{len(names)}"), text)

    text = named(json.dumps(value, default=str), r"r_[0-9a-f]{32}", "r")
    return json.loads(named(text, r"\b[0-9a-f]{64}\b", "f"))


def run(url: str, *, single_statement: bool | None) -> Any:
    with (
        Inventory.from_url(url, single_statement=single_statement) as inv,
        LeaseManager.from_url(url) as leases,
    ):
        events = scenario(inv, leases)
    return relabelled({"events": events, "rows": rows(url)})


@pytest.fixture
def one_statement_run() -> Any:
    with own_pg_schema(migrated=True) as url:
        return run(url, single_statement=True)


@pytest.mark.parametrize("reference", ["sqlite", "postgresql"])
def test_one_statement_decides_as_the_reference_plan(
    reference: str, one_statement_run: Any, migrated_sqlite: Path, tmp_path: Path
) -> None:
    """The same steps, on the multi-statement plan of SQLite or of PostgreSQL, answer, refuse and write
    exactly as the one statement does on PostgreSQL."""
    if reference == "sqlite":
        shutil.copyfile(migrated_sqlite, tmp_path / "inventory.sqlite3")
        expected = run(f"sqlite:///{tmp_path / 'inventory.sqlite3'}", single_statement=None)
    else:
        with own_pg_schema(migrated=True) as url:
            expected = run(url, single_statement=False)
    for (label, *seen), (_, *wanted) in zip(one_statement_run["events"], expected["events"], strict=True):
        assert seen == wanted, label
    assert one_statement_run["rows"] == expected["rows"]
    # The scenario reaches every refusal it means to.
    refusals = {event[1] for event in expected["events"] if len(event) == 4}
    assert refusals >= {
        "InvalidTransition", "IdempotencyConflict", "UnknownReservation", "StockLimitExceeded", "UnknownSku",
        "CountBelowHeld", "SeenInAnotherEpoch", "StaleToken", "LeaseLost", "ScopeMismatch",
    }  # fmt: skip


# -- round trips ----------------------------------------------------------------------------------------


@contextmanager
def round_trips(inv: Inventory) -> Iterator[list[str]]:
    """What the inventory sends meanwhile: "autocommit" for a statement sent alone, "statement" for one
    in a transaction, and "begin" and "end" for the BEGIN and COMMIT (or ROLLBACK) around them."""
    sent: list[str] = []

    def autocommit(conn: Any) -> bool:
        return bool(conn.connection.dbapi_connection.autocommit)

    def statement(conn: Any, *args: Any) -> None:
        sent.append("autocommit" if autocommit(conn) else "statement")

    def begin(conn: Any) -> None:
        if not autocommit(conn):
            sent.append("begin")

    def end(conn: Any) -> None:
        if not autocommit(conn):
            sent.append("end")

    engine = inv.executor.engine
    hooks = {"before_cursor_execute": statement, "begin": begin, "commit": end, "rollback": end}
    for name, hook in hooks.items():
        sa.event.listen(engine, name, hook)
    try:
        yield sent
    finally:
        for name, hook in hooks.items():
            sa.event.remove(engine, name, hook)


@pytest.fixture
def migrated_pg_url() -> Iterator[str]:
    with own_pg_schema(migrated=True) as url:
        yield url


@pytest.mark.parametrize("single_statement", [True, False], ids=["one statement", "several"])
def test_each_step_is_one_round_trip(migrated_pg_url: str, single_statement: bool) -> None:
    """On PostgreSQL each later step, alone or as a queued request, is one statement in autocommit; the
    multi-statement plan's round trips are printed for comparison."""
    url = migrated_pg_url
    with (
        Inventory.from_url(url, single_statement=single_statement) as inv,
        LeaseManager.from_url(url) as leases,
    ):
        inv.add_sku(WIDGET, on_hand=10)
        lease = lease_for(leases, WIDGET, "w1")
        ids = [inv.reserve(lease, WIDGET, 1, key=f"hold-{n}").reservation_id or "" for n in range(4)]
        steps: dict[str, Callable[[StockSeen], Any]] = {
            "confirm": lambda seen: inv.confirm(lease, ids[0], key="confirm"),
            "release": lambda seen: inv.release(lease, ids[1], key="release"),
            "restock": lambda seen: inv.restock(lease, WIDGET, 2, key="restock"),
            "count": lambda seen: inv.count(lease, WIDGET, 20, key="count", seen=seen),
            "replenish": lambda seen: inv.replenish(lease, WIDGET, 30, key="replenish", seen=seen),
            "confirm request": lambda seen: inv.confirm_request(lease, ids[2], key="q-1", **WHO),
            "release request": lambda seen: inv.release_request(lease, ids[3], key="q-2", **WHO),
            "restock request": lambda seen: inv.restock_request(lease, WIDGET, 1, key="q-3", **WHO),
            "count request": lambda seen: inv.count_request(lease, WIDGET, 40, key="q-4", **WHO, seen=seen),
            "replenish request": lambda seen: inv.replenish_request(
                lease, WIDGET, 50, key="q-5", **WHO, seen=seen
            ),
        }
        sent: dict[str, list[str]] = {}
        for name, step in steps.items():
            seen = inv.look(lease, WIDGET)  # the read a count or a replenishment is decided from
            with round_trips(inv) as sent[name]:
                step(seen)
    print({name: len(trips) for name, trips in sent.items()})
    for name, trips in sent.items():
        if single_statement:
            assert trips == ["autocommit"], name
        else:
            assert len(trips) > 1, name
