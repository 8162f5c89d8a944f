"""Every error a producer can meet imports from ``tasks``, the package it enqueues through, as the very
class where it is defined: an ``except tasks.IdempotencyConflict`` catches what the client raises.
"""

from __future__ import annotations

import pytest

import fencing.errors
import reservations.errors
import reservations.settings
import tasks
import tasks.client
import tasks.outcomes

DEFINED = [
    (reservations.errors, "InvalidRequest"),  # refused before publishing
    (reservations.errors, "IdempotencyConflict"),  # the key's outcome belongs to another request
    (tasks.outcomes, "OutcomeTimeout"),
    (tasks.outcomes, "WatcherClosed"),
    (tasks.client, "ClientClosed"),
    (reservations.settings, "SettingsError"),  # a client builds its settings from the environment
    (fencing.errors, "BackendUnavailable"),  # the outcomes' database does not answer
]


@pytest.mark.parametrize(("module", "name"), DEFINED, ids=[name for _, name in DEFINED])
def test_a_client_error_imports_from_tasks(module: object, name: str) -> None:
    assert name in tasks.__all__
    assert getattr(tasks, name) is getattr(module, name)
