"""One reservation end to end on PostgreSQL: ``Inventory.reserve`` (stock row lock, idempotency lookup,
fenced UPDATE, three inserts) against the same rows written by plain psycopg with no fence and no lookup,
and the round trips each one sends, read off the wire from a libpq trace rather than from the code.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, LiteralString, cast

import psycopg
import sqlalchemy as sa
from psycopg import pq, sql
from psycopg.conninfo import make_conninfo
from sqlalchemy import event
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url

from bench.env import Scratch
from bench.leases import UnexpectedReply
from bench.timing import Case, Op, Progress, Results, measure
from fencing import Lease, LeaseManager
from fencing.sql import db_now_ms
from reservations import Inventory, schema
from reservations import validation as valid
from reservations.models import idempotency_keys, reservations, sku_history
from reservations.operations import fingerprint, new_reservation_id
from reservations.views import Outcome, StockLevel

# Enough SKUs that the per-SKU trigger work (the units-counted-once trigger sums a SKU's held
# reservations on every insert) stays small and equal for both cases over the whole run.
SKUS = 128
ON_HAND = 10**6
TTL = 3600.0  # outlives the section: a lease that expired mid-run would turn fenced writes into errors
HOLDER = "bench"

FENCED = "Inventory.reserve (fenced, idempotent)"
PLAIN = "plain psycopg, same rows"

# The library's own database clock expression, so both paths stamp rows the same way.
NOW_MS = sql.SQL(db_now_ms().compile(dialect=postgresql.dialect()).string)  # type: ignore[no-untyped-call]


def _statement(template: LiteralString) -> bytes:
    """Rendered once: the timed loop sends ready bytes, as a hand-written path with constants would."""
    return sql.SQL(template).format(now=NOW_MS).as_bytes()


# The plain path: the writes a hand-written reservation would send, without the fence predicate, the
# stock row lock and the idempotency lookup. RETURNING lets it store the same outcome JSON the library
# stores (it carries the stock level), so the idempotency rows are the same size.
PLAIN_UPDATE = _statement(
    "UPDATE stock SET reserved = reserved + 1, available = available - 1 "
    "WHERE sku = %s AND available >= 1 RETURNING on_hand, reserved, available, fence_token"
)
PLAIN_RESERVATION = _statement(
    "INSERT INTO reservations (id, sku, quantity, status, hold_expires_ms, idempotency_key, order_key, "
    "token, lease_id, created_ms) VALUES (%s, %s, %s, 'held', NULL, %s, NULL, %s, %s, {now})"
)
PLAIN_HISTORY = _statement(
    "INSERT INTO sku_history (sku, at_ms, kind, operation, token, lease_id, holder, quantity, "
    "idempotency_key, reservation_id, on_hand_delta, reserved_delta, detail) "
    "VALUES (%s, {now}, 'write', 'reserve', %s, %s, %s, %s, %s, %s, 0, %s, NULL)"
)
PLAIN_KEY = _statement(
    "INSERT INTO idempotency_keys (key, fingerprint, operation, outcome, token, created_ms) "
    "VALUES (%s, %s, 'reserve', %s, %s, {now})"
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


def plain_reserve(conn: psycopg.Connection[Any], leases: Mapping[str, Lease], skus: Names, keys: Names) -> Op:
    """The same rows as ``fenced_reserve``, built with the library's own id, fingerprint and outcome
    helpers so the gap between the two is the SQL and its driving, not the row contents."""

    def op() -> None:
        sku, key = skus(), keys()
        lease = leases[sku]
        reservation_id = new_reservation_id()
        with conn.cursor() as cur:
            cur.execute(PLAIN_UPDATE, (sku,))
            row = cur.fetchone()
            if row is None:
                raise UnexpectedReply(f"plain UPDATE found no stock on {sku}")
            cur.execute(PLAIN_RESERVATION, (reservation_id, sku, 1, key, lease.token, lease.lease_id))
            cur.execute(
                PLAIN_HISTORY, (sku, lease.token, lease.lease_id, lease.holder, 1, key, reservation_id, 1)
            )
            outcome = Outcome(
                operation="reserve",
                key=key,
                token=lease.token,
                reservation_ids=(reservation_id,),
                stock=(StockLevel(sku, *row),),
                quantity=1,
            )
            print_ = fingerprint("reserve", sku=sku, quantity=1, hold_ms=None)
            cur.execute(PLAIN_KEY, (key, print_, outcome.to_json(), lease.token))
        conn.commit()

    return op


# -- round trips on the wire -----------------------------------------------------------------------

# A libpq trace line starts a message with direction, length and type; anything else continues the
# previous message (statement text keeps its newlines).
_MESSAGE = re.compile(r"^(?P<dir>[FB])\t\d+\t(?P<type>\w+)\t?(?P<rest>.*)$")
_QUOTED = re.compile(r'"((?:[^"]|"")*)"')


def _label(text: str) -> str:
    """A short name for a statement: verb, table, and FOR UPDATE when it locks."""
    words = text.split()
    verb = words[0].upper() if words else "?"
    upper = [w.upper() for w in words]
    table = ""
    # The table follows the verb's own keyword; a FROM inside EXTRACT(EPOCH FROM ...) is not it.
    marker = {"SELECT": "FROM", "INSERT": "INTO", "UPDATE": "UPDATE", "DELETE": "FROM"}.get(verb)
    if marker in upper and upper.index(marker) + 1 < len(words):
        table = words[upper.index(marker) + 1]
    lock = " FOR UPDATE" if "FOR UPDATE" in " ".join(upper) else ""
    return f"{verb} {table}{lock}".strip()


def _round_trips(trace: str) -> list[str]:
    """One label per round trip in a libpq trace: a client message the client then waits on (a simple
    Query, or a Sync ending an extended-protocol group). A Sync after a lone Parse is psycopg preparing
    a statement, which it does as a round trip of its own."""
    messages: list[list[str]] = []
    for line in trace.splitlines():
        match = _MESSAGE.match(line)
        if match:
            messages.append([match["dir"], match["type"], match["rest"]])
        elif messages:
            messages[-1][2] += "\n" + line
    prepared: dict[str, str] = {}
    trips: list[str] = []
    group: list[tuple[str, str]] = []  # (type, statement) since the last Sync
    for direction, kind, rest in messages:
        if direction != "F":
            continue
        quoted = [q.replace('""', '"') for q in _QUOTED.findall(rest)]
        if kind == "Query":
            trips.append(quoted[0].strip() if quoted else "?")
        elif kind == "Parse" and len(quoted) >= 2:
            prepared[quoted[0]] = quoted[1]
            group.append(("Parse", quoted[1]))
        elif kind == "Bind" and len(quoted) >= 2:
            group.append(("Bind", prepared.get(quoted[1], "?")))
        elif kind == "Sync":
            binds = [stmt for k, stmt in group if k == "Bind"]
            parses = [stmt for k, stmt in group if k == "Parse"]
            if binds:
                trips.append(_label(binds[-1]))
            elif parses:
                trips.append(f"prepare {_label(parses[-1])}")
            group = []
    return trips


@contextmanager
def wire_trace(conn: psycopg.Connection[Any]) -> Iterator[list[str]]:
    """Collect the round trips ``conn`` makes inside the block (filled in when the block ends)."""
    trips: list[str] = []
    fd, path = tempfile.mkstemp(prefix="fencing-bench-trace-")
    try:
        conn.pgconn.trace(fd)
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield trips
        finally:
            conn.pgconn.untrace()  # flushes the stream libpq writes to
        with open(path, encoding="utf-8", errors="replace") as f:
            trips.extend(_round_trips(f.read()))
    finally:
        os.close(fd)  # libpq's FILE on this fd is never used again after untrace
        os.unlink(path)


def _transactions(trips: list[str]) -> list[list[str]]:
    """Split round trips into transactions, each ending with its COMMIT."""
    done: list[list[str]] = []
    current: list[str] = []
    for trip in trips:
        current.append(trip)
        if trip.upper() == "COMMIT":
            done.append(current)
            current = []
    return done


def _sqlalchemy_count(inventory: Inventory, op: Op) -> int:
    """Round trips as SQLAlchemy sees them (begin + statements + commit), to cross-check the wire."""
    seen = [0]

    def bump(*args: object, **kwargs: object) -> None:
        seen[0] += 1

    engine = inventory.executor.engine
    hooks = ("begin", "before_cursor_execute", "commit")
    for name in hooks:
        event.listen(engine, name, bump)
    try:
        op()
    finally:
        for name in hooks:
            event.remove(engine, name, bump)
    return seen[0]


def _describe(name: str, trips: list[list[str]]) -> str:
    steady = trips[-1]
    text = f"{name}: {len(steady)} round trips ({', '.join(steady)})"
    extra = max(len(t) for t in trips) - len(steady)
    if extra:
        text += f", +{extra} once per connection when psycopg prepares its statements"
    return text


# -- the section -----------------------------------------------------------------------------------


def _conninfo(url: str) -> str:
    parsed = make_url(url)
    args = parsed.translate_connect_args(username="user", database="dbname")
    options = parsed.query.get("options")
    if options is not None:
        args["options"] = options if isinstance(options, str) else " ".join(options)
    return make_conninfo(**{k: str(v) for k, v in args.items()})


def _check(inventory: Inventory, expected: int) -> str:
    """Both paths wrote what they should: the inventory's invariants hold (reserved units equal held
    reservations, history explains every stock row) and each table grew by one row per reserve."""
    problems = inventory.invariant_violations()
    with inventory.executor.engine.connect() as conn:
        reserved = conn.execute(sa.text("SELECT sum(reserved) FROM stock")).scalar_one()
        counts = {
            table.name: conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for table in (reservations, idempotency_keys)
        }
        counts[sku_history.name] = conn.execute(
            sa.select(sa.func.count()).where(sku_history.c.operation == "reserve")
        ).scalar_one()
    wrong = {name: n for name, n in counts.items() if n != expected}
    if problems or reserved != expected or wrong:
        raise UnexpectedReply(
            f"after {expected} reserves: reserved {reserved}, rows {counts}, problems {problems[:3]}"
        )
    return f"{expected} reserves: {expected} rows each in reservations, sku_history, idempotency_keys"


def count_round_trips(url: str, leases: Mapping[str, Lease], skus: list[str]) -> tuple[str, int]:
    """Trace a few reserves of each kind on connections of their own; return the note and the number of
    reserves made. Fresh connections, so the trace sees each statement psycopg prepares being prepared
    (and can name it later), and enough calls to get past preparing into the steady state."""
    if sys.platform != "linux":  # psycopg's libpq tracing is Linux-only
        return "Reserve round trips: not counted (libpq tracing needs Linux).", 0
    with ExitStack() as stack:
        counter = stack.enter_context(Inventory.from_url(url, pool_size=1, max_overflow=0))
        with counter.executor.engine.connect() as first:  # the pool's one connection, now set up
            raw = cast(psycopg.Connection[Any], first.connection.dbapi_connection)
        plain_conn = stack.enter_context(psycopg.connect(_conninfo(url)))
        calls = (raw.prepare_threshold or 0) + 2
        fenced = fenced_reserve(counter, leases, rotate(skus), fresh("count-fenced:"))
        plain = plain_reserve(plain_conn, leases, rotate(skus), fresh("count-plain:"))
        with wire_trace(raw) as fenced_trips:
            for _ in range(calls - 1):
                fenced()
            by_events = _sqlalchemy_count(counter, fenced)
        with wire_trace(plain_conn) as plain_trips:
            for _ in range(calls):
                plain()
    fenced_tx, plain_tx = _transactions(fenced_trips), _transactions(plain_trips)
    if len(fenced_tx) != calls or len(plain_tx) != calls:
        raise UnexpectedReply(f"traced {len(fenced_tx)} / {len(plain_tx)} commits for {calls} calls")
    agrees = "agrees" if by_events == len(fenced_tx[-1]) else f"DISAGREES ({by_events})"
    note = (
        f"Reserve round trips, from a libpq trace of the wire: {_describe('fenced reserve', fenced_tx)}; "
        f"{_describe('plain', plain_tx)}. SQLAlchemy's count for the fenced one (begin + statements + "
        f"commit events) {agrees}. BEGIN is a round trip of its own: psycopg sends it before a "
        "transaction's first statement."
    )
    return note, 2 * calls


def cpu_metered(op: Op, spent: list[float]) -> Op:
    """``op``, adding the client CPU it used to ``spent[0]``: what the process itself costs, apart
    from waiting on the server (which wall time adds)."""
    clock = time.process_time

    def run() -> None:
        start = clock()
        op()
        spent[0] += clock() - start

    return run


def reserve_vs_plain(
    scratch: Scratch,
    results: Results,
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    progress: Progress | None = None,
) -> None:
    """Needs PostgreSQL; the caller checks it. Works in a migrated schema of its own."""
    section = "Fenced reserve vs plain psycopg writes, PostgreSQL (1 reserve per transaction)"
    url = scratch.postgres_url("reserve")
    if progress:
        progress(f"  migrating a fresh schema, adding {SKUS} SKUs, taking their leases")
    schema.upgrade(url)
    skus = [f"R-{n}" for n in range(SKUS)]
    with ExitStack() as stack:
        # The SQL lease backend on the same database: the section needs no other service. The leases
        # are never released: the schema they live in is dropped with the run.
        manager = stack.enter_context(LeaseManager.from_url(url))
        leases = {sku: manager.acquire(valid.scope_of(sku), ttl=TTL, holder=HOLDER) for sku in skus}
        inventory = stack.enter_context(Inventory.from_url(url))
        for sku in skus:
            inventory.add_sku(sku, on_hand=ON_HAND)
        conn = stack.enter_context(psycopg.connect(_conninfo(url)))

        if progress:
            progress("  counting round trips (libpq trace)")
        trips_note, counted = count_round_trips(url, leases, skus)
        cpu = {FENCED: [0.0], PLAIN: [0.0]}
        fenced = fenced_reserve(inventory, leases, rotate(skus), fresh("fenced:"))
        plain = plain_reserve(conn, leases, rotate(skus), fresh("plain:"))
        stats = measure(
            [Case(FENCED, cpu_metered(fenced, cpu[FENCED])), Case(PLAIN, cpu_metered(plain, cpu[PLAIN]))],
            iterations=iterations, warmup=warmup, repeats=repeats, progress=progress,
        )
        per_case = warmup + iterations * repeats
        checked = _check(inventory, 2 * per_case + counted)

    results.add(section, stats, FENCED, PLAIN)
    results.notes.append(trips_note)
    cpu_ms = {name: spent[0] / per_case * 1e3 for name, spent in cpu.items()}
    results.notes.append(
        f"Reserve client CPU (this process, time.process_time over all {per_case} calls per case): fenced "
        f"{cpu_ms[FENCED]:.2f} ms, plain {cpu_ms[PLAIN]:.2f} ms per reserve; the rest of each latency is "
        "waiting on PostgreSQL (round trips, triggers, commit)."
    )
    results.notes.append(
        f"Reserve rows: {SKUS} SKUs taken in rotation by each case, one SQL lease per SKU (ttl "
        f"{TTL:.0f} s) on the same database, one process, pooled SQLAlchemy engine vs one psycopg "
        f"connection; both pay the schema's triggers. Plain = UPDATE stock (no fence, no row lock, no "
        f"idempotency lookup) + INSERT reservations + sku_history + idempotency_keys, one commit. "
        f"Checked after the run: {checked}, no invariant violations."
    )
