"""The blocking shell, for Celery workers and scripts; the asyncio one, :class:`AsyncInventory`, is exported
here too. What they share is written once in :mod:`reservations.inventory_base`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from fencing import Lease, LeaseManager
from fencing.engines import make_engine
from fencing.sql_executor import SyncSqlExecutor
from reservations import validation as valid
from reservations.async_inventory import AsyncInventory
from reservations.inventory_base import InventoryBase, check_manager, lock_order, timeline_args
from reservations.request_outcomes import DEFAULT_IDEMPOTENCY_RETENTION
from reservations.timeline import TimelineEntry, merge

__all__ = ["DEFAULT_IDEMPOTENCY_RETENTION", "AsyncInventory", "Inventory", "lock_order"]


class Inventory(InventoryBase[SyncSqlExecutor]):
    """Fenced stock operations on one database (SQLite or PostgreSQL)."""

    @classmethod
    def executor_for(
        cls, url: str, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> SyncSqlExecutor:
        return SyncSqlExecutor(make_engine(url, **options), sleep or time.sleep)

    def timeline(self, sku: str, manager: LeaseManager, *, limit: int = 1000) -> list[TimelineEntry]:
        """Lease events, accepted writes and rejections of ``sku`` as one ordered timeline."""
        scope = timeline_args(manager, LeaseManager, sku, limit)
        return merge(manager.history(scope, limit=limit), self.history(sku, limit=limit))

    @contextmanager
    def hold_many(
        self,
        manager: LeaseManager,
        skus: Iterable[str],
        *,
        ttl: float,
        holder: str | None = None,
        wait: float = 0,
        renew_every: float | None = None,
    ) -> Iterator[dict[str, Lease]]:
        """Hold the leases of several SKUs, taken in :func:`lock_order`, for :meth:`reserve_many`."""
        check_manager(manager, LeaseManager)
        with ExitStack() as stack:
            yield {
                sku: stack.enter_context(
                    manager.hold(
                        valid.scope_of(sku), ttl=ttl, holder=holder, wait=wait, renew_every=renew_every
                    )
                )
                for sku in lock_order(skus)
            }

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> Inventory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
