"""Celery tasks that take a SKU's lease and carry its fencing token into every stock change.

Start workers with ``celery -A tasks worker`` (the Celery :data:`app`, configured from the environment);
producers use :class:`ReservationClient` (asyncio and plain code alike), whose handles give each request's
:class:`RequestResult`. :func:`create_app` builds a Celery app from a :class:`Settings` of one's own. Every
error a producer can meet imports from here too (:mod:`tasks.errors` lists them).

The names below are imported when first asked for (PEP 562), not with the package: a process that only
reads settings or logs (the ``reservations`` command line) then starts without Celery's app, kombu and the
client. ``tasks.app`` connects the producer's and the worker's signals wherever an app exists.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fencing import BackendUnavailable
    from reservations.errors import IdempotencyConflict, InvalidRequest
    from reservations.request_outcomes import RequestResult
    from tasks.app import app, create_app
    from tasks.client import ReservationClient, ReservationHandle
    from tasks.errors import BrokerUnavailable, ClientClosed, OutcomeTimeout, TasksError, WatcherClosed
    from tasks.settings import Settings, SettingsError

# Each public name and the module it lives in.
_HOMES = {
    "BackendUnavailable": "fencing",
    "IdempotencyConflict": "reservations.errors",
    "InvalidRequest": "reservations.errors",
    "RequestResult": "reservations.request_outcomes",
    "app": "tasks.app",
    "create_app": "tasks.app",
    "ReservationClient": "tasks.client",
    "ReservationHandle": "tasks.client",
    "BrokerUnavailable": "tasks.errors",
    "ClientClosed": "tasks.errors",
    "OutcomeTimeout": "tasks.errors",
    "TasksError": "tasks.errors",
    "WatcherClosed": "tasks.errors",
    "Settings": "tasks.settings",
    "SettingsError": "tasks.settings",
}

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


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'tasks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
