"""Every error a producer can meet imports from ``tasks``, the package it enqueues through, as the very
class where it is defined: an ``except tasks.IdempotencyConflict`` catches what the client raises.
"""

from __future__ import annotations

import pytest
from kombu.exceptions import OperationalError

import fencing.errors
import reservations.errors
import tasks
import tasks.errors
import tasks.settings

DEFINED = [
    (reservations.errors, "InvalidRequest"),  # refused before publishing
    (reservations.errors, "IdempotencyConflict"),  # the key's outcome belongs to another request
    (tasks.errors, "OutcomeTimeout"),
    (tasks.errors, "WatcherClosed"),
    (tasks.errors, "ClientClosed"),
    (tasks.errors, "BrokerUnavailable"),  # the broker did not take the message
    (tasks.errors, "TasksError"),
    (tasks.settings, "SettingsError"),  # a client builds its settings from the environment
    (fencing.errors, "BackendUnavailable"),  # the outcomes' database does not answer
]


@pytest.mark.parametrize(("module", "name"), DEFINED, ids=[name for _, name in DEFINED])
def test_a_client_error_imports_from_tasks(module: object, name: str) -> None:
    assert name in tasks.__all__
    assert getattr(tasks, name) is getattr(module, name)


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("ClientClosed", RuntimeError),
        ("WatcherClosed", RuntimeError),
        ("OutcomeTimeout", TimeoutError),
        ("BrokerUnavailable", OperationalError),
    ],
)
def test_the_tasks_errors_share_one_base_and_keep_their_builtin_one(name: str, builtin: type) -> None:
    """``except tasks.TasksError`` catches each; code that caught the builtin base still does."""
    error = getattr(tasks, name)
    assert issubclass(error, tasks.TasksError) and issubclass(error, builtin)
    assert not issubclass(tasks.TasksError, builtin)
