"""Record, then publish: how every producer hands a request to the workers.

The database holds the request; the broker only carries it (reservations.acceptance). So a request is
recorded, whole, before its message is published, and a message lost after that (a worker killed after
fetching it, a broker failover, a retry the broker refused) is published again by the relay
(tasks.relay) from the record, under the same task id. A publish that fails after the record was written
is therefore not a lost request: the caller hears of it (``BrokerUnavailable``), and the relay publishes
it once the broker answers, or ends it ``expired`` or ``dead_lettered``. A record that cannot be written
(the database is down) means nothing was published.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from reservations import Inventory
from reservations import validation as valid
from reservations.acceptance import Request
from reservations.redrives import Redrive
from reservations.request_outcomes import request_id
from tasks.messages import CURRENT_FORMAT, SHAPES, request_fingerprint
from tasks.producer import Producer


def request_of(
    name: str,
    key: str,
    kwargs: Mapping[str, Any],
    *,
    deadline: float | None = None,
    caller: str | None = None,
    fingerprint: str | None = None,
) -> Request:
    """The record of request type ``name`` under ``key`` with the message arguments ``kwargs`` (without the
    key), as this release publishes it; ``fingerprint`` when the caller parsed the message already. No
    I/O."""
    return Request(
        key=valid.idempotency_key(key),
        request_type=name,
        operation=SHAPES[name].operation,
        arguments=dict(kwargs),
        fingerprint=fingerprint or request_fingerprint(name, kwargs),
        task_id=request_id(key),
        message_format=CURRENT_FORMAT,
        deadline=deadline,
        caller=caller,
    )


def publish(
    producer: Producer, request: Request, *, batch: Any = None, enqueued_at: float | None = None
) -> str:
    """Publish a recorded request as it was recorded (same task id, arguments, format and deadline);
    ``batch``: a kombu producer held across many publishes (:meth:`Producer.batch`)."""
    return producer.send(
        request.request_type,
        request.key,
        dict(request.arguments),
        producer=batch,
        enqueued_at=enqueued_at,
        deadline=request.deadline,
        message_format=request.message_format,
    )


class Sender:
    """Records requests in the inventory database, then publishes them through ``producer``.
    ``look_after``: seconds after which the relay first looks at a recorded request without an outcome
    (``RESERVATIONS_REPUBLISH_AFTER``)."""

    def __init__(self, producer: Producer, inventory: Callable[[], Inventory], look_after: float) -> None:
        self.producer = producer
        self._inventory = inventory
        self.look_after = look_after

    def record(self, requests: Sequence[Request]) -> None:
        """Record ``requests`` in one statement (a key recorded already keeps its first record)."""
        self._inventory().record_accepted(requests, self.look_after)

    def send(self, request: Request) -> str:
        """Record ``request``, then publish it; returns its task id."""
        self.record([request])
        return publish(self.producer, request)

    def redrive(self, key: str, *, by: str | None = None) -> tuple[Redrive, str]:
        """Claim the next re-drive of the dead letter under ``key`` (reservations.redrives decides whether it
        may be and under which key), record it and publish it; returns the claim and its task id. The claim
        is dropped again when its record cannot be written (the error is raised), so a later attempt is not
        refused as already running; a publish that fails after it is raised too, and the relay publishes
        the request later."""
        inventory = self._inventory()
        claimed = inventory.claim_redrive(key, by=by)
        request = request_of(claimed.request_type, claimed.key, claimed.arguments)
        try:
            self.record([request])
        except BaseException:
            inventory.drop_redrive(claimed.key)
            raise
        return claimed, publish(self.producer, request)
