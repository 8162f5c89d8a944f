"""Celery tasks that take a SKU's lease and carry its fencing token into every stock change.

Start workers with ``celery -A tasks worker`` (the Celery :data:`app`, configured from the environment);
producers use :class:`ReservationClient` (asyncio and plain code alike), whose handles give each request's
:class:`RequestResult`. :func:`create_app` builds a Celery app from a :class:`Settings` of one's own. Every
error a producer can meet imports from here too (:mod:`tasks.errors` lists them).
"""

from fencing import BackendUnavailable
from reservations.errors import IdempotencyConflict, InvalidRequest
from reservations.request_outcomes import RequestResult
from tasks import producer as _producer  # noqa: F401  (stamps the headers of every message published)
from tasks import worker as _worker  # noqa: F401  (connects the per-process lifecycle signals)
from tasks.app import app, create_app
from tasks.client import ReservationClient, ReservationHandle
from tasks.errors import BrokerUnavailable, ClientClosed, OutcomeTimeout, TasksError, WatcherClosed
from tasks.settings import Settings, SettingsError

__all__ = [
    "BackendUnavailable",
    "BrokerUnavailable",
    "ClientClosed",
    "IdempotencyConflict",
    "InvalidRequest",
    "OutcomeTimeout",
    "RequestResult",
    "ReservationClient",
    "ReservationHandle",
    "Settings",
    "SettingsError",
    "TasksError",
    "WatcherClosed",
    "app",
    "create_app",
]
