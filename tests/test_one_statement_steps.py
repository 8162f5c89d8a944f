"""The later steps as one statement on PostgreSQL: a confirm, a release, a restock, a count and a
replenishment, alone or as a queued request with its attempt and outcome, cost one round trip in
autocommit, and decide exactly what the multi-statement plan decides (the reference, and SQLite's path):
the same answers, the same refusals, the same rows. A stale epoch's statement, paused before it is sent or
waiting on the row lock while a newer epoch commits, is refused and writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fencing import Lease, LeaseManager, StaleToken
from fencing.engines import make_engine
from reservations import Inventory, Outcome, scope_of
from reservations.counting import StockSeen, short_count
from reservations.errors import ConstraintRefused, InvalidTransition
from reservations.requests import RequestReply
from reservations.reserve_statement import Speaker
from reservations.validation import MAX_ON_HAND
from tests.conftest import own_pg_schema

WIDGET, GADGET, BIG, NOPE = "WIDGET", "GADGET", "BIG", "NOPE"
SPEAKER = Speaker(task_id="task-1", worker="worker-1", epochs=1)
UNKNOWN = "r_" + "0" * 32


def lease_for(leases: LeaseManager, sku: str, holder: str) -> Lease:
    return leases.acquire(scope_of(sku), ttl=60, holder=holder)


def newer_epoch(leases: LeaseManager, stale: Lease, holder: str) -> Lease:
    """The next epoch of ``stale``'s scope, its lease broken by an operator: ``stale`` does not know."""
    leases.break_lease(stale.scope, reason="a newer epoch takes over")
    return leases.acquire(stale.scope, ttl=60, holder=holder)


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
    plans = inv.plans

    def note(label: str, step: Callable[[], Any]) -> Any:
        try:
            value = step()
        except Exception as exc:  # the refusal is what is compared
            events.append([label, type(exc).__name__, str(exc), getattr(exc, "replayed", None)])
            return None
        events.append([label, described(value)])
        return value

    def request(plan: Any) -> Callable[[], RequestReply]:
        return lambda: inv.executor.run(plan)

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
    note("q confirm", request(plans.confirm_request(a, ids[2], "q-confirm", SPEAKER)))
    note("q confirm ended", request(plans.confirm_request(a, ids[2], "q-confirm", SPEAKER)))
    note("q release", request(plans.release_request(a, ids[3], "q-release", SPEAKER)))
    note("q restock", request(plans.restock_request(a, WIDGET, 3, "q-restock", SPEAKER)))
    note("q restock ended", request(plans.restock_request(a, WIDGET, 3, "q-restock", SPEAKER)))
    seen = note("look", lambda: inv.look(a, WIDGET))
    note("q count", request(plans.count_request(a, WIDGET, 50, "q-count", SPEAKER, seen=seen)))
    seen = note("look", lambda: inv.look(a, WIDGET))
    note("q replenish", request(plans.replenish_request(a, WIDGET, 60, "q-replenish", SPEAKER, seen=seen)))
    note("restock unrecorded", lambda: inv.restock(a, WIDGET, 1, key="q-late"))
    note("q restock replayed", request(plans.restock_request(a, WIDGET, 1, "q-late", SPEAKER)))
    note("q confirm unknown", request(plans.confirm_request(a, UNKNOWN, "q-unknown", SPEAKER)))
    note("q count below held", request(plans.count_request(a, WIDGET, 0, "q-low", SPEAKER)))
    # a newer epoch writes; the old one is refused, then known lost; the key still answers first
    b = newer_epoch(leases, a, "w2")
    note("restock newer", lambda: inv.restock(b, WIDGET, 1, key="restock-b"))
    note("confirm stale", lambda: inv.confirm(a, ids[4], key="confirm-stale"))
    note("confirm lost", lambda: inv.confirm(a, ids[4], key="confirm-lost"))
    note("restock lost, replayed", lambda: inv.restock(a, WIDGET, 5, key="restock-1"))
    note("q confirm lost, ended", request(plans.confirm_request(a, ids[2], "q-confirm", SPEAKER)))
    note("restock of another scope", lambda: inv.restock(b, GADGET, 1, key="mismatch"))
    note("count from another epoch's read", lambda: inv.count(b, WIDGET, 20, key="count-4", seen=seen))
    g2 = newer_epoch(leases, g, "w2")
    note("restock gadget newer", lambda: inv.restock(g2, GADGET, 1, key="restock-g2"))
    note("q release stale", request(plans.release_request(g, other, "q-stale", SPEAKER)))
    note("q restock stale", request(plans.restock_request(g, GADGET, 1, "q-stale-2", SPEAKER)))
    note("confirm newer", lambda: inv.confirm(b, ids[4], key="confirm-b"))
    return events


