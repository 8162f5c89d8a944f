"""PostgreSQL failover: what callers meet while the database's address refuses connections."""

from __future__ import annotations

import time
import uuid

import pytest

from fencing import BackendUnavailable, Lease
from fencing.lease import new_lease_id
from reservations import Inventory
from testing.harness import free_port


def test_a_write_to_a_server_that_refuses_connections_is_unavailable() -> None:
    """As a promotion goes on, the old address refuses connections: a one-statement write (checked out
    of the pool on its own path) says the database is unavailable, as a connection lost mid-statement
    does, so a worker retries it as an outage."""
    lease = Lease("sku:x", 7, new_lease_id(), "drill", 5.0, time.monotonic())
    down = Inventory.from_url(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    with down, pytest.raises(BackendUnavailable, match="database unavailable"):
        down.reserve_request(lease, "x", 1, key=f"k-{uuid.uuid4().hex[:10]}")
