"""Driving a dead-lettered request again: the re-drive is claimed in the database (reservations.redrives,
which decides whether it may be and under which key), then recorded and published as a new request
through the same path every producer uses (tasks.sending). A re-drive whose record could not be written
is taken back, so a later attempt is not refused as already running; once recorded, a publish that fails
is the relay's to retry.
"""

from __future__ import annotations

from reservations import Inventory
from reservations.redrives import Redrive
from tasks.sending import Sender, publish, request_of

__all__ = ["redrive"]


def redrive(inventory: Inventory, sender: Sender, key: str, *, by: str | None = None) -> tuple[Redrive, str]:
    """Claim the next re-drive of the dead letter under ``key``, record it and publish it; returns the
    claim and its task id. The claim is dropped again when its record cannot be written (the error is
    raised); a publish that fails after it is raised too, and the relay publishes the request later."""
    claimed = inventory.claim_redrive(key, by=by)
    request = request_of(claimed.request_type, claimed.key, claimed.arguments)
    try:
        sender.record([request])
    except BaseException:
        inventory.drop_redrive(claimed.key)
        raise
    return claimed, publish(sender.producer, request)
