"""The checks the inventory shells make of their own arguments, before any plan is built: the fields of
a request's outcome and attempt (the plans of :mod:`reservations.requests` take them unchecked), the
lease manager a timeline or a hold is given, and whether one statement is asked of a database that has
it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reservations import validation as valid
from reservations.errors import InvalidRequest

# The checks of the arguments that the plans of reservations.requests and reservations.batching take
# unchecked, shared by both shells so neither sends a value the database would refuse with a raw error.

OUTCOME_FIELDS = frozenset({"task_id", "worker", "epochs", "fingerprint"})
ATTEMPT_FIELDS = frozenset({"task_id", "worker", "token", "detail"})


def who(who: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(who) - allowed)
    if unknown:
        raise InvalidRequest(f"unexpected field(s): {', '.join(unknown)}", field=unknown[0])
    valid.task_and_worker(who.get("task_id"), who.get("worker"))
    if "epochs" in who:
        valid.epochs(who["epochs"])
    if "fingerprint" in who:
        valid.fingerprint(who["fingerprint"])
    if "token" in who:
        valid.token(who["token"])
    if "detail" in who:
        valid.text(who["detail"], field="detail", max_chars=valid.MAX_DETAIL_CHARS)


def check_manager(manager: object, kind: type) -> None:
    """InvalidRequest unless ``manager`` is a lease manager of the shell's own kind (``kind``)."""
    if not isinstance(manager, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        raise InvalidRequest(
            f"expected {article} {kind.__name__}, got {type(manager).__name__}", field="manager"
        )


def timeline_args(manager: object, kind: type, sku: str, limit: int) -> str:
    check_manager(manager, kind)
    valid.limit(limit)
    return valid.scope_of(valid.sku(sku))


def single_statement(dialect: str, asked: bool | None) -> bool:
    if asked and dialect != "postgresql":
        raise InvalidRequest("a reservation as one statement needs PostgreSQL", field="single_statement")
    return dialect == "postgresql" if asked is None else asked
