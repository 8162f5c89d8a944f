"""The errors the tasks floor raises of its own, under one base, :class:`TasksError`, so a producer can
catch "anything the client itself refused" in one clause. Each keeps the builtin base it had
(``RuntimeError``, ``TimeoutError``): code that caught those still does. Errors of the floors below
(``InvalidRequest``, ``IdempotencyConflict``, ``BackendUnavailable``) keep theirs.
"""

from __future__ import annotations


class TasksError(Exception):
    """Base of the errors of the ``tasks`` package."""


class ClientClosed(TasksError, RuntimeError):
    """The client was closed: it publishes and watches nothing more."""


class WatcherClosed(TasksError, RuntimeError):
    """The client was closed while a handle still waited for its outcome."""


class OutcomeTimeout(TasksError, TimeoutError):
    """No final outcome for ``key`` within the wait; the request may still end (wait again, or read it)."""

    def __init__(self, key: str, timeout: float) -> None:
        self.key = key
        super().__init__(f"no final outcome for {key!r} within {timeout}s")
