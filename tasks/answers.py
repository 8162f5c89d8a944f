"""What a request's sender is told: its stored final outcome as a Celery result, or a conflict when its
key names a different request (then the key's Celery result stays the owning request's).
"""

from __future__ import annotations

from typing import Any

from celery import Task

from reservations.messages import Message
from reservations.requests import RequestResult
from reservations.statuses import RequestStatus


def as_result(result: RequestResult) -> dict[str, Any]:
    return {
        "key": result.key,
        "operation": result.operation,
        "status": result.status,
        "detail": result.detail,
        "epochs": result.epochs,
    }


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
    return {
        "key": message.key,
        "operation": message.operation,
        "status": RequestStatus.INVALID,
        "epochs": message.counts["epoch"],
        "detail": {
            "error": "IdempotencyConflict",
            "message": f"idempotency key {message.key!r} {how} a different {other} request",
            "stored_operation": other,
        },
    }
