"""Driving a dead-lettered request again: the re-drive is claimed in the database (reservations.redrives,
which decides whether it may be and under which key), then published as a new request through the same
producer path every client uses. A re-drive that could not be published is taken back, so a later
attempt is not refused as already running.
"""

from __future__ import annotations

from reservations import Inventory
from reservations.redrives import Redrive
from tasks.producer import Producer

__all__ = ["redrive"]


def redrive(inventory: Inventory, producer: Producer, key: str, *, by: str | None = None) -> Redrive:
    """Claim the next re-drive of the dead letter under ``key`` and publish it; the claim is dropped
    again when publishing fails (the error is raised)."""
    claimed = inventory.claim_redrive(key, by=by)
    try:
        producer.send(claimed.request_type, claimed.key, dict(claimed.arguments))
    except BaseException:
        inventory.drop_redrive(claimed.key)
        raise
    return claimed
