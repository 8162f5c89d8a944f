"""Cancelling a recorded request (``Inventory.cancel_request``, the console's cancel): a new final status,
decided first-wins by the key's own records, on SQLite and PostgreSQL. Once cancelled, no copy of the
request touches stock, through the worker's request path or the write alone; a request decided first
keeps its outcome, and one applied but not yet answered is refused as such.
"""

from __future__ import annotations

import itertools

import pytest

from fencing import LeaseManager
from reservations import InvalidRequest, Inventory, RequestClosed
from reservations import validation as valid
from reservations.request_outcomes import AlreadyApplied
from reservations.statuses import RequestStatus
from tasks.producer import request_of

_keys = itertools.count()


def recorded(inventory: Inventory, sku: str, quantity: int) -> str:
    key = f"cancel-{next(_keys)}"
    inventory.record_accepted([request_of("reserve", key, {"sku": sku, "quantity": quantity})], 60)
    return key


def test_a_cancelled_request_touches_no_stock_whichever_copy_comes(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku("CAN", on_hand=10)
    key = recorded(inventory, "CAN", 4)
    ended = inventory.cancel_request(key, by="ann", reason="customer called")
    assert (ended.status, ended.detail) == (
        RequestStatus.CANCELLED,
        {"reason": "customer called", "by": "ann"},
    )
    # First wins: a second cancel is answered with the first.
    assert inventory.cancel_request(key, by="bob", reason="again") == ended
    with leases.hold(valid.scope_of("CAN"), ttl=30) as lease:
        # A worker carrying the request after the cancel: answered with the cancel, nothing written.
        reply = inventory.reserve_request(lease, "CAN", 4, key=key, task_id="t-1", worker="w:1")
        assert reply.result == ended
        # The write alone, as a copy racing the outcome would send it: the key's tombstone refuses it.
        with pytest.raises(RequestClosed):
            inventory.reserve(lease, "CAN", 4, key=key)
    level = inventory.stock("CAN")
    assert (level.on_hand, level.reserved) == (10, 0)
    assert inventory.request_outcome(key) == ended


def test_a_request_decided_first_keeps_its_outcome(inventory: Inventory, leases: LeaseManager) -> None:
    inventory.add_sku("KEEP", on_hand=10)
    served, applied = recorded(inventory, "KEEP", 2), recorded(inventory, "KEEP", 3)
    with leases.hold(valid.scope_of("KEEP"), ttl=30) as lease:
        done = inventory.reserve_request(lease, "KEEP", 2, key=served, task_id="t-2", worker="w:1").result
        # Applied, its outcome not recorded yet (a worker killed between the two): not cancellable.
        inventory.reserve(lease, "KEEP", 3, key=applied)
    assert done.status == RequestStatus.RESERVED
    assert inventory.cancel_request(served, by="ann", reason="too late") == done
    with pytest.raises(AlreadyApplied):
        inventory.cancel_request(applied, by="ann", reason="too late")
    assert inventory.request_outcome(applied) is None
    assert inventory.stock("KEEP").reserved == 5


def test_cancel_refuses_what_it_cannot_do(inventory: Inventory) -> None:
    with pytest.raises(InvalidRequest, match="no request is recorded"):
        inventory.cancel_request("never-recorded", by="ann", reason="x")
    inventory.add_sku("BAD", on_hand=1)
    key = recorded(inventory, "BAD", 1)
    with pytest.raises(InvalidRequest):
        inventory.cancel_request(key, by="ann", reason="r" * 10_000)
    assert inventory.request_outcome(key) is None
