"""The asyncio shell (what it shares with the blocking one is written once in
:mod:`reservations.inventory_base`). ``tests/test_shell_parity.py`` runs the same operations through both
shells and compares what they answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from fencing import AsyncLeaseManager, Lease
from fencing.engines import make_async_engine
from fencing.sql_executor import AsyncSqlExecutor
from reservations import validation as valid
from reservations.inventory_base import InventoryBase, check_manager, lock_order, timeline_args
from reservations.timeline import TimelineEntry, merge


class AsyncInventory(InventoryBase[AsyncSqlExecutor]):
    """The asyncio shell over the same plans as :class:`~reservations.Inventory`."""

    awaits = True

    @classmethod
    def executor_for(
        cls, url: str, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> AsyncSqlExecutor:
        return AsyncSqlExecutor(make_async_engine(url, **options), sleep or asyncio.sleep)

    async def timeline(
        self, sku: str, manager: AsyncLeaseManager, *, limit: int = 1000
    ) -> list[TimelineEntry]:
        scope = timeline_args(manager, AsyncLeaseManager, sku, limit)
        lease_events = await manager.history(scope, limit=limit)
        return merge(lease_events, await self.history(sku, limit=limit))

    @asynccontextmanager
    async def hold_many(
        self,
        manager: AsyncLeaseManager,
        skus: Iterable[str],
        *,
        ttl: float,
        holder: str | None = None,
        wait: float = 0,
        renew_every: float | None = None,
    ) -> AsyncIterator[dict[str, Lease]]:
        check_manager(manager, AsyncLeaseManager)
        async with AsyncExitStack() as stack:
            leases = {}
            for sku in lock_order(skus):
                leases[sku] = await stack.enter_async_context(
                    manager.hold(
                        valid.scope_of(sku), ttl=ttl, holder=holder, wait=wait, renew_every=renew_every
                    )
                )
            yield leases

    async def close(self) -> None:
        await self.executor.close()

    async def __aenter__(self) -> AsyncInventory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