def rows(url: str) -> dict[str, Any]:
    """Every row the steps write, without clocks, lease ids and row ids."""
    engine = make_engine(url)
    with engine.connect() as conn:

        def read(sql: str) -> list[dict[str, Any]]:
            return [dict(row._mapping) for row in conn.execute(sa.text(sql))]

        found = {
            "stock": read("SELECT sku, on_hand, reserved, available, fence_token FROM stock ORDER BY sku"),
            "reservations": read(
                "SELECT id, sku, quantity, status, idempotency_key, token, final_token, final_key,"
                " final_ms IS NOT NULL AS ended FROM reservations ORDER BY created_ms, idempotency_key"
            ),
            "history": read(
                "SELECT sku, kind, operation, token, holder, quantity, idempotency_key, reservation_id,"
                " on_hand_delta, reserved_delta, highest_token, detail FROM sku_history ORDER BY id"
            ),
            "keys": read(
                "SELECT key, fingerprint, operation, outcome, token FROM idempotency_keys ORDER BY key"
            ),
            "outcomes": read(
                "SELECT key, operation, status, detail, task_id, worker, epochs, fingerprint"
                " FROM request_outcomes ORDER BY key"
            ),
            "attempts": read(
                "SELECT key, operation, result, task_id, worker, token, detail FROM task_attempts ORDER BY id"
            ),
        }
    engine.dispose()
    for row in found["keys"]:
        row["outcome"] = json.loads(row["outcome"])
    for row in found["outcomes"]:
        row["detail"] = json.loads(row["detail"])
    return found


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
        plans, run_plan = inv.plans, inv.executor.run
        ids = [inv.reserve(lease, WIDGET, 1, key=f"hold-{n}").reservation_id or "" for n in range(4)]
        steps: dict[str, Callable[[StockSeen], Any]] = {
            "confirm": lambda seen: inv.confirm(lease, ids[0], key="confirm"),
            "release": lambda seen: inv.release(lease, ids[1], key="release"),
            "restock": lambda seen: inv.restock(lease, WIDGET, 2, key="restock"),
            "count": lambda seen: inv.count(lease, WIDGET, 20, key="count", seen=seen),
            "replenish": lambda seen: inv.replenish(lease, WIDGET, 30, key="replenish", seen=seen),
            "confirm request": lambda seen: run_plan(plans.confirm_request(lease, ids[2], "q-1", SPEAKER)),
            "release request": lambda seen: run_plan(plans.release_request(lease, ids[3], "q-2", SPEAKER)),
            "restock request": lambda seen: run_plan(plans.restock_request(lease, WIDGET, 1, "q-3", SPEAKER)),
            "count request": lambda seen: run_plan(
                plans.count_request(lease, WIDGET, 40, "q-4", SPEAKER, seen=seen)
            ),
            "replenish request": lambda seen: run_plan(
                plans.replenish_request(lease, WIDGET, 50, "q-5", SPEAKER, seen=seen)
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


# -- two epochs racing on one reservation ---------------------------------------------------------------


_WAITING = sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :m")


def waiting_on_a_lock(url: str, marker: str, finished: threading.Event) -> None:
    """Return once a backend waits on a lock in a statement containing ``marker`` (the one statement
    under test: no other statement has it); fail if the statement ended first or never waited."""
    engine = make_engine(url)
    deadline = time.monotonic() + 30
    try:
        with engine.connect() as conn:
            while time.monotonic() < deadline and not finished.is_set():
                waiting = conn.execute(_WAITING, {"m": f"%{marker}%"}).scalar_one()
                conn.rollback()
                if waiting:
                    return
                finished.wait(0.005)  # polling what the server reports, not a guess at how long it takes
    finally:
        engine.dispose()
    raise AssertionError(f"the statement ({marker}) never waited on the stock row's lock")


# What each statement alone holds, to tell it apart from every other statement in pg_stat_activity.
FINISH, STOCK = "FOR UPDATE OF r", "AS fits"


def raced(
    url: str, marker: str, a_step: Callable[[], Any], b_step: Callable[[Inventory], Any]
) -> tuple[Any, Any]:
    """Run ``b_step`` on the multi-statement plan and, while its transaction holds the SKU's stock row
    (its fenced write about to be sent), ``a_step`` in a thread until its statement waits on that row;
    then let B commit. Returns what A got (its answer or its error) and what B did."""
    answer: dict[str, Any] = {}
    finished = threading.Event()

    def a_thread() -> None:
        try:
            answer["value"] = a_step()
        except Exception as exc:  # the answer is what the test checks
            answer["value"] = exc
        finally:
            finished.set()

    def while_b_holds_the_row(lease: Lease) -> None:
        if "thread" not in answer:
            answer["thread"] = threading.Thread(target=a_thread)
            answer["thread"].start()
            waiting_on_a_lock(url, marker, finished)

    with Inventory.from_url(url, single_statement=False, before_statement=while_b_holds_the_row) as multi:
        b_did = b_step(multi)
    answer["thread"].join(30)
    return answer["value"], b_did


@pytest.mark.parametrize(
    "race",
    ["newer epoch restocks", "newer epoch releases", "copy confirms", "newer epoch restocks, stale counts"],
)
def test_statement_waiting_on_the_row_lock_decides_on_the_row_as_committed(
    migrated_pg_url: str, race: str
) -> None:
    """A's one statement is sent while B, in a transaction of the multi-statement plan, holds the SKU's
    stock row; B commits, and A decides on the row as B left it: a newer epoch's write makes A's token
    stale (StaleToken, recorded; nothing written), a newer epoch's release leaves nothing held to confirm
    (InvalidTransition; nothing written), and a copy of A's own confirm that committed first is replayed."""
    url = migrated_pg_url
    with Inventory.from_url(url) as inv, LeaseManager.from_url(url) as leases:
        inv.add_sku(WIDGET, on_hand=10)
        a = lease_for(leases, WIDGET, "w1")
        rid = inv.reserve(a, WIDGET, 3, key="hold").reservation_id or ""
        seen = inv.look(a, WIDGET)
        b = a if race == "copy confirms" else newer_epoch(leases, a, "w2")

        def a_step() -> Outcome:
            if race.endswith("stale counts"):
                return inv.count(a, WIDGET, 9, key="a-step", seen=seen)
            return inv.confirm(a, rid, key="a-step")

        def b_step(multi: Inventory) -> Outcome:
            if race.startswith("newer epoch restocks"):
                return multi.restock(b, WIDGET, 5, key="b-step")
            if race == "newer epoch releases":
                return multi.release(b, rid, key="b-step")
            return multi.confirm(b, rid, key="a-step")

        a_got, b_did = raced(url, STOCK if race.endswith("stale counts") else FINISH, a_step, b_step)
        after = rows(url)
        held = inv.reservation(rid).status
        level = inv.stock(WIDGET)
    mine = [row for row in after["history"] if row["idempotency_key"] == "a-step"]
    if race == "copy confirms":
        assert isinstance(a_got, Outcome) and a_got.replayed
        assert a_got == dataclasses.replace(b_did, replayed=True)
        assert [row["kind"] for row in mine] == ["write"]  # B's, once
        return
    # A wrote nothing: the stock is as B left it, and A's key has no record and no write.
    assert level == b_did.stock[0]
    assert "a-step" not in {row["key"] for row in after["keys"]}
    if race == "newer epoch releases":
        assert isinstance(a_got, InvalidTransition) and a_got.status == "released"
        assert held == "released" and mine == []
        return
    assert isinstance(a_got, StaleToken)
    assert (a_got.presented, a_got.highest) == (a.token, b.token)
    assert held == "held"
    assert [(row["kind"], row["token"], row["highest_token"]) for row in mine] == [
        ("rejected", a.token, b.token)
    ]


def test_copies_of_a_request_racing_end_with_one_outcome(migrated_pg_url: str) -> None:
    """Two copies of one queued confirm (a redelivery): B runs the steps one after another, A's one
    statement waits on the row B holds. A finds the reservation confirmed by B, looks at the key again
    and answers with the request's one outcome; the confirm was written once."""
    url = migrated_pg_url
    with Inventory.from_url(url) as inv, LeaseManager.from_url(url) as leases:
        inv.add_sku(WIDGET, on_hand=10)
        a = lease_for(leases, WIDGET, "w1")
        rid = inv.reserve(a, WIDGET, 3, key="hold").reservation_id or ""

        def b_step(multi: Inventory) -> RequestReply:
            return multi.executor.run(multi.plans.confirm_request(a, rid, "q-confirm", SPEAKER))

        a_got, b_did = raced(
            url,
            FINISH,
            lambda: inv.executor.run(inv.plans.confirm_request(a, rid, "q-confirm", SPEAKER)),
            b_step,
        )
        stored = inv.request_outcome("q-confirm")
        after = rows(url)
    assert isinstance(a_got, RequestReply), a_got
    assert a_got.result == b_did.result == stored and stored.status == "confirmed"
    writes = [row for row in after["history"] if row["idempotency_key"] == "q-confirm"]
    assert [row["operation"] for row in writes] == ["confirm"]
    assert {row["result"] for row in after["attempts"] if row["key"] == "q-confirm"} <= {
        "applied",
        "replayed",
    }


def test_epoch_paused_before_its_statement_is_refused(migrated_pg_url: str) -> None:
    """The case study: A takes the SKU, pauses just before its confirm is sent; its lease goes to B, who
    restocks; A's statement then arrives and is refused, writing nothing but its rejection."""
    url = migrated_pg_url
    with LeaseManager.from_url(url) as leases, Inventory.from_url(url) as b_side:
        b_side.add_sku(WIDGET, on_hand=10)
        a = lease_for(leases, WIDGET, "w1")
        rid = b_side.reserve(a, WIDGET, 3, key="hold").reservation_id or ""
        taken: list[Outcome] = []

        def pause(lease: Lease) -> None:
            if not taken:
                taken.append(b_side.restock(newer_epoch(leases, a, "w2"), WIDGET, 5, key="b-step"))

        with Inventory.from_url(url, before_statement=pause) as a_side:
            before = rows(url)
            with pytest.raises(StaleToken):
                a_side.confirm(a, rid, key="a-step")
        after = rows(url)
    assert b_side is not None and taken
    rejected = after["history"][-1]
    assert (rejected["kind"], rejected["operation"], rejected["idempotency_key"]) == (
        "rejected",
        "confirm",
        "a-step",
    )
    b_wrote = [row for row in after["history"] if row["idempotency_key"] == "b-step"]
    assert after["history"][: len(before["history"])] == before["history"] and len(b_wrote) == 1
    assert after["reservations"] == before["reservations"]  # still held
    assert after["stock"][0]["on_hand"] == 15 and after["stock"][0]["reserved"] == 3


@pytest.mark.parametrize("single_statement", [True, False], ids=["one statement", "several"])
def test_lease_only_leaves_the_stale_write_to_the_trigger(
    migrated_pg_url: str, single_statement: bool
) -> None:
    """With the fence's token check dropped from the statement (lease-only, for measuring what the fence
    prevents) the stale epoch's write reaches the stock row, and only the database's trigger (the fence
    never goes back) refuses it: no StaleToken, no rejection recorded, on both paths alike."""
    url = migrated_pg_url
    with (
        Inventory.from_url(url, enforce_fence=False, single_statement=single_statement) as inv,
        LeaseManager.from_url(url) as leases,
    ):
        inv.add_sku(WIDGET, on_hand=10)
        a = lease_for(leases, WIDGET, "w1")
        rid = inv.reserve(a, WIDGET, 3, key="hold").reservation_id or ""
        seen = inv.look(a, WIDGET)
        b = newer_epoch(leases, a, "w2")
        inv.restock(b, WIDGET, 5, key="b-step")
        before = rows(url)
        with pytest.raises(ConstraintRefused, match="would go back"):
            inv.confirm(a, rid, key="a-confirm")
        with pytest.raises(ConstraintRefused, match="would go back"):
            inv.count(a, WIDGET, 4, key="a-count", seen=seen)
        assert rows(url) == before and not a.lost
        assert inv.confirm(b, rid, key="b-confirm").stock[0].on_hand == 12
