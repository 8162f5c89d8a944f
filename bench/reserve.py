"""One reservation end to end on PostgreSQL: ``Inventory.reserve`` against the same four rows written by raw
psycopg with no fence and no lookup, as a transaction and as one autocommitted statement, on the same schema
and triggers. Round trips and transactions are read off the wire from a libpq trace, not from the code.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, LiteralString, cast

import psycopg
import sqlalchemy as sa
from psycopg import sql
from psycopg.conninfo import make_conninfo
from sqlalchemy import event
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url

from bench.env import Scratch
from bench.leases import UnexpectedReply
from bench.timing import Case, Op, Progress, Results, measure
from bench.wire import Trips, statements_in, transactions_in, wire_trace
from fencing import Lease, LeaseManager
from fencing.sql import db_now_ms
from reservations import Inventory, schema
from reservations import validation as valid
from reservations.models import idempotency_keys, reservations, sku_history
from reservations.operations import fingerprint, new_reservation_id
from reservations.values import Outcome, StockLevel

# Enough SKUs that per-SKU work (row locks, the held-units trigger's update of the stock row) is spread
# the same way for every case over the whole run.
SKUS = 128
ON_HAND = 10**6
TTL = 3600.0  # outlives the section: a lease that expired mid-run would turn fenced writes into errors
HOLDER = "bench"

FENCED = "Inventory.reserve (fenced, idempotent)"
RAW_TX = "raw psycopg transaction, unfenced"
RAW_CTE = "raw psycopg, one CTE statement, autocommit"

# The library's own database clock expression, so every path stamps rows the same way.
NOW_MS = sql.SQL(db_now_ms().compile(dialect=postgresql.dialect()).string)  # type: ignore[no-untyped-call]


# The raw baselines write the rows Inventory.reserve writes, with the same values: the stock row's counts
# and updated_ms (not its fence columns: an unfenced design has none), one held reservation, one history
# row, one idempotency record whose outcome is the same JSON object. What they leave out is the fence
# predicate, the stock row lock and the idempotency lookup (the key's primary key still refuses a
# duplicate). Casts: an untyped parameter inside json_build_object has no type PostgreSQL can infer.
PARTS = {
    "now": NOW_MS,
    "stock_update": sql.SQL(
        "UPDATE stock SET reserved = reserved + %(quantity)s, available = available - %(quantity)s, "
        "updated_ms = {now} WHERE sku = %(sku)s AND available >= %(quantity)s "
        "RETURNING sku, on_hand, reserved, available, fence_token"
    ).format(now=NOW_MS),
    "reservation_row": sql.SQL(
        "INSERT INTO reservations (id, sku, quantity, status, hold_expires_ms, idempotency_key, order_key, "
        "token, lease_id, created_ms)"
    ),
    "history_row": sql.SQL(
        "INSERT INTO sku_history (sku, at_ms, kind, operation, token, lease_id, holder, quantity, "
        "idempotency_key, reservation_id, on_hand_delta, reserved_delta, detail)"
    ),
    "key_row": sql.SQL(
        "INSERT INTO idempotency_keys (key, fingerprint, operation, outcome, token, created_ms)"
    ),
}


def _statement(template: LiteralString) -> bytes:
    """Rendered once: the timed loop sends ready bytes, as a hand-written path with constants would."""
    return sql.SQL(template).format(**PARTS).as_bytes()


RAW_UPDATE = _statement("{stock_update}")
# The three inserts as one statement, so the transaction is BEGIN / UPDATE / INSERTs / COMMIT.
RAW_INSERTS = _statement(
    "WITH r AS ({reservation_row} VALUES (%(id)s, %(sku)s, %(quantity)s, 'held', NULL, %(key)s, NULL, "
    "%(token)s, %(lease_id)s, {now})), "
    "h AS ({history_row} VALUES (%(sku)s, {now}, 'write', 'reserve', %(token)s, %(lease_id)s, %(holder)s, "
    "%(quantity)s, %(key)s, %(id)s, 0, %(quantity)s, NULL)) "
    "{key_row} VALUES (%(key)s, %(fingerprint)s, 'reserve', %(outcome)s, %(token)s, {now})"
)
# Everything in one statement: the inserts read the UPDATE's RETURNING, so no stock row means no rows at
# all, and the outcome JSON is built from it in the statement (the object Outcome.to_json writes). The
# four rows as CTEs (s, r, h, k) serve bench.raw_tasks too, which adds the request's own rows.
RESERVATION_CTES = sql.SQL(
    "WITH s AS ({stock_update}), "
    "r AS ({reservation_row} SELECT %(id)s, s.sku, %(quantity)s, 'held', NULL, %(key)s, NULL, "
    "%(token)s, %(lease_id)s, {now} FROM s), "
    "h AS ({history_row} SELECT s.sku, {now}, 'write', 'reserve', %(token)s, %(lease_id)s, "
    "%(holder)s, %(quantity)s, %(key)s, %(id)s, 0, %(quantity)s, NULL FROM s), "
    "k AS ({key_row} SELECT %(key)s, %(fingerprint)s, 'reserve', json_build_object("
    "'detail', json_build_object(), 'key', %(key)s::text, 'operation', 'reserve', "
    "'quantity', %(quantity)s::bigint, 'reservation_ids', json_build_array(%(id)s::text), "
    "'stock', json_build_array(json_build_object('available', s.available, 'fence_token', s.fence_token, "
    "'on_hand', s.on_hand, 'reserved', s.reserved, 'sku', s.sku)), 'token', %(token)s::bigint)::text, "
    "%(token)s, {now} FROM s)"
).format(**PARTS)
RAW_CTE_STATEMENT = (
    sql.SQL("{ctes} SELECT on_hand, reserved, available, fence_token FROM s")
    .format(ctes=RESERVATION_CTES)
    .as_bytes()
)

Names = Callable[[], str]


def rotate(names: list[str]) -> Names:
    return itertools.cycle(names).__next__


def fresh(prefix: str) -> Names:
    return (f"{prefix}{n}" for n in itertools.count()).__next__


def fenced_reserve(inventory: Inventory, leases: Mapping[str, Lease], skus: Names, keys: Names) -> Op:
    def op() -> None:
        sku = skus()
        outcome = inventory.reserve(leases[sku], sku, 1, key=keys())
        if outcome.replayed or len(outcome.reservation_ids) != 1:
            raise UnexpectedReply(f"reserve on {sku} did not create one reservation: {outcome}")

    return op


def _params(lease: Lease, sku: str, key: str) -> dict[str, Any]:
    """The values every path computes on the client: the library's own id and fingerprint helpers, so
    the gap between the paths is the SQL and its driving, not the row contents."""
    return {
        "sku": sku,
        "quantity": 1,
        "key": key,
        "id": new_reservation_id(),
        "token": lease.token,
        "lease_id": lease.lease_id,
        "holder": lease.holder,
        "fingerprint": fingerprint("reserve", sku=sku, quantity=1, hold_ms=None),
    }


def raw_transaction(
    conn: psycopg.Connection[Any], leases: Mapping[str, Lease], skus: Names, keys: Names
) -> Op:
    """BEGIN (psycopg sends it before the first statement) / UPDATE ... RETURNING / the three inserts /
    COMMIT; the outcome JSON is built here from the returned stock level by the library's Outcome."""

    def op() -> None:
        sku, key = skus(), keys()
        lease = leases[sku]
        params = _params(lease, sku, key)
        with conn.cursor() as cur:
            cur.execute(RAW_UPDATE, params)
            row = cur.fetchone()
            if row is None:
                raise UnexpectedReply(f"raw UPDATE found no stock on {sku}")
            params["outcome"] = Outcome(
                operation="reserve",
                key=key,
                token=lease.token,
                reservation_ids=(params["id"],),
                stock=(StockLevel(*row),),
                quantity=1,
            ).to_json()
            cur.execute(RAW_INSERTS, params)
        conn.commit()

    return op


