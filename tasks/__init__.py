"""Celery tasks that take a SKU's lease and carry its fencing token into every stock change.

Start workers with ``celery -A tasks worker``; producers use :func:`enqueue_reservation` (asyncio) or
:class:`ReservationClient` (both worlds). Configuration: :class:`Settings`, from
:mod:`tasks.settings`. Every error a producer can meet imports from here too: the request refused
before publishing (:class:`InvalidRequest`), a key used for another request (:class:`IdempotencyConflict`),
waiting past the timeout (:class:`OutcomeTimeout`), a closed client (:class:`ClientClosed`,
:class:`WatcherClosed`), a broker that did not take the message (:class:`BrokerUnavailable`, a kombu
``OperationalError``; these four are :class:`TasksError`), a dead letter that may not be driven
again (:class:`RedriveRefused`) or a key without a request (:class:`UnknownRequest`), bad settings
(:class:`SettingsError`), an unreachable database (:class:`BackendUnavailable`).
"""

from fencing import BackendUnavailable
from reservations.errors import IdempotencyConflict, InvalidRequest, RedriveRefused, UnknownRequest
from reservations.requests import request_id
from tasks import worker as _worker  # noqa: F401  (connects the per-process lifecycle signals)
from tasks.app import app, create_app
from tasks.client import ReservationClient, ReservationHandle, enqueue_reservation
from tasks.errors import BrokerUnavailable, ClientClosed, OutcomeTimeout, TasksError, WatcherClosed
from tasks.settings import Settings
from tasks.variables import SettingsError

__all__ = [
    "BackendUnavailable",
    "BrokerUnavailable",
    "ClientClosed",
    "IdempotencyConflict",
    "InvalidRequest",
    "OutcomeTimeout",
    "RedriveRefused",
    "ReservationClient",
    "ReservationHandle",
    "Settings",
    "SettingsError",
    "TasksError",
    "UnknownRequest",
    "WatcherClosed",
    "app",
    "create_app",
    "enqueue_reservation",
    "request_id",
]
