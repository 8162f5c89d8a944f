"""The errors the tasks floor raises of its own, under one base, :class:`TasksError`, so a producer can
catch "anything the client itself refused" in one clause (the classes below, and
:class:`tasks.answers.Redriven`, a worker's retry reason after a lost lease). Each keeps the builtin or
library base it had (``RuntimeError``, ``TimeoutError``, kombu's ``OperationalError``): code that caught
those still does. Errors of the floors below keep theirs: the request refused before publishing
(``InvalidRequest``), a key used for another request (``IdempotencyConflict``), an unreachable database
(``BackendUnavailable``), bad settings (``SettingsError``).
"""

from __future__ import annotations

from kombu.exceptions import OperationalError


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


class BrokerUnavailable(TasksError, OperationalError):
    """The broker did not take the message: no connection after the publish retries. The request was
    recorded before it was published, so it is not lost: the relay (tasks.relay, in every worker)
    publishes it once the broker answers, and enqueueing the same key again names the same request."""

    @classmethod
    def of(cls, error: OperationalError) -> BrokerUnavailable:
        """kombu's error, mapped at the client's boundary; a new instance per caller, caused by it."""
        own = cls(*error.args)
        own.__cause__ = error
        return own
