"""The front door's one way in for every request that changes stock: admit it under its key, record and
publish it once, wait for its outcome as long as the caller asked, and say what is known (each answer and
why: docs/architecture.md, "The HTTP front door"). A database that does not answer while a request is
admitted or looked up is the app's 503: nothing was recorded."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from kombu.exceptions import OperationalError

from fencing import BackendUnavailable
from reservations import AsyncInventory, IdempotencyConflict
from reservations.request_outcomes import RequestResult
from reservations.statuses import RequestStatus
from service.answers import Answer, answer_of, caller_key, location_of, pending, problem
from service.backlog import Backlog, retry_after
from tasks import OutcomeTimeout, ReservationClient, messages
from tasks.producer import request_of

log = logging.getLogger("service.door")

# Retry-After when the broker or the database did not answer: a failover takes seconds.
UNAVAILABLE_RETRY_AFTER = 5
# What does not answer: the database (fencing) or the broker (kombu, after its publish retries).
UNANSWERED = (BackendUnavailable, OperationalError, ConnectionError, TimeoutError)


def unavailable(error: BaseException, *, then: str = "") -> Answer:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    detail = f"the database did not answer{then}: {reason}"
    return problem("unavailable", detail, headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER)}).answer(None)


@dataclass(eq=False)
class Door:
    client: ReservationClient
    inventory: AsyncInventory
    backlog: Backlog
    _: KW_ONLY
    queue_bound: int
    overloaded: Callable[[], None] = lambda: None  # counts a request refused for the queue's depth
    # Set by a stop signal: waits end now with 202 and their Location (see drain).
    draining: bool = False
    _waits: set[asyncio.Future[RequestResult]] = field(default_factory=set, init=False)

    async def submit(
        self,
        name: str,
        key: str,
        args: dict[str, Any],
        *,
        caller: str,
        deadline: float | None,
        wait: float,
        read_at: str,
        sku_hint: str | None = None,
    ) -> Answer:
        """Carry the request of task type ``name`` under the stored ``key`` of the ``caller``'s space to its
        answer, which names the caller's own key and where its outcome is read (``read_at``); ``sku_hint``:
        a confirm's or release's reservation's SKU (:func:`tasks.producer.request_of`)."""
        shown_key = caller_key(caller, key)
        location = location_of(read_at, shown_key)
        message = messages.parse(name, [], {**args, "idempotency_key": key})
        request = request_of(
            name, key, message.args, deadline=deadline, caller=caller, fingerprint=message.fingerprint,
            sku_hint=sku_hint,
        )  # fmt: skip
        if self.backlog.over(self.queue_bound):
            # Not enqueued; a key that has its outcome already is still answered.
            done = await self.inventory.request_outcome(key)
            return self._overloaded() if done is None else self._final(shown_key, done, message, location)
        admitted = await self.client.admit(request)
        admission = admitted.admission
        if admission.outcome is not None:
            return self._final(shown_key, admission.outcome, message, location)
        accepted = admission.accepted
        assert accepted is not None  # an admission without an outcome holds its record
        if not accepted.names(message.operation, message.fingerprint):
            return _reused(shown_key, accepted.operation, location)
        if admitted.unpublished is not None:
            if not isinstance(admitted.unpublished, UNANSWERED):
                raise admitted.unpublished
            # Recorded: the request is accepted, and the relay publishes it once the broker answers.
            log.warning(
                "request %s recorded but not published (the relay will): %s", key, admitted.unpublished
            )
            return pending(shown_key, location)
        waiting = asyncio.ensure_future(self.client.wait(key, timeout=0.0 if self.draining else wait))
        self._waits.add(waiting)
        try:
            result = await waiting
        except OutcomeTimeout:
            return pending(shown_key, location)
        except UNANSWERED as exc:
            # The request is recorded: it goes on, and the same key sent again waits on it.
            return unavailable(exc, then=" while the request, recorded, waited for its outcome")
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not self.draining or (current is not None and current.cancelling()):
                raise  # the caller went away (or the server is cancelling its handlers): not ours to answer
            return pending(shown_key, location)
        finally:
            self._waits.discard(waiting)
        return self._final(shown_key, result, message, location)

    def drain(self) -> None:
        """The process is stopping: every request waiting for its outcome is answered 202 with its Location
        now (it went out already), and later ones do not wait, so the process exits in well under a wait."""
        self.draining = True
        for waiting in list(self._waits):
            waiting.cancel()

    def _final(
        self, shown_key: str, result: RequestResult, message: messages.Message, location: str
    ) -> Answer:
        if not result.belongs_to(message.operation, message.fingerprint):
            return _reused(shown_key, result.operation, location)
        return answer_of(shown_key, result, instance=location, created=True)

    def _overloaded(self) -> Answer:
        self.overloaded()
        depth = self.backlog.depth or 0
        detail = f"{depth} requests are waiting, more than this service's bound of {self.queue_bound}"
        after = retry_after(depth, self.queue_bound, self.backlog.drained_per_second)
        return problem("overloaded", detail, headers={"Retry-After": str(after)}).answer(None)

    async def _seen(self, key: str, shown_key: str) -> RequestResult | None:
        """The key's outcome, or None while a request accepted under it has none; 404 for a key never seen."""
        result = await self.inventory.request_outcome(key)
        if result is None and await self.inventory.accepted(key) is None:
            raise problem("not-found", f"no request was accepted under the key {shown_key!r}")
        return result

    async def look(self, key: str, *, shown_key: str, location: str) -> Answer:
        """``GET`` of a key: its outcome (200 or its problem), 202 while accepted without one, else 404."""
        result = await self._seen(key, shown_key)
        if result is None:
            return pending(shown_key, location)
        return answer_of(shown_key, result, instance=location, created=False)

    async def reservation_under(self, key: str, *, shown_key: str) -> tuple[str, str | None]:
        """The id of the reservation made under ``key``, for confirming or releasing it, and its SKU (the
        lease the worker takes without reading the reservation first), as the reserve's outcome names it."""
        result = await self._seen(key, shown_key)
        under = f"the request under {shown_key!r}"
        if result is None:
            raise problem(
                "not-reserved", f"{under} has no outcome yet", headers={"Retry-After": "1"}, key=shown_key
            )
        ids = result.detail.get("reservation_ids") or []
        if result.status != RequestStatus.RESERVED or len(ids) != 1:
            raise problem("not-reserved", f"{under} ended {result.status}", key=shown_key)
        stock = result.detail.get("stock") or []
        return str(ids[0]), str(stock[0]["sku"]) if len(stock) == 1 else None


def _reused(shown_key: str, stored_operation: str, location: str) -> Answer:
    conflict = IdempotencyConflict(key=shown_key, operation="this request", stored_operation=stored_operation)
    return problem("idempotency-key-reused", str(conflict), key=shown_key).answer(location)
