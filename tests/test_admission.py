"""The front door's admission (``Inventory.admit``) on SQLite and PostgreSQL: a new key is recorded in one
statement; a key met before is answered with its outcome, or with the request recorded first under it,
and nothing is written twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from fencing.engines import make_engine
from fencing.plan import Alone
from fencing.sql import driver_text
from reservations import Inventory
from tasks.producer import request_of
from testing.stores import POSTGRES_URL

_keys = itertools.count()


@contextmanager
def statements(inventory: Inventory) -> Iterator[list[str]]:
    sent: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not statement.startswith("BEGIN"):  # SQLite's write lock, taken with the statement it guards
            sent.append(statement)

    engine = inventory.executor.engine
    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        yield sent
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)


def reserve(key: str, quantity: int = 1) -> Any:
    return request_of("reserve", key, {"sku": "ADM", "quantity": quantity})


def recorded(inventory: Inventory, key: str) -> int:
    with inventory.executor.engine.connect() as conn:
        found = conn.execute(sa.text("SELECT count(*) FROM accepted_requests WHERE key = :k"), {"k": key})
        return int(found.scalar_one())


def test_a_new_key_is_recorded_in_one_statement(inventory: Inventory) -> None:
    key = f"adm-{next(_keys)}"
    with statements(inventory) as sent:
        admission = inventory.admit(reserve(key), 60)
    assert len(sent) == 1, sent
    assert admission.first and admission.outcome is None
    assert admission.accepted is not None and admission.accepted.key == key
    assert inventory.accepted(key) == admission.accepted


def test_a_key_met_again_gets_its_first_record_and_writes_nothing(inventory: Inventory) -> None:
    key = f"adm-{next(_keys)}"
    first = inventory.admit(reserve(key, 2), 60)
    again = inventory.admit(reserve(key, 2), 60)
    other = inventory.admit(reserve(key, 3), 60)  # another request under the same key
    assert not again.first and again.accepted == first.accepted and again.outcome is None
    assert not other.first and other.accepted == first.accepted
    assert first.accepted is not None and other.accepted is not None
    assert other.accepted.fingerprint != reserve(key, 3).fingerprint  # the door tells the caller: reused
    assert recorded(inventory, key) == 1


def test_a_key_with_an_outcome_is_answered_with_it_and_not_recorded_again(inventory: Inventory) -> None:
    key, bare = f"adm-{next(_keys)}", f"adm-{next(_keys)}"
    inventory.admit(reserve(key), 60)
    ended = inventory.cancel_request(key, by="ann", reason="withdrawn")
    after = inventory.admit(reserve(key), 60)
    assert after.outcome == ended and not after.first
    # An outcome under a key that no request was recorded for (a library caller's): still the answer.
    inventory.record_accepted([reserve(bare)], 60)
    cancelled = inventory.cancel_request(bare, by="ann", reason="withdrawn")
    with inventory.executor.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM accepted_requests WHERE key = :k"), {"k": bare})
    answered = inventory.admit(reserve(bare), 60)
    assert answered.outcome == cancelled and recorded(inventory, bare) == 0


def test_many_admitted_at_once_answer_as_each_admitted_alone(inventory: Inventory) -> None:
    """The front door's publishing thread admits what arrived while it was busy at once: each request hears
    what it would have heard admitted alone, in order. New keys are recorded, the same key twice is first
    only for the first, a key met before gets its first record and a key with an outcome that outcome;
    nothing is recorded twice or over an outcome."""
    n = next(_keys)
    ended, met, new, twice = (f"many-{n}-{name}" for name in ("ended", "met", "new", "twice"))
    inventory.admit(reserve(ended), 60)
    outcome = inventory.cancel_request(ended, by="ann", reason="withdrawn")
    first_met = inventory.admit(reserve(met), 60).accepted
    batch = [reserve(new), reserve(twice), reserve(met, 5), reserve(ended), reserve(twice, 2)]
    admitted = inventory.admit_many(batch, 60)
    assert [a.first for a in admitted] == [True, True, False, False, False]
    assert [a.outcome for a in admitted] == [None, None, None, outcome, None]
    assert admitted[0].accepted == inventory.accepted(new)
    assert admitted[1].accepted == admitted[4].accepted == inventory.accepted(twice)
    assert admitted[4].accepted is not None and admitted[4].accepted.fingerprint == batch[1].fingerprint
    assert admitted[2].accepted == first_met
    assert {key: recorded(inventory, key) for key in (ended, met, new, twice)} == {
        ended: 1, met: 1, new: 1, twice: 1
    }  # fmt: skip


def test_new_keys_admitted_at_once_are_one_statement_on_postgresql(inventory: Inventory) -> None:
    """On PostgreSQL every new key of a batch is recorded by one statement whatever the batch's size (its
    columns sent as arrays, the text the same each time); SQLite admits each request in turn."""
    n = next(_keys)
    batches = [[reserve(f"arr-{n}-{size}-{i}") for i in range(size)] for size in (3, 40)]
    with statements(inventory) as sent:
        for batch in batches:
            assert all(admission.first for admission in inventory.admit_many(batch, 60))
    if inventory.dialect == "postgresql":
        assert len(sent) == 2 and sent[0] == sent[1], sent
    else:
        assert len(sent) == 43
    assert all(recorded(inventory, request.key) == 1 for batch in batches for request in batch)


def test_a_burst_larger_than_a_statement_takes_is_recorded_whole(inventory: Inventory) -> None:
    """The publishing thread records a whole batch at once, and 10,000 enqueues awaited together are one
    batch: more values than one statement may carry as a row each on either database. Every request is
    recorded, in one transaction: on PostgreSQL in one statement (a column's values as one array), the
    same text as a small batch's."""
    small = [reserve(f"small-burst-{n}") for n in range(3)]
    burst = [reserve(f"burst-{n}") for n in range(6000)]  # 72,000 values: past PostgreSQL's 65,535
    with statements(inventory) as sent:
        inventory.record_accepted(small, 60)
        inventory.record_accepted(burst, 60)
    inserts = [s for s in sent if s.startswith("INSERT")]
    if inventory.dialect == "postgresql":
        assert len(inserts) == 2 and inserts[0] == inserts[1]
    else:
        assert len(inserts) == 7
    with inventory.executor.engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT key FROM accepted_requests WHERE key LIKE 'burst-%'")).scalars()
        assert sorted(keys) == sorted(r.key for r in burst)


def test_one_request_is_recorded_in_one_statement_and_read_back_alike_on_both_paths(
    inventory: Inventory,
) -> None:
    """A producer records each request it enqueues alone: one statement, the same text every time. Read
    back on the driver's cursor (PostgreSQL, nothing listening) and through SQLAlchemy (a listener makes
    the engine watched), the record is the same."""
    first, second = reserve("alone-1"), reserve("alone-2")
    with statements(inventory) as sent:
        inventory.record_accepted([first], 60)
        inventory.record_accepted([second], 60)
    assert len(sent) == 2 and sent[0] == sent[1] and sent[0].startswith("INSERT")
    plain = inventory.accepted(first.key)
    with statements(inventory):
        watched = inventory.accepted(first.key)
    assert plain == watched
    assert plain is not None and (plain.key, plain.arguments) == (first.key, dict(first.arguments))


def test_a_statement_goes_to_the_drivers_cursor_only_when_sqlalchemy_adds_nothing() -> None:
    """fencing.sql.driver_text: a statement built once and sent with bound values runs on the driver's
    cursor as compiled; one with an expanding list, a value of its own, a bind or result type that
    SQLAlchemy converts, or sent without bound values stays with SQLAlchemy."""
    engine = make_engine(POSTGRES_URL)
    try:
        columns = [sa.column("k", sa.String), sa.column("n", sa.BigInteger), sa.column("j", sa.JSON)]
        table = sa.table("t", *columns, sa.column("x", sa.Numeric(asdecimal=False)))
        by_key = sa.select(table.c.k, table.c.n).where(table.c.k == sa.bindparam("k"))
        text = driver_text(Alone(by_key, {"k": "a"}), engine)
        assert text is not None and "%(k)s" in text
        assert driver_text(Alone(by_key), engine) is None  # no bound values: built per call
        others = {
            "an expanding list": sa.select(table.c.k).where(
                table.c.k.in_(sa.bindparam("ks", expanding=True))
            ),
            "a value of its own": sa.select(table.c.k).where(table.c.n == 5, table.c.k == sa.bindparam("k")),
            "a converted bind": sa.update(table).values(j=sa.bindparam("j")),
            "a converted result": sa.select(table.c.x).where(table.c.k == sa.bindparam("k")),
        }
        kept = {name: driver_text(Alone(stmt, {"k": "a"}), engine) for name, stmt in others.items()}
        assert kept == dict.fromkeys(others)
    finally:
        engine.dispose()
