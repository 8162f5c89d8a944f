"""A key names one request: message checks, fingerprints on outcomes and queued requests, on SQLite and
PostgreSQL; the columns that count stock are 64-bit; a transaction frozen while it holds a SKU's row is
ended by the database after the bound its engine was given.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg import pq

from fencing import BackendUnavailable, Lease, LeaseLost, LeaseManager, StaleToken
from fencing.engines import make_engine
from reservations import InsufficientStock, Inventory, pending, reserve_statement, scope_of
from reservations.operations import fingerprint
from tasks.messages import InvalidMessage, parse, request_fingerprint

# -- the message parser ------------------------------------------------------------------------------------


def test_a_checked_message_carries_the_fingerprint_its_operation_stores() -> None:
    message = parse("reserve", ["W1", 2], {"idempotency_key": "k1", "epoch": 1})
    assert (message.operation, message.key, message.counts) == (
        "reserve",
        "k1",
        {"epoch": 1, "busy": 0, "transient": 0},
    )
    assert message.fingerprint == fingerprint("reserve", sku="W1", quantity=2, hold_ms=None)
    # The producer computes the same fingerprint from the arguments it publishes.
    assert (
        request_fingerprint("reserve", {"sku": "W1", "quantity": 2, "hold_for": None}) == message.fingerprint
    )
    order = parse("reserve_order", [], {"lines": [["B", 1], ["A", 2]], "idempotency_key": "k2"})
    assert order.operation == "reserve_many"
    assert order.fingerprint == fingerprint("reserve_many", lines=[("A", 2), ("B", 1)], hold_ms=None)


@pytest.mark.parametrize(
    ("args", "kwargs", "recordable"),
    [
        ([], {"sku": "W1", "quantity": "3", "idempotency_key": "k"}, True),
        ([], {"sku": "W1", "quantity": 3.0, "idempotency_key": "k"}, True),
        ([], {"sku": "W1", "quantity": 3, "idempotency_key": "k", "epoch": -1000}, True),
        ([], {"sku": "W1", "quantity": 3, "idempotency_key": "k", "epoch": "abc"}, True),
        ([], {"sku": "W1", "quantity": 3, "idempotency_key": "k", "transient": 10**9}, True),
        ([], {"sku": "W1", "quantity": 3, "idempotency_key": "k", "colour": "red"}, True),
        ([], {"sku": "W1", "idempotency_key": "k"}, True),
        (["W1", 3, "k", None, "extra"], {}, False),
        (["W1"], {"sku": "W2", "quantity": 1, "idempotency_key": "k"}, False),
        ([], {"sku": "W1", "quantity": 3, "idempotency_key": "bad key"}, False),
        ([], {"sku": "W1", "quantity": 3}, False),
    ],
)
def test_malformed_messages_are_refused_with_the_key_when_it_is_usable(
    args: list[Any], kwargs: dict[str, Any], recordable: bool
) -> None:
    with pytest.raises(InvalidMessage) as refused:
        parse("reserve", args, kwargs)
    assert (refused.value.key == "k") is recordable
    assert (refused.value.fingerprint is not None) is recordable


def test_a_malformed_request_has_a_fingerprint_of_its_own() -> None:
    text = request_fingerprint("reserve", {"sku": "W1", "quantity": "3"})
    assert text == request_fingerprint("reserve", {"sku": "W1", "quantity": "3"})
    assert text != request_fingerprint("reserve", {"sku": "W1", "quantity": 3})
    assert text != request_fingerprint("reserve", {"sku": "W1", "quantity": [3]})


# -- outcomes and queued requests belong to one request ------------------------------------------------------


def test_an_outcome_belongs_only_to_the_request_that_produced_it(inventory: Inventory) -> None:
    mine = fingerprint("reserve", sku="W1", quantity=2, hold_ms=None)
    other = fingerprint("reserve", sku="W1", quantity=3, hold_ms=None)
    stored = inventory.record_outcome("id-k1", "reserve", "invalid", {"error": "x"}, fingerprint=mine)
    assert stored.fingerprint == mine and stored.belongs_to("reserve", mine)
    # A second writer under the key gets the first outcome back, and can tell it is not its own.
    again = inventory.record_outcome("id-k1", "reserve", "invalid", {"error": "y"}, fingerprint=other)
    assert again == stored
    assert not again.belongs_to("reserve", other)
    assert not again.belongs_to("restock", mine + "x")


def test_a_key_queued_for_one_request_is_a_conflict_for_another(inventory: Inventory) -> None:
    inventory.add_sku("Q1", on_hand=10)
    first = inventory.hand_off("Q1", 1, key="queued-k")
    assert first == pending.Queued(first=True)
    again = inventory.hand_off("Q1", 1, key="queued-k")  # a redelivery of the same request
    assert again == pending.Queued(first=False)
    for quantity, hold_for in ((2, None), (1, 60.0)):
        other = inventory.hand_off("Q1", quantity, key="queued-k", hold_for=hold_for)
        assert other == pending.Conflicting()
    assert inventory.pending_count("Q1") == 1


def test_a_served_batch_records_each_requests_fingerprint(inventory: Inventory, leases: LeaseManager) -> None:
    inventory.add_sku("Q2", on_hand=10)
    inventory.hand_off("Q2", 2, key="served-k", hold_for=30.0)
    lease = leases.acquire(scope_of("Q2"), ttl=30, holder="holder")
    (served,) = inventory.serve_pending(lease, "Q2", limit=10)
    assert served.fingerprint == request_fingerprint(
        "reserve", {"sku": "Q2", "quantity": 2, "hold_for": 30.0}
    )


# -- 64-bit stock counts -------------------------------------------------------------------------------------


UNIT_COLUMNS = [
    ("stock", "on_hand"),
    ("stock", "reserved"),
    ("stock", "available"),
    ("reservations", "quantity"),
    ("pending_reservations", "quantity"),
    ("sku_history", "quantity"),
    ("sku_history", "on_hand_delta"),
    ("sku_history", "reserved_delta"),
]


def test_stock_counts_are_64_bit_on_postgresql(pg_url: str) -> None:
    Inventory.from_url(pg_url, migrate=True).close()
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            types = {
                (table, column): conn.execute(
                    sa.text(
                        "SELECT data_type FROM information_schema.columns"
                        " WHERE table_schema = current_schema() AND table_name = :t AND column_name = :c"
                    ),
                    {"t": table, "c": column},
                ).scalar()
                for table, column in UNIT_COLUMNS
            }
    finally:
        engine.dispose()
    assert types == dict.fromkeys(UNIT_COLUMNS, "bigint")


def test_stock_past_32_bits_is_counted_exactly(inventory: Inventory, leases: LeaseManager) -> None:
    inventory.add_sku("BIG", on_hand=1_000_000)
    engine = inventory.executor.engine
    with engine.begin() as conn:  # an existing warehouse figure, as an earlier import would have left it
        conn.execute(
            sa.text("UPDATE stock SET on_hand = :n, available = :n WHERE sku = 'BIG'"), {"n": 2**31 - 5}
        )
    lease = leases.acquire(scope_of("BIG"), ttl=30, holder="holder")
    inventory.restock(lease, "BIG", 1_000, key="big-restock")
    level = inventory.stock("BIG")
    assert (level.on_hand, level.available) == (2**31 - 5 + 1_000, 2**31 - 5 + 1_000)


# -- a transaction frozen while holding a SKU's row ----------------------------------------------------------


@pytest.fixture
def bounded(pg_url: str) -> Iterator[tuple[Inventory, LeaseManager]]:
    other_side = Inventory.from_url(pg_url, migrate=True, transaction_timeout=0.5)
    leases = LeaseManager.from_url(pg_url)
    try:
        yield other_side, leases
    finally:
        leases.close()
        other_side.close()


@pytest.mark.parametrize("single_statement", [False, True], ids=["transaction", "one-statement"])
def test_a_frozen_holder_keeps_its_sku_for_at_most_the_bound(
    bounded: tuple[Inventory, LeaseManager], pg_url: str, single_statement: bool
) -> None:
    """Frozen between locking the row and writing it: the database ends its transaction after the bound
    (the late write then fails as unreachable). A reservation sent as one statement holds nothing while
    it is frozen, so the next holder never waits, and the late statement is refused as stale."""
    other_side, leases = bounded
    paused, resume = threading.Event(), threading.Event()

    def freeze(lease: Lease) -> None:  # the holder stops between locking the row and writing it
        paused.set()
        resume.wait(30)

    frozen_side = Inventory.from_url(
        pg_url, transaction_timeout=0.5, before_statement=freeze, single_statement=single_statement
    )
    other_side.add_sku("FZ", on_hand=10)
    errors: list[BaseException] = []

    def frozen_holder() -> None:
        lease = leases.acquire(scope_of("FZ"), ttl=0.3, holder="frozen")
        try:
            frozen_side.reserve(lease, "FZ", 2, key="frozen-k")
        except BaseException as exc:
            errors.append(exc)

    holder = threading.Thread(target=frozen_holder)
    holder.start()
    try:
        assert paused.wait(10), "the holder never reached its write"
        lease = leases.acquire(scope_of("FZ"), ttl=30, holder="next", wait=5)
        started = time.monotonic()
        other_side.reserve(lease, "FZ", 3, key="next-k")
        waited = time.monotonic() - started
    finally:
        resume.set()
        holder.join(30)
        frozen_side.close()
    # Without the bound the second holder would wait for the whole pause (30 s here).
    assert waited < 5.0, waited
    expected = StaleToken if single_statement else BackendUnavailable
    assert len(errors) == 1 and isinstance(errors[0], expected), errors
    level = other_side.stock("FZ")
    assert (level.on_hand, level.reserved) == (10, 3)


# -- a reservation on PostgreSQL is one round trip -----------------------------------------------------------


def _client_waits(trace: str) -> list[str]:
    """The client messages a libpq trace shows the client then waiting on: a simple Query, or the Sync
    that ends an extended-protocol group. One per round trip."""
    waits = []
    for line in trace.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[0] == "F" and parts[2] in ("Query", "Sync"):
            waits.append(parts[2] if parts[2] == "Sync" else parts[3][:40])
    return waits


def test_a_reservation_on_postgresql_is_one_round_trip(pg_url: str, tmp_path: Path) -> None:
    inventory = Inventory.from_url(pg_url, migrate=True, pool_size=1, max_overflow=0)
    leases = LeaseManager.from_url(pg_url)
    trace_path = tmp_path / "trace"
    sink = trace_path.open("w")  # libpq writes to its file descriptor until untrace
    try:
        inventory.add_sku("RT", on_hand=10)
        lease = leases.acquire(scope_of("RT"), ttl=30, holder="holder")
        inventory.reserve(lease, "RT", 1, key="rt-warm")  # the pooled connection exists from here on
        with inventory.executor.engine.connect() as conn:
            raw: Any = conn.connection.dbapi_connection
            raw.pgconn.trace(sink.fileno())
            raw.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        # The connection went back to the pool with its trace on: the next checkout is the same one.
        applied = inventory.reserve(lease, "RT", 2, key="rt-one")
        replayed = inventory.reserve(lease, "RT", 2, key="rt-one")
        with pytest.raises(InsufficientStock):
            inventory.reserve(lease, "RT", 50, key="rt-short")
        with inventory.executor.engine.connect() as conn:
            conn.connection.dbapi_connection.pgconn.untrace()  # type: ignore[union-attr]
        waits = _client_waits(trace_path.read_text(errors="replace"))
    finally:
        sink.close()
        leases.close()
        inventory.close()
    assert replayed.replayed and replayed.reservation_ids == applied.reservation_ids
    # Three requests, one round trip each (no BEGIN, no COMMIT); the connect/untrace checkouts add none.
    assert waits == ["Sync", "Sync", "Sync"], waits


# -- a queued reserve request run to its end ---------------------------------------------------------------


def test_a_reserve_request_writes_its_change_attempt_and_outcome_together(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku("RQ", on_hand=3)
    lease = leases.acquire(scope_of("RQ"), ttl=30, holder="holder")
    who = {"task_id": "task-1", "worker": "host:1", "epochs": 1}

    applied = inventory.reserve_request(lease, "RQ", 2, key="rq-applied", **who)
    assert applied.outcome is not None and not applied.outcome.replayed
    assert applied.result == inventory.request_outcome("rq-applied")
    assert (applied.result.status, applied.result.epochs, applied.result.task_id) == ("reserved", 1, "task-1")
    assert applied.result.detail == applied.outcome.summary()
    assert applied.result.belongs_to("reserve", request_fingerprint("reserve", {"sku": "RQ", "quantity": 2}))
    assert [(a.result, a.token) for a in inventory.attempts("rq-applied")] == [("applied", lease.token)]

    short = inventory.reserve_request(lease, "RQ", 5, key="rq-short", **who)
    assert short.outcome is None
    assert (short.result.status, short.result.detail) == (
        "insufficient_stock",
        {"sku": "RQ", "requested": 5, "available": 1},
    )
    assert short.result == inventory.request_outcome("rq-short")

    # A request that already ended is answered from its outcome, and nothing more is written.
    again = inventory.reserve_request(lease, "RQ", 2, key="rq-applied", **who)
    assert (again.result, again.outcome) == (applied.result, None)
    # The same key with another request gets the stored outcome back, and can tell it is not its own.
    other = inventory.reserve_request(lease, "RQ", 1, key="rq-applied", **who)
    assert not other.result.belongs_to(
        "reserve", request_fingerprint("reserve", {"sku": "RQ", "quantity": 1})
    )
    assert len(inventory.attempts("rq-applied")) == 1
    level = inventory.stock("RQ")
    assert (level.on_hand, level.reserved) == (3, 2)
    assert inventory.invariant_violations() == []


def test_a_reserve_request_replays_a_key_applied_without_an_outcome(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku("RR", on_hand=3)
    lease = leases.acquire(scope_of("RR"), ttl=30, holder="holder")
    first = inventory.reserve(lease, "RR", 1, key="rr-key")  # applied, as a killed worker would leave it
    replay = inventory.reserve_request(lease, "RR", 1, key="rr-key", task_id="t", worker="w", epochs=0)
    assert replay.outcome is not None and replay.outcome.replayed
    assert replay.result.detail["reservation_ids"] == list(first.reservation_ids)
    assert [a.result for a in inventory.attempts("rr-key")] == ["replayed"]
    assert inventory.stock("RR").reserved == 1


def test_a_stale_reserve_request_writes_nothing_but_its_rejection(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku("RS", on_hand=3)
    old = leases.acquire(scope_of("RS"), ttl=30, holder="old")
    leases.break_lease(scope_of("RS"), reason="paused past its lease")
    new = leases.acquire(scope_of("RS"), ttl=30, holder="new")
    inventory.reserve(new, "RS", 1, key="rs-new")
    with pytest.raises(StaleToken):
        inventory.reserve_request(old, "RS", 1, key="rs-old", task_id="t", worker="w", epochs=0)
    assert inventory.request_outcome("rs-old") is None
    assert inventory.attempts("rs-old") == []
    rejected = [h for h in inventory.history("RS") if h.kind == "rejected"]
    assert [(h.idempotency_key, h.token, h.highest_token) for h in rejected] == [
        ("rs-old", old.token, new.token)
    ]
    assert inventory.stock("RS").reserved == 1


def test_a_copy_committed_while_the_statement_waits_is_answered_not_raised(pg_url: str) -> None:
    """The statement reads the key on its starting snapshot; a copy of the request that commits while it
    waits on the stock row's lock makes it fail on a unique key, and the next round answers from the
    outcome that copy stored."""
    inventory = Inventory.from_url(pg_url, migrate=True)
    leases = LeaseManager.from_url(pg_url)
    copy = make_engine(pg_url)
    try:
        inventory.add_sku("CW", on_hand=10)
        lease = leases.acquire(scope_of("CW"), ttl=30, holder="holder")
        replies: list[Any] = []
        with copy.connect() as conn:
            # The copy's own statement, in a transaction left open: it holds the row and the key's rows.
            statement = reserve_statement.STATEMENTS[(True, True)]  # fenced, speaking for a request
            conn.exec_driver_sql(
                statement.text,
                statement.bind(dict(
                    key="cw-key", sku="CW", quantity=2, token=lease.token, lease_id=lease.lease_id,
                    holder=lease.holder, hold_ms=None, reservation_id="r_" + "c" * 32,
                    fingerprint=request_fingerprint("reserve", {"sku": "CW", "quantity": 2}),
                    record=True, task_id="first", worker="w1", epochs=0,
                )),
            )  # fmt: skip
            waiting = threading.Thread(
                target=lambda: replies.append(
                    inventory.reserve_request(lease, "CW", 2, key="cw-key", task_id="late", worker="w2")
                )
            )
            waiting.start()
            deadline = time.monotonic() + 10
            while not conn.exec_driver_sql(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'"
            ).scalar():
                assert time.monotonic() < deadline, "the statement never waited on the row"
                time.sleep(0.01)
            conn.commit()
        waiting.join(30)
    finally:
        copy.dispose()
        leases.close()
    (late,) = replies
    stored = inventory.request_outcome("cw-key")
    assert late.outcome is None and late.result == stored
    assert stored is not None and stored.task_id == "first"
    assert [r.id for r in inventory.reservations("CW")] == ["r_" + "c" * 32]
    inventory.close()


def test_the_reservation_statement_stays_within_the_drivers_query_cache() -> None:
    # psycopg re-parses a query longer than 4 KB on every call (about 0.6 ms of CPU per reservation).
    for statement in reserve_statement.STATEMENTS.values():
        assert len(statement.text.encode()) <= 4096


def test_a_key_with_a_record_replays_whatever_lease_is_presented(
    inventory: Inventory, leases: LeaseManager
) -> None:
    """The key is looked up before the lease is judged, on the one-statement path as on the other: a
    lease known lost, or one of another SKU, still gets the stored outcome of its own request."""
    inventory.add_sku("LL", on_hand=5)
    inventory.add_sku("LO", on_hand=5)
    lease = leases.acquire(scope_of("LL"), ttl=30, holder="holder")
    first = inventory.reserve(lease, "LL", 1, key="ll-key")
    lease.mark_lost("renewal failed: test")
    again = inventory.reserve(lease, "LL", 1, key="ll-key")
    assert again.replayed and again.reservation_ids == first.reservation_ids
    other = leases.acquire(scope_of("LO"), ttl=30, holder="holder")
    assert inventory.reserve(other, "LL", 1, key="ll-key").reservation_ids == first.reservation_ids
    with pytest.raises(LeaseLost):
        inventory.reserve(lease, "LL", 1, key="ll-fresh")
    assert inventory.stock("LL").reserved == 1
