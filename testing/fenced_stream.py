"""Fenced writes under leases while a lease store fails over: workers that lease a SKU and write under it
over and over, and what their writes must show afterwards (no token accepted backwards)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from fencing import BackendUnavailable, Lease, LeaseBusy, LeaseManager, LostOwnership, StaleToken
from reservations import Inventory, scope_of
from reservations.models import sku_history


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def inventory_on(folder: Path, *skus: str, on_hand: int = 1000, fenced: bool = True) -> Inventory:
    """A migrated SQLite inventory holding ``skus``; ``fenced=False`` is lease-only protection, which a
    test of the fence must catch letting a stale token write."""
    url = f"sqlite:///{folder / 'inventory.sqlite3'}"
    inventory = Inventory.from_url(url, migrate=True, enforce_fence=fenced)
    for sku in skus:
        inventory.add_sku(sku, on_hand=on_hand)
    return inventory


def accepted_tokens(inventory: Inventory, sku: str) -> list[tuple[int, str | None]]:
    """(token, lease id) of every write the SKU's row accepted under a lease, in the order it accepted
    them (adding the SKU wrote with none, token 0): read from the history table itself, as a stream
    writes more than Inventory.history hands out at once."""
    query = (
        sa.select(sku_history.c.token, sku_history.c.lease_id)
        .where(sku_history.c.sku == sku, sku_history.c.kind == "write", sku_history.c.token > 0)
        .order_by(sku_history.c.id)
    )
    with inventory.executor.engine.connect() as conn:
        return [(row.token, row.lease_id) for row in conn.execute(query)]


def assert_never_backwards(accepted: list[tuple[int, str | None]]) -> None:
    """Each accepted write's token is at least the one before, and a token writes for one lease only."""
    for (token, lease_id), (after, after_id) in pairwise(accepted):
        assert after > token or (after == token and after_id == lease_id), (token, after)


# What a caller may meet from a lease or a fenced write while its coordinator fails over; anything else is
# a bug.
TYPED = (LeaseBusy, LostOwnership, BackendUnavailable)


@dataclass
class Stream:
    """Workers that take a SKU's lease and write under it (reserve one unit, restock one), over and over,
    each with a lease manager of its own as separate worker processes would have, until stopped. Every
    call is timed and its outcome kept; a stale rejection goes to the repair, as LeaseManager.hold does."""

    leases: Callable[[], LeaseManager]
    inventory: Inventory
    skus: tuple[str, ...]
    ttl: float = 3.0
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: Counter[str] = field(default_factory=Counter)
    slowest: dict[str, float] = field(default_factory=dict)
    acquired: list[float] = field(default_factory=list)  # when each acquisition returned (monotonic)
    writes: list[float] = field(default_factory=list)  # when each accepted write returned
    untyped: list[BaseException] = field(default_factory=list)
    repairs: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    MAX_CYCLES = 1_000_000  # per worker: far more than a run takes, so only the stop ends a worker

    def run(self, workers: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._worker, args=(f"w{i}",)) for i in range(workers)]
        for thread in threads:
            thread.start()
        return threads

    def assert_kept_order(self) -> None:
        """What the stream's writes must show, whatever its coordinator went through: every call ended in
        success or a typed error, no row accepted a token backwards, each row holds its last accepted
        token, and the inventory's invariants hold."""
        assert self.untyped == []
        for sku in self.skus:
            accepted = accepted_tokens(self.inventory, sku)
            assert_never_backwards(accepted)
            assert self.inventory.stock(sku).fence_token == accepted[-1][0]
        assert self.inventory.invariant_violations() == []

    def written(self) -> int:
        with self._lock:
            return len(self.writes)

    def writes_since(self, moment: float) -> int:
        with self._lock:
            return sum(1 for at in self.writes if at > moment)

    def first_lease_after(self, moment: float) -> float:
        """How long after ``moment`` the coordinator handed out a lease again."""
        with self._lock:
            return min(at for at in self.acquired if at > moment) - moment

    def _worker(self, holder: str) -> None:
        leases = self.leases()
        try:
            for cycle in range(self.MAX_CYCLES):
                if self.stop.is_set():
                    return
                # Each SKU is reserved from and restocked in turn, so none runs out however many cycles a
                # slow machine makes before the failovers.
                sku, turn = self.skus[cycle % len(self.skus)], cycle // len(self.skus)
                self._cycle(leases, sku, holder, restock=turn % 2 == 1)
        except BaseException as exc:  # recorded for the test to fail on
            with self._lock:
                self.untyped.append(exc)
        finally:
            leases.close()

    def _cycle(self, leases: LeaseManager, sku: str, holder: str, *, restock: bool) -> None:
        scope, key = scope_of(sku), unique("k-")
        try:
            lease: Lease = self._timed(
                "acquire", partial(leases.acquire, scope, ttl=self.ttl, holder=holder, wait=0.2)
            )
        except TYPED:
            return
        write = self.inventory.restock if restock else self.inventory.reserve
        try:
            self._timed("write", partial(write, lease, sku, 1, key=key))
        except StaleToken as exc:
            with suppress(*TYPED):
                repaired = self._timed("repair", partial(leases.handle_stale, lease, exc))
                with self._lock:
                    self.repairs += repaired
        except TYPED:
            pass
        finally:
            if not lease.lost:
                with suppress(*TYPED):
                    self._timed("release", partial(leases.release, lease))

    def _timed(self, call: str, run: Callable[[], Any]) -> Any:
        started = time.monotonic()
        outcome = "ok"
        try:
            return run()
        except TYPED as exc:
            outcome = type(exc).__name__
            raise
        finally:
            done = time.monotonic()
            with self._lock:
                self.outcomes[f"{call} {outcome}"] += 1
                self.slowest[call] = max(self.slowest.get(call, 0.0), done - started)
                if outcome == "ok" and call in ("acquire", "write"):
                    (self.acquired if call == "acquire" else self.writes).append(done)