def raw_statement(conn: psycopg.Connection[Any], leases: Mapping[str, Lease], skus: Names, keys: Names) -> Op:
    """The same rows as one data-modifying CTE on an autocommit connection: one round trip, one
    (implicit) transaction."""
    if not conn.autocommit:
        raise ValueError("the one-statement baseline needs an autocommit connection")

    def op() -> None:
        sku, key = skus(), keys()
        with conn.cursor() as cur:
            cur.execute(RAW_CTE_STATEMENT, _params(leases[sku], sku, key))
            if cur.fetchone() is None:
                raise UnexpectedReply(f"raw CTE found no stock on {sku}")

    return op


# -- round trips on the wire -----------------------------------------------------------------------


def _sqlalchemy_count(inventory: Inventory, op: Op) -> int:
    """Statements as SQLAlchemy sees them, to cross-check the wire. Its begin and commit events are no
    measure of BEGIN and COMMIT on the wire: under autocommit it fires them and the driver sends nothing."""
    seen = [0]

    def bump(*args: object, **kwargs: object) -> None:
        seen[0] += 1

    engine = inventory.executor.engine
    event.listen(engine, "before_cursor_execute", bump)
    try:
        op()
    finally:
        event.remove(engine, "before_cursor_execute", bump)
    return seen[0]


@dataclass(frozen=True)
class Traced:
    """One case's traced calls: the round trips of each call, in order."""

    calls: list[list[str]]

    @property
    def steady(self) -> list[str]:
        """The last call's trips: past psycopg's preparing, what every later call sends."""
        return self.calls[-1]

    @property
    def preparing(self) -> int:
        """Extra round trips once per connection, while psycopg prepares the statements."""
        return max(len(call) for call in self.calls) - len(self.steady)

    @property
    def transactions(self) -> int:
        return transactions_in(self.steady)


