"""Celery tasks that take a SKU's lease and carry its fencing token into every stock change.

Start workers with ``celery -A tasks worker``; producers use :func:`enqueue_reservation` (asyncio) or
:class:`ReservationClient` (both worlds). Configuration: :class:`Settings`, from
:mod:`reservations.settings`.
"""

from reservations.requests import request_id
from tasks import worker as _worker  # noqa: F401  (connects the per-process lifecycle signals)
from tasks.app import app, create_app
from tasks.client import ClientClosed, ReservationClient, ReservationHandle, enqueue_reservation
from tasks.outcomes import OutcomeTimeout, WatcherClosed
from tasks.settings import Settings, SettingsError

__all__ = [
    "ClientClosed",
    "OutcomeTimeout",
    "ReservationClient",
    "ReservationHandle",
    "Settings",
    "SettingsError",
    "WatcherClosed",
    "app",
    "create_app",
    "enqueue_reservation",
    "request_id",
]
