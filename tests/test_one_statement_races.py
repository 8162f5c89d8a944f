"""The later steps as one statement racing: a stale epoch's statement, paused before it is sent or waiting
on the SKU's stock row while a newer epoch commits, is refused and writes nothing but its rejection; a copy
of the same request that committed first is answered from, not applied again; with the token check
dropped, only the database's trigger stands in the stale write's way.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from fencing import Lease, LeaseManager, StaleToken
from fencing.engines import make_engine
from reservations import Inventory, Outcome
from reservations.errors import ConstraintRefused, InvalidTransition
from reservations.request_outcomes import RequestReply
from testing.one_statement import WHO, WIDGET, lease_for, newer_epoch, rows
from testing.stores import own_pg_schema


@pytest.fixture
def migrated_pg_url() -> Iterator[str]:
    with own_pg_schema(migrated=True) as url:
        yield url


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
            return multi.confirm_request(a, rid, key="q-confirm", **WHO)

        a_got, b_did = raced(
            url,
            FINISH,
            lambda: inv.confirm_request(a, rid, key="q-confirm", **WHO),
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