# -- the section -----------------------------------------------------------------------------------


def conninfo(url: str) -> str:
    parsed = make_url(url)
    args = parsed.translate_connect_args(username="user", database="dbname")
    options = parsed.query.get("options")
    if options is not None:
        args["options"] = options if isinstance(options, str) else " ".join(options)
    return make_conninfo(**{k: str(v) for k, v in args.items()})


def _check(inventory: Inventory, expected: int, prefixes: list[str]) -> str:
    """Every path wrote what it should: the inventory's invariants hold (reserved units equal held
    reservations, history explains every stock row), each table grew by one row per reserve, and each
    path's idempotency record reads back as the Outcome the library would have stored."""
    problems = [str(violation) for violation in inventory.invariant_violations()]
    with inventory.executor.engine.connect() as conn:
        reserved = conn.execute(sa.text("SELECT sum(reserved) FROM stock")).scalar_one()
        counts = {
            table.name: conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for table in (reservations, idempotency_keys)
        }
        counts[sku_history.name] = conn.execute(
            sa.select(sa.func.count()).where(sku_history.c.operation == "reserve")
        ).scalar_one()
        for prefix in prefixes:
            key, text = conn.execute(
                sa.select(idempotency_keys.c.key, idempotency_keys.c.outcome)
                .where(idempotency_keys.c.key.startswith(prefix)).limit(1)
            ).one()
            outcome = Outcome.from_json(text, replayed=False)
            held = conn.execute(
                sa.select(reservations.c.idempotency_key).where(reservations.c.id == outcome.reservation_id)
            ).scalar_one_or_none()
            if outcome.key != key or held != key or json.loads(outcome.to_json()) != json.loads(text):
                problems.append(f"record {key!r} does not describe its reservation: {text}")
    wrong = {name: n for name, n in counts.items() if n != expected}
    if problems or reserved != expected or wrong:
        raise UnexpectedReply(
            f"after {expected} reserves: reserved {reserved}, rows {counts}, problems {problems[:3]}"
        )
    return (
        f"{expected} reserves: {expected} rows each in reservations, sku_history, idempotency_keys; every "
        "path's idempotency record parses as the library's Outcome of its reservation"
    )


def count_round_trips(
    url: str, leases: Mapping[str, Lease], skus: list[str]
) -> tuple[dict[str, Traced], str, int]:
    """Trace a few reserves of each kind, one trace per call, on connections of their own; return each
    case's trips, a cross-check note and the number of reserves made. Fresh connections, so the trace
    sees each statement psycopg prepares being prepared (and can name it later), and enough calls to
    get past preparing into the steady state."""
    with ExitStack() as stack:
        counter = stack.enter_context(Inventory.from_url(url, pool_size=1, max_overflow=0))
        with counter.executor.engine.connect() as first:  # the pool's one connection, now set up
            raw = cast(psycopg.Connection[Any], first.connection.dbapi_connection)
        tx_conn = stack.enter_context(psycopg.connect(conninfo(url)))
        cte_conn = stack.enter_context(psycopg.connect(conninfo(url), autocommit=True))
        calls = max(raw.prepare_threshold or 0, tx_conn.prepare_threshold or 0) + 2
        ops = {
            FENCED: (raw, fenced_reserve(counter, leases, rotate(skus), fresh("count-fenced:"))),
            RAW_TX: (tx_conn, raw_transaction(tx_conn, leases, rotate(skus), fresh("count-tx:"))),
            RAW_CTE: (cte_conn, raw_statement(cte_conn, leases, rotate(skus), fresh("count-cte:"))),
        }
        traced: dict[str, Traced] = {}
        for name, (conn, op) in ops.items():
            per_call: list[list[str]] = []
            seen = Trips()
            for _ in range(calls):
                with wire_trace(conn, seen) as trips:
                    op()
                per_call.append(trips)
            traced[name] = Traced(per_call)
        by_events = _sqlalchemy_count(counter, ops[FENCED][1])
    on_wire = statements_in(traced[FENCED].steady)
    agrees = "agrees" if by_events == on_wire else f"DISAGREES ({by_events} against {on_wire})"
    begins = any("BEGIN" in trip.split("; ") for t in traced.values() for trip in t.steady)
    note = (
        "Reserve round trips and transactions, from a libpq trace of the wire (one trace per call, the "
        f"last of {calls} calls on a fresh connection): "
        + "; ".join(f"{name}: {', '.join(t.steady)}" for name, t in traced.items())
        + f". SQLAlchemy's count of the statements Inventory.reserve executes {agrees} with the wire."
        + (" BEGIN is a round trip of its own: psycopg sends it before a transaction's first statement."
           if begins else "")
    )
    return traced, note, calls * len(ops) + 1  # the last one: the SQLAlchemy cross-check


