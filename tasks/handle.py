"""A handle on one enqueued request: its key and task id, and the request it names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from reservations import IdempotencyConflict
from reservations.requests import RequestResult


class Outcomes(Protocol):
    """Where a handle waits for its outcome: the client that enqueued it (tasks.client)."""

    async def wait(self, key: str, *, timeout: float) -> RequestResult: ...

    def wait_sync(self, key: str, *, timeout: float) -> RequestResult: ...


@dataclass(frozen=True)
class ReservationHandle:
    """One enqueued request. ``result`` raises :class:`IdempotencyConflict` when the outcome under its key
    belongs to a different request (the key was used first with other arguments)."""

    key: str
    task_id: str
    client: Outcomes
    operation: str | None = None
    fingerprint: str | None = None

    async def result(self, timeout: float = 30.0) -> RequestResult:
        return self._own(await self.client.wait(self.key, timeout=timeout))

    def result_sync(self, timeout: float = 30.0) -> RequestResult:
        return self._own(self.client.wait_sync(self.key, timeout=timeout))

    def _own(self, stored: RequestResult) -> RequestResult:
        """The outcome, when it is this request's: the one decision both shells share."""
        if self.operation is None or self.fingerprint is None:
            return stored
        if not stored.belongs_to(self.operation, self.fingerprint):
            raise IdempotencyConflict(
                key=self.key, operation=self.operation, stored_operation=stored.operation
            )
        return stored
