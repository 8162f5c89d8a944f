"""The payload of each request a client publishes, checked before anything is published: a request that
could never succeed is refused with :class:`InvalidRequest` in the producer, not dead-lettered by a
worker. The sync and async enqueues of :class:`tasks.client.ReservationClient` both build theirs here.
"""

from __future__ import annotations

from typing import Any

from reservations import InvalidRequest, counting
from reservations import validation as valid
from tasks.messages import SHAPES

__all__ = ["count", "known", "order", "replenishment", "reservation"]


def reservation(sku: str, quantity: int, hold_for: float | None) -> dict[str, Any]:
    """A reserve request's payload, refused before publishing if it could never succeed."""
    return {
        "sku": valid.sku(sku),
        "quantity": valid.quantity(quantity),
        "hold_for": valid.hold_seconds(hold_for),
    }


def order(lines: list[tuple[str, int]], hold_for: float | None) -> dict[str, Any]:
    checked = valid.order_lines(lines)
    return {"lines": [list(line) for line in checked], "hold_for": valid.hold_seconds(hold_for)}


def count(sku: str, counted: int) -> dict[str, Any]:
    return {"sku": valid.sku(sku), "counted": counting.counted_units(counted)}


def replenishment(sku: str, par: int) -> dict[str, Any]:
    return {"sku": valid.sku(sku), "par": counting.par_units(par)}


def known(operation: str) -> str:
    if operation not in SHAPES:
        raise InvalidRequest(
            f"unknown operation {operation!r}; one of {', '.join(sorted(SHAPES))}", field="operation"
        )
    return operation
