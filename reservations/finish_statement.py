"""The end of a hold on PostgreSQL as ONE statement (:mod:`reservations.keyed_statement`): a confirm (the
held units leave on hand and reserved) or a release (they go back to available), with the reservation's
final status. The same decisions as the multi-statement plan (``lifecycle._finish``), in the same order:
an unknown reservation, one of another SKU than the lease's, one no longer held, then the fence.
"""

from __future__ import annotations

from typing import Any, NoReturn

from fencing import Fence
from reservations import keyed_statement as keyed
from reservations import validation as valid
from reservations.errors import InvalidTransition, UnknownReservation, UnknownSku
from reservations.sql_text import Variants
from reservations.statuses import ReservationStatus

#   found  the reservation's SKU, read unlocked (a trigger refuses a change of it), to know which stock
#          row to lock; skipped when the key has a record or the request has ended.
#   cur    that SKU's stock row, locked FOR UPDATE first, as every path that changes a reservation does.
#   res    the reservation, locked after the stock row (its join to ``cur`` puts the lock above it): a
#          concurrent confirm, release or expiry committed meanwhile shows here as the status it left.
#          ``ours``: the reservation is of the lease's SKU.
#   fin    the reservation's final status, only when it is held, ours, and the token accepted.
#   upd    the stock change for the units ``fin`` ended.
_SQL = """
WITH {head}, found AS (
    SELECT sku FROM reservations
    WHERE id = %(reservation_id)s::text AND NOT EXISTS (SELECT 1 FROM prior)
      AND NOT EXISTS (SELECT 1 FROM done)
), cur AS (
    SELECT sku, fence_token, fence_lease_id, {accepted} AS accepted, {now_ms} AS now_ms
    FROM stock WHERE sku = (SELECT sku FROM found)
    FOR UPDATE
), res AS (
    SELECT r.id, r.quantity, r.status, r.sku IS NOT DISTINCT FROM %(lease_sku)s::text AS ours
    FROM reservations AS r JOIN cur ON r.sku = cur.sku
    WHERE r.id = %(reservation_id)s::text
    FOR UPDATE OF r
), fin AS (
    UPDATE reservations AS r
    SET status = %(final)s::text, final_ms = cur.now_ms, final_token = %(token)s::bigint,
        final_key = %(key)s::text
    FROM res, cur
    WHERE r.id = res.id AND r.status = '{held}' AND res.status = '{held}' AND res.ours AND cur.accepted
    RETURNING r.quantity
), upd AS (
    UPDATE stock AS s
    SET on_hand = s.on_hand + {on_hand}, reserved = s.reserved - fin.quantity,
        available = s.available + {on_hand} + fin.quantity,
        fence_token = %(token)s::bigint, fence_lease_id = %(lease_id)s::text, updated_ms = cur.now_ms
    FROM cur, fin
    WHERE s.sku = cur.sku
    RETURNING s.sku, s.on_hand, s.reserved, s.available, s.fence_token, cur.now_ms,
              fin.quantity AS quantity, {on_hand} AS on_hand_delta, -fin.quantity AS reserved_delta
), {tail}
SELECT {answer}, f.sku AS reservation_sku, r.status, r.ours, c.sku IS NOT NULL AS known, c.accepted,
       c.fence_token AS highest, c.fence_lease_id AS writer
FROM (SELECT 1) AS one
LEFT JOIN done AS d ON TRUE
LEFT JOIN prior AS p ON TRUE
LEFT JOIN found AS f ON TRUE
LEFT JOIN cur AS c ON TRUE
LEFT JOIN res AS r ON TRUE
LEFT JOIN upd AS u ON TRUE
"""

# What each end of a hold does to on hand, per held unit: a confirm takes the units out of the shelf.
_ON_HAND = {ReservationStatus.CONFIRMED: "-fin.quantity", ReservationStatus.RELEASED: "0::bigint"}


def _variants(final: ReservationStatus) -> Variants:
    return keyed.variants(
        lambda parts: _SQL.format(**parts, held=ReservationStatus.HELD.value, on_hand=_ON_HAND[final])
    )


# The fence predicate and the database clock come from fencing (keyed.variants renders them).
STATEMENTS = {final: _variants(final) for final in _ON_HAND}


def sku_of(scope: str) -> str | None:
    """The SKU whose stock row a lease of ``scope`` guards (:func:`~reservations.validation.scope_of`
    read backwards), or None when the scope guards no SKU."""
    sku = scope.removeprefix(valid.scope_of(""))
    return sku if valid.scope_of(sku) == scope else None


def values(written: keyed.Written, final: ReservationStatus) -> dict[str, Any]:
    """The statement's own parameters, beside the TAIL's."""
    return {"final": final.value, "lease_sku": sku_of(written.lease.scope)}


def refusal(written: keyed.Written, fence: Fence, row: Any) -> NoReturn:
    """Raise what the statement's answer ``row`` refused the end of the hold for, having written nothing:
    :class:`UnknownReservation`, :class:`InvalidTransition` (of another SKU than the lease's, or no
    longer held) or :class:`~fencing.StaleToken` (``fence`` marks the lease lost)."""
    (reservation_id,) = written.reservation_ids
    lease, operation = written.lease, written.operation
    if row.reservation_sku is None:
        raise UnknownReservation(reservation_id)
    if not row.known:  # pragma: no cover - a reservation's stock row cannot go (a foreign key)
        raise UnknownSku(row.reservation_sku)
    if not row.ours:
        raise InvalidTransition(
            reservation_id=reservation_id,
            status=row.status,
            operation=operation,
            detail=f"it belongs to SKU {row.reservation_sku}, the lease is for {lease.scope}",
            belongs_to=row.reservation_sku,
        )
    if row.status != ReservationStatus.HELD:
        raise InvalidTransition(reservation_id=reservation_id, status=row.status, operation=operation)
    # The statement judged the token by the fence's own predicate; the fence raises the error.
    fence.refuse_if_stale(lease, lease.scope, int(row.highest), row.writer, operation)
    raise RuntimeError(f"the {operation} of {reservation_id!r} neither wrote nor refused")  # pragma: no cover
