"""The inventory's asyncio shell: :class:`AsyncInventory`, the same plans as :class:`~reservations.Inventory`
with awaited I/O, each operation in its own transaction. ``tests/test_shell_parity.py`` keeps the two
shells' public methods and parameters the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from fencing import AsyncLeaseManager, Lease
from fencing.engines import make_async_engine
from fencing.sql_executor import AsyncSqlExecutor
from reservations import audit, pending, reads, redrives, requests, schema
from reservations import inventory_base as base
from reservations import validation as valid
from reservations.counting import StockSeen
from reservations.errors import InvalidRequest
from reservations.inventory_base import DEFAULT_IDEMPOTENCY_RETENTION, InventoryBase, lock_order
from reservations.requests import Attempt, RequestResult
from reservations.timeline import TimelineEntry, merge
from reservations.views import ArchivedHistory, HistoryEntry, Outcome, ReservationView, StockLevel


class AsyncInventory(InventoryBase[AsyncSqlExecutor]):
    """The asyncio shell over the same plans as :class:`~reservations.Inventory`."""

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        migrate: bool = False,
        enforce_fence: bool = True,
        before_statement: Callable[[Lease], None] | None = None,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        single_statement: bool | None = None,
        **engine_options: Any,
    ) -> AsyncInventory:
        """As :meth:`Inventory.from_url <reservations.Inventory.from_url>`; ``before_statement`` is called
        (not awaited) just before each fenced statement is sent."""
        if migrate:
            schema.upgrade(url)
        return cls(
            AsyncSqlExecutor(make_async_engine(url, **engine_options), sleep),
            url=url,
            enforce_fence=enforce_fence,
            before_statement=before_statement,
            single_statement=single_statement,
        )

    # writes
    async def add_sku(self, sku: str, *, on_hand: int = 0) -> StockLevel:
        return await self.executor.run(self.plans.add_sku(sku, on_hand))

    async def restock(self, lease: Lease, sku: str, quantity: int, *, key: str) -> Outcome:
        return await self.executor.run(self.plans.restock(lease, sku, quantity, key))

    async def adjust(
        self, lease: Lease, sku: str, delta: int, *, key: str, reason: str | None = None
    ) -> Outcome:
        return await self.executor.run(self.plans.adjust(lease, sku, delta, key, reason))

    async def look(self, lease: Lease, sku: str) -> StockSeen:
        return await self.executor.run(self.plans.look(lease, sku))

    async def count(
        self,
        lease: Lease,
        sku: str,
        counted: int,
        *,
        key: str,
        seen: StockSeen | None = None,
        shrinkage: int | None = None,
    ) -> Outcome:
        plan = self.plans.count(lease, sku, counted, key, seen=seen, shrinkage=shrinkage)
        return await self.executor.run(plan)

    async def replenish(self, lease: Lease, sku: str, par: int, *, key: str, seen: StockSeen) -> Outcome:
        return await self.executor.run(self.plans.replenish(lease, sku, par, key, seen=seen))

    async def reserve(
        self, lease: Lease, sku: str, quantity: int, *, key: str, hold_for: float | None = None
    ) -> Outcome:
        return await self.executor.run(self.plans.reserve(lease, sku, quantity, key, hold_for))

    async def reserve_many(
        self,
        leases: Mapping[str, Lease],
        lines: list[tuple[str, int]],
        *,
        key: str,
        hold_for: float | None = None,
    ) -> Outcome:
        return await self.executor.run(self.plans.reserve_many(leases, lines, key, hold_for))

    async def reserve_request(
        self,
        lease: Lease,
        sku: str,
        quantity: int,
        *,
        key: str,
        hold_for: float | None = None,
        task_id: str | None = None,
        worker: str | None = None,
        epochs: int = 0,
    ) -> requests.RequestReply:
        plan = base.reserve_request(self.plans, lease, sku, quantity, key, hold_for, task_id, worker, epochs)
        return await self.executor.run(plan)

    async def confirm(self, lease: Lease, reservation_id: str, *, key: str) -> Outcome:
        return await self.executor.run(self.plans.confirm(lease, reservation_id, key))

    async def release(self, lease: Lease, reservation_id: str, *, key: str) -> Outcome:
        return await self.executor.run(self.plans.release(lease, reservation_id, key))

    cancel = release

    async def expire_due(self, lease: Lease, sku: str, *, key: str | None = None) -> Outcome:
        return await self.executor.run(self.plans.expire_due(lease, sku, key))

    async def purge_idempotency(self, *, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> int:
        return await self.executor.run(self.plans.purge_idempotency(older_than))

    async def purge_requests(self, *, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> int:
        return await self.executor.run(base.purge_requests(older_than))

    # reads
    async def stock(self, sku: str) -> StockLevel:
        return await self.executor.run(reads.stock_level(sku))

    async def all_stock(self) -> list[StockLevel]:
        return await self.executor.run(reads.all_stock())

    async def reservation(self, id_or_key: str) -> ReservationView:
        return await self.executor.run(reads.reservation(id_or_key))

    async def reservations(
        self,
        sku: str | None = None,
        *,
        status: str | None = None,
        order_key: str | None = None,
        limit: int = 100,
    ) -> list[ReservationView]:
        plan = reads.reservation_list(sku, status=status, order_key=order_key, limit=limit)
        return await self.executor.run(plan)

    async def history(self, sku: str, *, limit: int = 1000, since: float | None = None) -> list[HistoryEntry]:
        return await self.executor.run(reads.history(sku, limit=limit, since=since))

    async def archived(self, sku: str) -> ArchivedHistory | None:
        """What of the SKU's history was archived (``reservations archive``), or None."""
        return await self.executor.run(reads.archived(sku))

    async def rejection_counts(self, *, since: float | None = None) -> dict[str, int]:
        return await self.executor.run(reads.rejection_counts(since))

    async def invariant_violations(self) -> list[audit.Violation]:
        return await self.executor.run(audit.invariant_violations())

    async def request_outcome(self, key: str) -> RequestResult | None:
        return await self.executor.run(requests.request_outcome(key))

    async def own_outcome(self, key: str) -> RequestResult | None:
        """The outcome row written under ``key`` itself: :meth:`request_outcome` without following a
        dead letter to its re-drive."""
        return await self.executor.run(requests.own_outcome(key))

    async def request_outcomes(self, keys: Sequence[str]) -> dict[str, RequestResult]:
        return await self.executor.run(requests.outcomes_of(keys, array=self.dialect == "postgresql"))

    async def record_outcome(
        self, key: str, operation: str, status: str, detail: dict[str, Any], **who: Any
    ) -> RequestResult:
        return await self.executor.run(base.record_outcome(key, operation, status, detail, who))

    async def record_attempt(self, key: str, operation: str, result: str, **who: Any) -> None:
        await self.executor.run(base.record_attempt(key, operation, result, who))

    async def attempts(self, key: str) -> list[Attempt]:
        return await self.executor.run(base.attempts(key))

    # dead letters and their re-drives
    async def dead_letters(
        self, *, since: float | None = None, reason: str | None = None, limit: int = 1000
    ) -> list[redrives.DeadLetter]:
        """Dead-lettered requests, newest first, each with its latest re-drive (reservations.redrives)."""
        return await self.executor.run(redrives.dead_letters(since, reason, limit))

    async def redrives_of(self, key: str) -> list[redrives.RedriveLink]:
        """Every re-drive of the request under ``key``, oldest first."""
        return await self.executor.run(redrives.redrives_of(key))

    async def claim_redrive(
        self, key: str, *, by: str | None = None, dry_run: bool = False
    ) -> redrives.Redrive:
        """Claim the next re-drive of a dead-lettered request (recorded; ``dry_run``: only checked)."""
        return await self.executor.run(redrives.claim(key, by=by, dry_run=dry_run))

    async def drop_redrive(self, redrive_key: str) -> bool:
        """Take back a claimed re-drive that was never sent."""
        return await self.executor.run(redrives.drop(redrive_key))

    async def skus_with_due_holds(self, limit: int = 1000) -> list[str]:
        return await self.executor.run(base.skus_with_due_holds(limit))

    # hot-SKU batching
    async def hand_off(
        self,
        sku: str,
        quantity: int,
        *,
        key: str,
        hold_for: float | None = None,
        task_id: str | None = None,
        epochs: int = 0,
    ) -> pending.HandOff:
        plan = base.hand_off(self.plans, sku, quantity, key, hold_for, task_id, epochs)
        return await self.executor.run(plan)

    async def has_pending(self, sku: str) -> bool:
        return await self.executor.run(pending.has_pending(sku))

    async def pending_count(self, sku: str | None = None) -> int:
        return await self.executor.run(pending.pending_count(sku))

    async def waiting_by_sku(self) -> dict[str, int]:
        return await self.executor.run(pending.waiting_by_sku())

    async def skus_waiting(self, *, older_than: float) -> list[str]:
        return await self.executor.run(pending.skus_waiting(older_than))

    async def purge_ended_waits(self) -> int:
        return await self.executor.run(pending.drop_ended())

    async def serve_pending(
        self,
        lease: Lease,
        sku: str,
        *,
        limit: int = 100,
        task_id: str | None = None,
        worker: str | None = None,
    ) -> list[RequestResult]:
        return await self.executor.run(base.serve_pending(self.plans, lease, sku, limit, task_id, worker))

    async def timeline(
        self, sku: str, manager: AsyncLeaseManager, *, limit: int = 1000
    ) -> list[TimelineEntry]:
        scope = base.timeline_args(manager, AsyncLeaseManager, sku, limit)
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
        if not isinstance(manager, AsyncLeaseManager):
            raise InvalidRequest(
                f"expected an AsyncLeaseManager, got {type(manager).__name__}", field="manager"
            )
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
