"""The idempotent envelope of every fenced write (:class:`reservations.ledger.Ledger`), stepped through with
scripted answers from the database.

The envelope decides what a key's request does with what the database says: apply it and record its
outcome, replay the outcome a first attempt recorded, store a refusal in a transaction of its own, record
a stale token's rejection durably before raising it, and look again after losing a race on the key. The
write itself is a plan of the test's (``apply``): only the envelope's own statements are answered here.
The same envelope runs on real databases in tests/test_inventory.py and tests/test_request_identity.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import sqlalchemy as sa

from fencing import StaleToken
from fencing.plan import Atomic, Plan
from reservations.errors import IdempotencyConflict, InsufficientStock, KeyTaken
from reservations.ledger import Ledger
from reservations.values import Outcome
from testing.scripted import Raises, Script, kinds, rows, sql_params

KEY, OPERATION, PRINT = "order-7", "restock", "fingerprint-of-restock-3"
APPLIED = Outcome(operation=OPERATION, key=KEY, token=5, quantity=3)


class Record(NamedTuple):
    """A row of ``idempotency_keys`` as the envelope reads it."""

    key: str
    fingerprint: str
    operation: str
    outcome: str


def recorded(outcome: Outcome, fingerprint: str = PRINT) -> Record:
    return Record(KEY, fingerprint, OPERATION, outcome.to_json())


class Apply:
    """The write under the envelope: a plan that sends nothing and returns ``APPLIED``, or raises
    ``error``; ``calls`` counts how often the envelope ran it."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls = 0

    def __call__(self) -> Plan[Outcome]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return APPLIED
        yield  # a plan: a generator that yields nothing


REJECTION = sa.text("INSERT INTO sku_history VALUES ('the rejection')")


def envelope(apply: Apply, on_stale: Callable[[StaleToken], Any] = lambda _: REJECTION) -> Plan[Outcome]:
    def lock() -> Plan[None]:
        return None
        yield  # the stock rows' locks are the write's business, not the envelope's

    return Ledger().idempotent(KEY, OPERATION, PRINT, apply, on_stale, lock)


def test_a_new_key_is_applied_and_its_outcome_recorded_in_the_same_transaction() -> None:
    apply = Apply()
    script = Script([rows(), rows()], nested=True)
    assert script.run(envelope(apply)) == APPLIED and apply.calls == 1
    assert kinds(script.ops) == ["Atomic", "select idempotency_keys", "insert idempotency_keys"]
    record = sql_params(script.ops[2])
    assert (record["key"], record["fingerprint"], record["operation"], record["token"]) == (
        KEY,
        PRINT,
        OPERATION,
        5,
    )
    assert Outcome.from_json(record["outcome"], replayed=False) == APPLIED


def test_a_recorded_key_replays_its_outcome_without_applying_again() -> None:
    apply = Apply()
    script = Script([rows(recorded(APPLIED))], nested=True)
    replayed = script.run(envelope(apply))
    assert replayed.replayed and (replayed.token, replayed.quantity) == (5, 3)
    assert apply.calls == 0 and kinds(script.ops) == ["Atomic", "select idempotency_keys"]


def test_a_recorded_key_of_another_request_is_a_conflict_and_writes_nothing() -> None:
    apply = Apply()
    script = Script([rows(recorded(APPLIED, fingerprint="fingerprint-of-restock-4"))], nested=True)
    with pytest.raises(IdempotencyConflict):
        script.run(envelope(apply))
    assert apply.calls == 0 and kinds(script.ops) == ["Atomic", "select idempotency_keys"]


def test_a_refusal_is_stored_in_a_transaction_of_its_own_then_raised() -> None:
    """Too little stock: the write's transaction ends without a record (the shell rolls it back), and the
    refusal is stored as the key's outcome in a second one, so a redelivery replays it."""
    refusal = InsufficientStock(sku="A-1", requested=9, available=2)
    script = Script([rows(), rows(), rows()], nested=True)
    with pytest.raises(InsufficientStock) as raised:
        script.run(envelope(Apply(refusal)))
    assert raised.value is refusal
    assert kinds(script.ops) == [
        *("Atomic", "select idempotency_keys"),
        *("Atomic", "select idempotency_keys", "insert idempotency_keys"),
    ]
    stored = json.loads(sql_params(script.ops[4])["outcome"])
    assert (stored["sku"], stored["requested"], stored["available"]) == ("A-1", 9, 2)


def test_a_refusal_that_an_outcome_overtook_answers_with_that_outcome() -> None:
    """Between the refused write and the store of its refusal, another copy of the request applied the
    key: its outcome stands, and the refusal is neither stored nor raised."""
    refusal = InsufficientStock(sku="A-1", requested=9, available=2)
    script = Script([rows(), rows(recorded(APPLIED))], nested=True)
    answer = script.run(envelope(Apply(refusal)))
    assert answer.replayed and answer.token == 5
    assert "insert idempotency_keys" not in kinds(script.ops)


def test_a_stale_write_is_recorded_in_a_transaction_of_its_own_then_raised() -> None:
    """The write's transaction ends without a trace (rolled back), so the rejection is written apart: the
    statement ``on_stale`` builds from the very error, alone in its Atomic step."""
    stale = StaleToken(scope="sku:A-1", presented=5, highest=7)
    seen: list[StaleToken] = []

    def on_stale(error: StaleToken) -> Any:
        seen.append(error)
        return REJECTION

    script = Script([rows(), rows()], nested=True)
    with pytest.raises(StaleToken) as raised:
        script.run(envelope(Apply(stale), on_stale))
    assert raised.value is stale and seen == [stale]
    assert kinds(script.ops) == ["Atomic", "select idempotency_keys", "Atomic", "TextClause"]
    assert script.ops[3] is REJECTION and isinstance(script.ops[2], Atomic)


def test_a_key_a_concurrent_attempt_recorded_first_is_looked_at_again_and_replayed() -> None:
    """Two copies of the request raced: this one's record lost on the unique key (nothing it wrote
    stays). The next round reads the winner's record and replays it, without applying again."""
    apply = Apply()
    taken = KeyTaken(where="record", constraint="idempotency_keys_pkey")
    script = Script([rows(), Raises(taken), rows(recorded(APPLIED))], nested=True)
    answer = script.run(envelope(apply))
    assert answer.replayed and apply.calls == 1
    assert kinds(script.ops) == [
        *("Atomic", "select idempotency_keys", "insert idempotency_keys"),
        *("Atomic", "select idempotency_keys"),
    ]


def test_a_key_whose_reservation_exists_without_its_record_is_a_conflict() -> None:
    """The key's record was purged but the reservation it made is still there: not a race to look at
    again, a conflict to report."""
    taken = KeyTaken(where="reservation", constraint="uq_reservations_key")
    script = Script([rows(), Raises(taken)], nested=True)
    with pytest.raises(IdempotencyConflict):
        script.run(envelope(Apply()))
    assert kinds(script.ops).count("Atomic") == 1