def cpu_metered(op: Op, spent: list[float]) -> Op:
    """``op``, adding the client CPU it used to ``spent[0]``: what the process itself costs, apart
    from waiting on the server (which wall time adds)."""
    clock = time.process_time

    def run() -> None:
        start = clock()
        op()
        spent[0] += clock() - start

    return run


def leased_skus(stack: ExitStack, url: str, prefix: str, count: int) -> tuple[list[str], dict[str, Lease]]:
    """``count`` SKU names and a lease on each, migrating the schema at ``url`` first. The SQL lease
    backend on the same database: the section needs no other service. The leases are never released:
    the schema they live in is dropped with the run."""
    schema.upgrade(url)
    skus = [f"{prefix}-{n}" for n in range(count)]
    manager = stack.enter_context(LeaseManager.from_url(url))
    return skus, {sku: manager.acquire(valid.scope_of(sku), ttl=TTL, holder=HOLDER) for sku in skus}


def reserve_vs_raw(
    scratch: Scratch,
    results: Results,
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    progress: Progress | None = None,
) -> None:
    """Needs PostgreSQL; the caller checks it. Works in a migrated schema of its own."""
    section = "Fenced reserve vs raw psycopg writing the same rows, PostgreSQL"
    url = scratch.postgres_url("reserve")
    if progress:
        progress(f"  migrating a fresh schema, adding {SKUS} SKUs, taking their leases")
    with ExitStack() as stack:
        skus, leases = leased_skus(stack, url, "R", SKUS)
        inventory = stack.enter_context(Inventory.from_url(url))
        for sku in skus:
            inventory.add_sku(sku, on_hand=ON_HAND)
        tx_conn = stack.enter_context(psycopg.connect(conninfo(url)))
        cte_conn = stack.enter_context(psycopg.connect(conninfo(url), autocommit=True))

        traced: dict[str, Traced] = {}
        counted = 0
        trips_note = "Reserve round trips: not counted (psycopg's libpq tracing needs Linux)."
        if sys.platform == "linux":
            if progress:
                progress("  counting round trips (libpq trace)")
            traced, trips_note, counted = count_round_trips(url, leases, skus)
        ops = {
            FENCED: fenced_reserve(inventory, leases, rotate(skus), fresh("fenced:")),
            RAW_TX: raw_transaction(tx_conn, leases, rotate(skus), fresh("tx:")),
            RAW_CTE: raw_statement(cte_conn, leases, rotate(skus), fresh("cte:")),
        }
        cpu = {name: [0.0] for name in ops}
        stats = measure(
            [Case(name, cpu_metered(op, cpu[name])) for name, op in ops.items()],
            iterations=iterations, warmup=warmup, repeats=repeats, progress=progress,
        )
        per_case = warmup + iterations * repeats
        checked = _check(inventory, len(ops) * per_case + counted, ["fenced:", "tx:", "cte:"])

    results.add(section, stats, FENCED, RAW_TX)
    results.add(section, stats, FENCED, RAW_CTE)
    results.add(section, stats, RAW_TX, RAW_CTE)
    for name in ops:
        trace = traced.get(name)
        results.cost(section, name, {
            "round trips": str(len(trace.steady)) if trace else "?",
            "+ once per connection": str(trace.preparing) if trace else "?",
            "transactions": str(trace.transactions) if trace else "?",
            "client CPU": f"{cpu[name][0] / per_case * 1e3:.2f} ms",
            "p50": f"{stats[name].p50 * 1e3:.2f} ms",
        })
    results.notes.append(trips_note)
    results.notes.append(
        f"Reserve client CPU: time.process_time of this process over all {per_case} calls per case, per "
        "reserve; the rest of each latency is waiting on PostgreSQL (round trips, triggers, commit). "
        "'+ once per connection': the extra round trips of psycopg preparing its statements."
    )
    results.notes.append(
        f"Reserve rows: {SKUS} SKUs taken in rotation by each case, one SQL lease per SKU (ttl "
        f"{TTL:.0f} s) on the same database, one process; a pooled SQLAlchemy engine vs one psycopg "
        "connection per raw case, all on one migrated schema with its triggers. Every case writes the "
        "same 4 rows: UPDATE stock (counts, updated_ms) RETURNING the level, INSERT reservations (held), "
        "sku_history (write), idempotency_keys (outcome JSON with the level). The raw cases skip the "
        "fence predicate and fence columns, the stock row lock and the idempotency lookup; the "
        "transaction sends the three inserts as one statement (a CTE of inserts), the one-statement case "
        "does the UPDATE and inserts in one data-modifying CTE in autocommit. "
        f"Checked after the run: {checked}; no invariant violations."
    )
