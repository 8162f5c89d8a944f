"""Database integrity errors mapped once, by constraint name, to the domain's typed errors.

The inventory's SQL executors pass every database error through :func:`translate`, so plans catch
:class:`KeyTaken` or :class:`ConstraintRefused` and never read a driver's message. PostgreSQL names the
constraint; SQLite names a unique key as ``table.column`` and a CHECK by its name, both listed here.
"""

from __future__ import annotations

import re

from sqlalchemy.exc import DBAPIError, IntegrityError

from reservations.audit import Rule
from reservations.errors import ConstraintRefused, KeyTaken

# The unique keys a request's rows carry, by PostgreSQL constraint name and by SQLite's ``table.column``:
# which of the request's rows already exists under its key. (A request's record, accepted_requests, is
# never refused on its key: every insert of it says ON CONFLICT, reservations.acceptance.)
_KEYS = {
    "reservations_idempotency_key_key": "reservation",
    "reservations.idempotency_key": "reservation",
    "idempotency_keys_pkey": "record",
    "idempotency_keys.key": "record",
    "request_outcomes_pkey": "outcome",
    "request_outcomes.key": "outcome",
    "pending_reservations_key_key": "pending",
    "pending_reservations.key": "pending",
    # A re-drive's key, or its number for the same origin (SQLite names the first column of the pair).
    "request_redrives_pkey": "redrive",
    "request_redrives.redrive_key": "redrive",
    "uq_request_redrives_origin_number": "redrive",
    "request_redrives.origin_key": "redrive",
}

# The CHECK constraints that state an invariant of the audit (reservations.models declares them).
_RULES = {
    "ck_stock_available_nonnegative": Rule.OVERSELL,
    "ck_stock_reserved_nonnegative": Rule.CONSERVATION,
    "ck_stock_conservation": Rule.CONSERVATION,
}

# PostgreSQL: 23505 unique_violation, 23514 check_violation (the schema's triggers raise it too).
_UNIQUE, _CHECK = "23505", "23514"
_SQLITE_UNIQUE = re.compile(r"UNIQUE constraint failed: ([\w.]+)")
_SQLITE_CHECK = re.compile(r"CHECK constraint failed: (\w+)")


def translate(exc: DBAPIError) -> Exception | None:
    """The domain's error for an integrity error, or None for any other database error."""
    orig = exc.orig
    state = getattr(orig, "sqlstate", None)
    first = str(orig).strip().splitlines()[0] if orig is not None else type(exc).__name__
    if state is not None:  # PostgreSQL
        if not (isinstance(exc, IntegrityError) or state.startswith("23")):
            return None
        name = getattr(getattr(orig, "diag", None), "constraint_name", None)
        if state == _UNIQUE and name in _KEYS:
            return KeyTaken(where=_KEYS[name], constraint=name)
        return ConstraintRefused(constraint=name, rule=_RULES.get(name or ""), detail=first)
    if not isinstance(exc, IntegrityError):
        return None
    unique = _SQLITE_UNIQUE.search(first)
    if unique is not None and unique.group(1) in _KEYS:
        return KeyTaken(where=_KEYS[unique.group(1)], constraint=unique.group(1))
    check = _SQLITE_CHECK.search(first)
    name = check.group(1) if check is not None else (unique.group(1) if unique is not None else None)
    return ConstraintRefused(constraint=name, rule=_RULES.get(name or ""), detail=first)
