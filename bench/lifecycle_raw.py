"""The later steps as raw psycopg writes them: each of confirm, release, restock, count and replenish as ONE
data-modifying CTE on an autocommit connection, unfenced, writing the rows the library's one statement
writes (reservations.finish_statement, reservations.stock_statement): the physical reference for those
statements, as bench.reserve's one-statement baseline is for a reservation.

Each writes the same rows with the same values: the reservation's final status (confirm, release), the
stock row's counts and updated_ms (not its fence columns: an unfenced design has none), one history row
and one idempotency record whose outcome is the JSON object the library stores. What they leave out is the
fence predicate, the stock row lock and the idempotency lookup (the key's primary key still refuses a
duplicate), and the checks that a reservation is of the lease's SKU and that units added fit under the
on-hand ceiling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from bench.leases import UnexpectedReply
from bench.reserve import PARTS
from fencing import Lease
from reservations import keyed_statement as keyed
from reservations.counting import StockSeen, count_fingerprint, replenish_fingerprint, to_order
from reservations.operations import fingerprint
from reservations.statuses import SUCCEEDED, ReservationStatus

RAW = "raw psycopg, one CTE statement"
STEPS = ("confirm", "release", "restock", "count", "replenish")

# ``s`` is the stock row after the write, with the units moved as the history and the outcome name them
# (quantity) and the change to on hand and reserved: what the library's ``upd`` returns. The history row
# and the idempotency record are read from it, so a write that finds no row writes nothing.
_TAIL = (
    "h AS ({history_row} SELECT s.sku, {now}, 'write', %(operation)s, %(token)s, %(lease_id)s, %(holder)s, "
    "s.quantity, %(key)s, %(reservation_id)s, s.on_hand_delta, s.reserved_delta, %(history_detail)s FROM s), "
    "k AS ({key_row} SELECT %(key)s, %(fingerprint)s, %(operation)s, json_build_object("
    "'operation', %(operation)s::text, 'key', %(key)s::text, 'token', %(token)s::bigint, "
    "'reservation_ids', %(reservation_ids)s::json, 'stock', json_build_array(json_build_object("
    "'sku', s.sku, 'on_hand', s.on_hand, 'reserved', s.reserved, 'available', s.available, "
    "'fence_token', s.fence_token)), 'quantity', s.quantity, 'detail', %(detail)s::json)::text, "
    "%(token)s, {now} FROM s) "
    "SELECT s.on_hand, s.reserved, s.available, s.fence_token FROM s"
)
_RETURNING = "stock.sku, stock.on_hand, stock.reserved, stock.available, stock.fence_token"

# The end of a hold: the reservation's status (only while held), then its SKU's counts by its units.
_ENDS = (
    "WITH f AS (UPDATE reservations SET status = %(final)s, final_ms = {now}, final_token = %(token)s, "
    "final_key = %(key)s WHERE id = %(reservation_id)s AND status = 'held' RETURNING sku, quantity), "
    "s AS (UPDATE stock SET on_hand = stock.on_hand + {on_hand}, reserved = stock.reserved - f.quantity, "
    "available = stock.available + {on_hand} + f.quantity, updated_ms = {now} FROM f "
    "WHERE stock.sku = f.sku RETURNING {returning}, f.quantity, {on_hand} AS on_hand_delta, "
    "-f.quantity AS reserved_delta), {tail}"
)
# Units added (restock, replenish).
_ADDS = (
    "WITH s AS (UPDATE stock SET on_hand = on_hand + %(units)s::bigint, "
    "available = available + %(units)s::bigint, updated_ms = {now} WHERE sku = %(sku)s RETURNING "
    "{returning}, %(units)s::bigint AS quantity, %(units)s::bigint AS on_hand_delta, "
    "0::bigint AS reserved_delta), {tail}"
)
# On hand set to the figure counted, never below the units held. The change recorded is from the row
# this statement's snapshot saw (``o``, unlocked), which a concurrent write to the SKU committed meanwhile
# would make stale; this section writes each SKU from one thread.
_SETS = (
    "WITH s AS (UPDATE stock SET on_hand = %(units)s::bigint, "
    "available = %(units)s::bigint - stock.reserved, updated_ms = {now} FROM stock AS o "
    "WHERE stock.sku = %(sku)s AND o.sku = stock.sku AND stock.reserved <= %(units)s::bigint "
    "RETURNING {returning}, stock.on_hand - o.on_hand AS quantity, "
    "stock.on_hand - o.on_hand AS on_hand_delta, 0::bigint AS reserved_delta), {tail}"
)


def _statement(template: LiteralString, on_hand: LiteralString = "0") -> bytes:
    """Rendered once: the timed loop sends ready bytes, as a hand-written path with constants would."""
    parts = {
        **PARTS,
        "on_hand": sql.SQL(on_hand),
        "returning": sql.SQL(_RETURNING),
        "tail": sql.SQL(_TAIL).format(**PARTS),
    }
    return sql.SQL(template).format(**parts).as_bytes()


_STATEMENTS = {
    "confirm": _statement(_ENDS, "-f.quantity"),
    "release": _statement(_ENDS),
    "restock": _statement(_ADDS),
    "count": _statement(_SETS),
    "replenish": _statement(_ADDS),
}
_FINAL = {"confirm": ReservationStatus.CONFIRMED, "release": ReservationStatus.RELEASED}

Ends = Callable[[Lease, str, str], None]  # (lease, reservation id, key)
OnStock = Callable[[Lease, str, StockSeen, str], None]  # (lease, sku, what was seen, key)


def writes(
    conn: psycopg.Connection[Any], *, counted: int, par: int
) -> tuple[dict[str, Ends], dict[str, OnStock]]:
    """Each step's raw write on ``conn``, taking the arguments the library's step takes; a count sets on
    hand to ``counted``, a replenishment orders up to ``par`` from what was seen. The values computed on
    the client (fingerprints, outcome details, the parameters of the history row and the record) come from
    the library's own helpers, so the gap between the paths is the SQL and its driving, not the rows."""
    if not conn.autocommit:
        raise ValueError("the one-statement baseline needs an autocommit connection")

    def send(step: str, written: keyed.Written, **values: Any) -> None:
        with conn.cursor() as cur:
            cur.execute(_STATEMENTS[step], {**written.values(None), **values})
            if cur.fetchone() is None:
                raise UnexpectedReply(f"raw {step} wrote nothing: {values}")

    def ends(step: str) -> Ends:
        final = _FINAL[step]

        def write(lease: Lease, reservation_id: str, key: str) -> None:
            print_ = fingerprint(step, reservation_id=reservation_id)
            written = keyed.Written(
                lease, key, step, print_, SUCCEEDED[step], reservation_ids=(reservation_id,)
            )
            send(step, written, final=final.value)

        return write

    def restock(lease: Lease, sku: str, seen: StockSeen, key: str) -> None:
        print_ = fingerprint("restock", sku=sku, delta=1, reason=None)
        send("restock", keyed.Written(lease, key, "restock", print_, SUCCEEDED["restock"]), sku=sku, units=1)

    def count(lease: Lease, sku: str, seen: StockSeen, key: str) -> None:
        detail = {"counted": counted, "seen": seen.version, "seen_on_hand": seen.on_hand}
        print_ = count_fingerprint(sku, counted, None)
        written = keyed.Written(lease, key, "count", print_, SUCCEEDED["count"], detail=detail)
        send("count", written, sku=sku, units=counted)

    def replenish(lease: Lease, sku: str, seen: StockSeen, key: str) -> None:
        detail = {"par": par, "seen": seen.version, "seen_on_hand": seen.on_hand}
        print_ = replenish_fingerprint(sku, par)
        written = keyed.Written(lease, key, "replenish", print_, SUCCEEDED["replenish"], detail=detail)
        send("replenish", written, sku=sku, units=to_order(seen, par))

    return (
        {"confirm": ends("confirm"), "release": ends("release")},
        {"restock": restock, "count": count, "replenish": replenish},
    )
