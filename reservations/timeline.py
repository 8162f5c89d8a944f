"""A SKU's token history as one ordered timeline: lease events from the coordinator, accepted writes and
refused stale writes from the database, and the same facts grouped per token (one epoch per owner).

Lease events carry the coordinator's clock and writes the database's; entries are ordered by time, and
entries of the same millisecond by the epoch they belong to (tokens grow with time) and, within it, as an
epoch runs: acquired, its writes, its end, then the stale writes refused because of it (a refusal names the
highest token the row had accepted, so it came after that epoch began).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

from fencing import LeaseEvent
from reservations.values import HistoryEntry

_PLACE_IN_EPOCH = {
    "acquired": 0,
    "renewed": 1,
    "write": 2,
    "released": 3,
    "broken": 3,
    "repaired": 3,
    "rejected": 4,
}


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    at: float
    # acquired, released, broken, repaired, renewed (histories written before renewals stopped being
    # recorded): lease events; write, rejected: the database's
    kind: str
    token: int
    holder: str | None
    operation: str | None = None
    quantity: int | None = None
    idempotency_key: str | None = None
    highest_token: int | None = None
    detail: str | None = None


@dataclass
class Epoch:
    """Everything that happened under one token."""

    token: int
    holder: str | None = None
    acquired_at: float | None = None
    ended: str | None = None  # released, expired, broken, repaired, superseded, or None while current
    writes: list[TimelineEntry] = field(default_factory=list)
    rejections: list[TimelineEntry] = field(default_factory=list)


def merge(lease_events: Iterable[LeaseEvent], history: Iterable[HistoryEntry]) -> list[TimelineEntry]:
    entries = [
        TimelineEntry(at=e.at, kind=e.event, token=e.token, holder=e.holder, detail=e.detail)
        for e in lease_events
    ]
    entries += [
        TimelineEntry(**{f: getattr(h, f) for f in TimelineEntry.__dataclass_fields__}) for h in history
    ]
    return sorted(entries, key=_order)


def _order(entry: TimelineEntry) -> tuple[float, int, int]:
    # A refused write is placed in the epoch of the token that beat it, not of the one it presented.
    beaten_by = entry.highest_token if entry.kind == "rejected" else None
    epoch = entry.token if beaten_by is None else beaten_by
    return (entry.at, epoch, _PLACE_IN_EPOCH.get(entry.kind, 5))


def epochs(timeline: Iterable[TimelineEntry]) -> list[Epoch]:
    """Group a timeline by token. A rejected write belongs to the epoch of the token it presented."""
    by_token: dict[int, Epoch] = {}
    for entry in timeline:
        if entry.token == 0:  # the SKU's creation, before any owner
            continue
        epoch = by_token.setdefault(entry.token, Epoch(token=entry.token))
        if entry.kind == "acquired":
            epoch.holder, epoch.acquired_at = entry.holder, entry.at
        elif entry.kind in ("released", "broken", "repaired"):
            epoch.ended = entry.kind
        elif entry.kind in ("write", "rejected"):
            (epoch.writes if entry.kind == "write" else epoch.rejections).append(entry)
            epoch.holder = epoch.holder or entry.holder
    ordered = [by_token[t] for t in sorted(by_token)]
    for earlier, later in pairwise(ordered):
        if earlier.ended is None and later.acquired_at is not None:
            # The coordinator only hands out a new token once the old lease is gone.
            earlier.ended = "expired"
        elif earlier.ended is None:
            earlier.ended = "superseded"
    return ordered
