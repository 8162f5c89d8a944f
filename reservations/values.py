"""Plain values the inventory hands back: stock levels, reservations, outcomes and history entries.

An :class:`Outcome` is also what an idempotency record stores, so it round-trips through JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class StockLevel:
    sku: str
    on_hand: int
    reserved: int
    available: int
    fence_token: int


@dataclass(frozen=True, slots=True)
class ReservationView:
    id: str
    sku: str
    quantity: int
    status: str
    idempotency_key: str
    order_key: str | None
    token: int
    created_at: float
    hold_expires_at: float | None
    final_at: float | None
    final_token: int | None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an operation did. ``replayed`` is True when it came from the idempotency record."""

    operation: str
    key: str | None
    token: int | None
    reservation_ids: tuple[str, ...] = ()
    stock: tuple[StockLevel, ...] = ()
    quantity: int = 0
    replayed: bool = False
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def reserved(cls, key: str, token: int, reservation_id: str, level: StockLevel, quantity: int) -> Outcome:
        """A single-SKU reservation's outcome, however it was written (one statement, one transaction, a
        batch): the reservation and the SKU's level right after it."""
        return cls(
            operation="reserve",
            key=key,
            token=token,
            reservation_ids=(reservation_id,),
            stock=(level,),
            quantity=quantity,
        )

    @property
    def reservation_id(self) -> str | None:
        return self.reservation_ids[0] if self.reservation_ids else None

    def summary(self) -> dict[str, Any]:
        """The part of the outcome a request's final outcome carries (JSON-ready)."""
        return {
            "reservation_ids": list(self.reservation_ids),
            "token": self.token,
            "quantity": self.quantity,
            "stock": [
                {"sku": s.sku, "on_hand": s.on_hand, "reserved": s.reserved, "available": s.available}
                for s in self.stock
            ],
        }

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("replayed")
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, *, replayed: bool) -> Outcome:
        data = json.loads(text)
        data["reservation_ids"] = tuple(data["reservation_ids"])
        data["stock"] = tuple(StockLevel(**s) for s in data["stock"])
        return cls(**data, replayed=replayed)


@dataclass(frozen=True, slots=True)
class ArchivedHistory:
    """What left a SKU's history for the archive (its newest checkpoint): the history before ``through``
    explained ``on_hand`` and ``reserved``, and its accepted writes carried tokens up to
    ``highest_token``."""

    sku: str
    through: float
    on_hand: int
    reserved: int
    highest_token: int
    archived_at: float
    archive: str | None


def seconds(ms: int | None) -> float | None:
    """Milliseconds as the views give times: in seconds (None stays None)."""
    return None if ms is None else ms / 1000


def columns(row: Any) -> dict[str, Any]:
    """A row's columns as the fields of its view: ``at_ms`` becomes ``at``, in seconds."""
    fields: dict[str, Any] = row._asdict()
    fields["at"] = fields.pop("at_ms") / 1000
    return fields


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One row of a SKU's history: an accepted write (``kind="write"``) or a refused stale write
    (``kind="rejected"``, with ``token`` the presented token and ``highest_token`` the fence)."""

    id: int
    sku: str
    at: float
    kind: str
    operation: str
    token: int
    lease_id: str | None
    holder: str | None
    quantity: int | None
    idempotency_key: str | None
    reservation_id: str | None
    on_hand_delta: int
    reserved_delta: int
    highest_token: int | None
    detail: str | None
