"""The operator action log: every action taken by hand on a request or a SKU (re-drive, republish, break a
lease, cancel) with who took it, when and why, for the console and ``reservations actions`` to show.

An entry is written once the action took effect: the log says what was done, not what was tried. A
re-drive or a cancel is already recorded by the request's own rows; the entry adds the operator's reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from fencing.plan import Plan
from fencing.sql import Rows, db_now_ms
from reservations import validation as valid
from reservations.errors import InvalidRequest
from reservations.models import operator_actions

ACTIONS = ("redrive", "republish", "break_lease", "cancel")
MAX_TARGET_CHARS = 200


@dataclass(frozen=True, slots=True)
class OperatorAction:
    id: int
    at: float
    action: str
    target: str
    by: str
    reason: str
    detail: dict[str, Any]


def _entry(row: Any) -> OperatorAction:
    detail = json.loads(row.detail) if row.detail else {}
    return OperatorAction(row.id, row.at_ms / 1000, row.action, row.target, row.by, row.reason, detail)


def checked(action: str, target: str, by: str, reason: str) -> tuple[str, str, str, str]:
    """The entry's fields, or InvalidRequest: checked before the action is taken, so an action whose entry
    could not be written is never taken."""
    if action not in ACTIONS:
        raise InvalidRequest(f"action must be one of {', '.join(ACTIONS)}", field="action")
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidRequest("an action needs a reason", field="reason")
    if not isinstance(by, str) or not by.strip():
        raise InvalidRequest("an action needs the operator's name", field="by")
    valid.name(target, field="target", max_chars=MAX_TARGET_CHARS)
    valid.name(by, field="by", max_chars=valid.MAX_WORKER_CHARS)
    valid.text(reason, field="reason", max_chars=valid.MAX_REASON_CHARS)
    return action, target, by.strip(), reason.strip()


def record(
    action: str, target: str, *, by: str, reason: str, detail: dict[str, Any] | None = None
) -> Plan[OperatorAction]:
    action, target, by, reason = checked(action, target, by, reason)
    written: Rows = yield (
        sa.insert(operator_actions)
        .values(
            at_ms=db_now_ms(),
            action=action,
            target=target,
            by=by,
            reason=reason,
            detail=json.dumps(detail, sort_keys=True) if detail else None,
        )
        .returning(*operator_actions.c)
    )
    return _entry(written.first())


def listed(
    *, target: str | None = None, since: float | None = None, before_id: int | None = None, limit: int = 100
) -> Plan[list[OperatorAction]]:
    """The newest entries first, of one target or all; ``before_id``: the next page."""
    since = valid.since(since)
    valid.limit(limit)
    query = sa.select(operator_actions)
    if target is not None:
        query = query.where(operator_actions.c.target == valid.name(target, field="target", max_chars=200))
    if since is not None:
        query = query.where(operator_actions.c.at_ms >= round(since * 1000))
    if before_id is not None:
        query = query.where(operator_actions.c.id < valid.whole(before_id, "before_id", 1, 2**63 - 1))
    found: Rows = yield query.order_by(operator_actions.c.id.desc()).limit(limit)
    return [_entry(row) for row in found.rows]
