"""What a request task tells operators, one function per event: its log line (facts as fields) and metrics."""

from __future__ import annotations

import logging
import time
from typing import Any

from fencing import LostOwnership, StaleToken
from reservations.request_outcomes import RequestResult
from tasks import metrics
from tasks.messages import ENQUEUED_AT, Message

log = logging.getLogger("tasks")

# The facts of a fencing event, on each of its records (None where they do not apply).
FENCING_FIELDS = ("scope", "sku", "token", "highest", "holder", "lease_id", "task_id", "epoch")


def fencing_fields(**known: Any) -> dict[str, Any]:
    """The fencing event fields with ``known`` filled in; the SKU read from a ``sku:`` scope."""
    fields: dict[str, Any] = dict.fromkeys(FENCING_FIELDS)
    fields.update(known)
    scope = fields.get("scope")
    if fields["sku"] is None and isinstance(scope, str) and scope.startswith("sku:"):
        fields["sku"] = scope.removeprefix("sku:")
    return fields


def lost_ownership(
    lost: LostOwnership, lease_token: int | None, message: Message | None, doing: str = "", **who: Any
) -> dict[str, Any]:
    """Log an attempt (or a batch server, without ``message``, ``doing`` what) that lost its lease, and
    return the fields, which tell one lost epoch from another; ``who``: task_id, worker (key, operation).
    The line starts "lost ownership of <scope>", which the chaos run counts."""
    request = {"key": message.key, "operation": message.operation} if message is not None else {}
    fields = {
        **fencing_fields(
            scope=lost.scope,
            token=lost.token or lease_token,
            highest=lost.highest if isinstance(lost, StaleToken) else None,
            holder=f"{who.get('worker')}:{who.get('task_id')}",
            lease_id=lost.lease_id,
            task_id=who.get("task_id"),
            epoch=message.counts["epoch"] if message is not None else None,
        ),
        "lost_by": type(lost).__name__,
        **who,
        **request,
    }
    metrics.current.lease("lost")
    if isinstance(lost, StaleToken):
        metrics.current.stale_refused(message.operation if message is not None else metrics.SERVE_PENDING)
    log.warning(
        "lost ownership of %s%s (token %s, highest accepted %s) in task %s on %s: %s",
        lost.scope,
        f" while {doing}" if doing else "",
        fields["token"],
        fields["highest"],
        fields["task_id"],
        who.get("worker"),
        lost,
        extra={"event": "lost_ownership", **fields},
    )
    return fields


def dead_lettered(message: Message, reason: str, who: dict[str, Any], **facts: Any) -> None:
    """Log a request dead-lettered for ``reason``; ``facts``: the fencing fields known."""
    # The SKU a single-SKU request names, where no lease's scope says it (the backend stayed down, the
    # lease client could not be built); an order's SKUs are its lines'.
    sku = message.args.get("sku") if "sku" not in facts and "scope" not in facts else None
    fields = fencing_fields(
        task_id=who.get("task_id"), epoch=message.counts["epoch"], **({"sku": sku} if sku else {}), **facts
    )
    log.warning(
        "request %s (%s) dead-lettered in task %s: %s",
        message.key,
        message.operation,
        who.get("task_id"),
        reason,
        extra={
            "event": "dead_lettered",
            **fields,
            "key": message.key,
            "operation": message.operation,
            "reason": reason,
            "worker": who.get("worker"),
        },
    )


def finished(request: Any, result: dict[str, Any]) -> None:
    """Count a request task's answer: its outcome, epochs and latency, or a hand-off to its SKU's holder."""
    current = metrics.current
    if not current.on:
        return
    if result.get("status") == "queued":
        current.queued()
        return
    enqueued = getattr(request, ENQUEUED_AT, None)
    latency = time.time() - enqueued if isinstance(enqueued, int | float) else None
    current.outcome(str(result.get("status")), int(result.get("epochs") or 0), latency)


def served(outcomes: list[RequestResult]) -> None:
    """Count a batch served: its size and outcomes (their enqueue times travel in their own messages)."""
    current = metrics.current
    if current.on and outcomes:
        current.batch(len(outcomes))
        for outcome in outcomes:
            current.outcome(outcome.status, outcome.epochs, None)
