"""What a request's sender is told: its stored final outcome as a Celery result, or a conflict when its
key names a different request (then the key's Celery result stays the owning request's).

An answer is a plain dict, as the result backend stores it and clients read it: ``status``, ``epochs``,
``key``, ``operation``, ``detail``. Whatever names the task's outcome reads its ``status`` field (the
task events, :mod:`tasks.states`; the metrics, :func:`tasks.observe.finished`).
"""

from __future__ import annotations

from typing import Any

from celery import Task

from reservations.requests import RequestResult
from reservations.statuses import RequestStatus
from tasks.messages import Message


def reply(
    status: str, epochs: int, key: str | None, operation: str, detail: dict[str, Any]
) -> dict[str, Any]:
    """An answer as the Celery result carries it (see the module docstring)."""
    return {"status": str(status), "epochs": epochs, "key": key, "operation": operation, "detail": detail}


def as_result(result: RequestResult) -> dict[str, Any]:
    return reply(result.status, result.epochs, result.key, result.operation, result.detail)


def answer(task: Task, message: Message, stored: RequestResult) -> dict[str, Any]:
    """What this message's sender is told about the outcome stored under its key: that outcome if it is
    this request's, else a conflict (and the key's Celery result is left to the request that owns it)."""
    if stored.belongs_to(message.operation, message.fingerprint):
        return as_result(stored)
    return conflict(task, message, stored.operation, "names")


def conflict(task: Task, message: Message, other: str, how: str) -> dict[str, Any]:
    """The answer to a message whose key belongs to a different ``other`` request. Not stored as the
    key's Celery result, which stays the owning request's."""
    task.request.ignore_result = True
    detail = {
        "error": "IdempotencyConflict",
        "message": f"idempotency key {message.key!r} {how} a different {other} request",
        "stored_operation": other,
    }
    return reply(RequestStatus.INVALID, message.counts["epoch"], message.key, message.operation, detail)
