"""The inventory's public shells: :class:`Inventory` (blocking, for Celery workers and scripts) here, and
:class:`AsyncInventory` (asyncio services) in :mod:`reservations.async_inventory`. Both only drive the
plans of :mod:`reservations.operations` and :mod:`reservations.reads`, each operation in its own transaction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from fencing import Lease, LeaseManager
from fencing.engines import make_engine
from fencing.sql_executor import SyncSqlExecutor
from reservations import audit, pending, reads, redrives, requests, schema
from reservations import inventory_base as base
from reservations import validation as valid
from reservations.async_inventory import AsyncInventory
from reservations.counting import StockSeen
from reservations.errors import InvalidRequest
from reservations.inventory_base import DEFAULT_IDEMPOTENCY_RETENTION, InventoryBase, lock_order
from reservations.requests import Attempt, RequestResult
from reservations.timeline import TimelineEntry, merge
from reservations.views import ArchivedHistory, HistoryEntry, Outcome, ReservationView, StockLevel

__all__ = ["DEFAULT_IDEMPOTENCY_RETENTION", "AsyncInventory", "Inventory", "lock_order"]


class Inventory(InventoryBase[SyncSqlExecutor]):
    """Fenced stock operations on one database (SQLite or PostgreSQL)."""

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        migrate: bool = False,
        enforce_fence: bool = True,
        before_statement: Callable[[Lease], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        single_statement: bool | None = None,
        **engine_options: Any,
    ) -> Inventory:
        """``migrate=True`` brings the schema to the newest revision first (embedded use, tests).

        ``before_statement`` runs just before each fenced statement is sent (fault injection).
        """
        if migrate:
            schema.upgrade(url)
        return cls(
            SyncSqlExecutor(make_engine(url, **engine_options), sleep),
            url=url,
            enforce_fence=enforce_fence,
            before_statement=before_statement,
            single_statement=single_statement,
        )

    # writes
    def add_sku(self, sku: str, *, on_hand: int = 0) -> StockLevel:
        return self.executor.run(self.plans.add_sku(sku, on_hand))

    def restock(self, lease: Lease, sku: str, quantity: int, *, key: str) -> Outcome:
        return self.executor.run(self.plans.restock(lease, sku, quantity, key))

    def adjust(self, lease: Lease, sku: str, delta: int, *, key: str, reason: str | None = None) -> Outcome:
        return self.executor.run(self.plans.adjust(lease, sku, delta, key, reason))

    def look(self, lease: Lease, sku: str) -> StockSeen:
        """The SKU's stock and version read under ``lease``, to decide a count or a replenishment from. The
        row's fence rises to the lease's token, so no older epoch can write between this read and the write
        decided from it."""
        return self.executor.run(self.plans.look(lease, sku))

    def count(
        self,
        lease: Lease,
        sku: str,
        counted: int,
        *,
        key: str,
        seen: StockSeen | None = None,
        shrinkage: int | None = None,
    ) -> Outcome:
        """A cycle count: on hand becomes ``counted``; ``seen`` (:meth:`look`) is what it was decided from,
        ``shrinkage`` says the figure was decided from ``seen`` rather than sent."""
        plan = self.plans.count(lease, sku, counted, key, seen=seen, shrinkage=shrinkage)
        return self.executor.run(plan)

    def replenish(self, lease: Lease, sku: str, par: int, *, key: str, seen: StockSeen) -> Outcome:
        """Books ``par`` minus the on-hand figure ``seen`` (none at or above par) as a restock."""
        return self.executor.run(self.plans.replenish(lease, sku, par, key, seen=seen))

    def reserve(
        self, lease: Lease, sku: str, quantity: int, *, key: str, hold_for: float | None = None
    ) -> Outcome:
        return self.executor.run(self.plans.reserve(lease, sku, quantity, key, hold_for))

    def reserve_many(
        self,
        leases: Mapping[str, Lease],
        lines: list[tuple[str, int]],
        *,
        key: str,
        hold_for: float | None = None,
    ) -> Outcome:
        return self.executor.run(self.plans.reserve_many(leases, lines, key, hold_for))

    def reserve_request(
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
        """:meth:`reserve` for a queued request: also writes its attempt and final outcome (one statement
        on PostgreSQL), or answers from the outcome it already has."""
        plan = base.reserve_request(self.plans, lease, sku, quantity, key, hold_for, task_id, worker, epochs)
        return self.executor.run(plan)

    def confirm(self, lease: Lease, reservation_id: str, *, key: str) -> Outcome:
        return self.executor.run(self.plans.confirm(lease, reservation_id, key))

    def release(self, lease: Lease, reservation_id: str, *, key: str) -> Outcome:
        return self.executor.run(self.plans.release(lease, reservation_id, key))

    cancel = release

    def expire_due(self, lease: Lease, sku: str, *, key: str | None = None) -> Outcome:
        return self.executor.run(self.plans.expire_due(lease, sku, key))

    def purge_idempotency(self, *, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> int:
        return self.executor.run(self.plans.purge_idempotency(older_than))

    def purge_requests(self, *, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> int:
        """Delete request outcomes and attempts past the same retention as the idempotency records."""
        return self.executor.run(base.purge_requests(older_than))

    # reads
    def stock(self, sku: str) -> StockLevel:
        return self.executor.run(reads.stock_level(sku))

    def all_stock(self) -> list[StockLevel]:
        return self.executor.run(reads.all_stock())

    def reservation(self, id_or_key: str) -> ReservationView:
        return self.executor.run(reads.reservation(id_or_key))

    def reservations(
        self,
        sku: str | None = None,
        *,
        status: str | None = None,
        order_key: str | None = None,
        limit: int = 100,
    ) -> list[ReservationView]:
        return self.executor.run(reads.reservation_list(sku, status=status, order_key=order_key, limit=limit))

    def history(self, sku: str, *, limit: int = 1000, since: float | None = None) -> list[HistoryEntry]:
        return self.executor.run(reads.history(sku, limit=limit, since=since))

    def archived(self, sku: str) -> ArchivedHistory | None:
        """What of the SKU's history was archived (``reservations archive``), or None."""
        return self.executor.run(reads.archived(sku))

    def rejection_counts(self, *, since: float | None = None) -> dict[str, int]:
        return self.executor.run(reads.rejection_counts(since))

    def invariant_violations(self) -> list[audit.Violation]:
        return self.executor.run(audit.invariant_violations())

    def request_outcome(self, key: str) -> RequestResult | None:
        return self.executor.run(requests.request_outcome(key))

    def own_outcome(self, key: str) -> RequestResult | None:
        """The outcome row written under ``key`` itself: :meth:`request_outcome` without following a
        dead letter to its re-drive."""
        return self.executor.run(requests.own_outcome(key))

    def request_outcomes(self, keys: Sequence[str]) -> dict[str, RequestResult]:
        """Final outcomes of those of ``keys`` (at most 1,000) that have one, in one read."""
        return self.executor.run(requests.outcomes_of(keys, array=self.dialect == "postgresql"))

    def record_outcome(
        self, key: str, operation: str, status: str, detail: dict[str, Any], **who: Any
    ) -> RequestResult:
        return self.executor.run(base.record_outcome(key, operation, status, detail, who))

    def record_attempt(self, key: str, operation: str, result: str, **who: Any) -> None:
        self.executor.run(base.record_attempt(key, operation, result, who))

    def attempts(self, key: str) -> list[Attempt]:
        return self.executor.run(base.attempts(key))

    # dead letters and their re-drives
    def dead_letters(
        self, *, since: float | None = None, reason: str | None = None, limit: int = 1000
    ) -> list[redrives.DeadLetter]:
        """Dead-lettered requests, newest first, each with its latest re-drive (reservations.redrives)."""
        return self.executor.run(redrives.dead_letters(since, reason, limit))

    def redrives_of(self, key: str) -> list[redrives.RedriveLink]:
        """Every re-drive of the request under ``key``, oldest first."""
        return self.executor.run(redrives.redrives_of(key))

    def claim_redrive(self, key: str, *, by: str | None = None, dry_run: bool = False) -> redrives.Redrive:
        """Claim the next re-drive of a dead-lettered request (recorded; ``dry_run``: only checked)."""
        return self.executor.run(redrives.claim(key, by=by, dry_run=dry_run))

    def drop_redrive(self, redrive_key: str) -> bool:
        """Take back a claimed re-drive that was never sent."""
        return self.executor.run(redrives.drop(redrive_key))

    def skus_with_due_holds(self, limit: int = 1000) -> list[str]:
        return self.executor.run(base.skus_with_due_holds(limit))

    # hot-SKU batching
    def hand_off(
        self,
        sku: str,
        quantity: int,
        *,
        key: str,
        hold_for: float | None = None,
        task_id: str | None = None,
        epochs: int = 0,
    ) -> pending.HandOff:
        """Queue a reservation for the SKU's lease holder (or find the outcome it already has)."""
        return self.executor.run(base.hand_off(self.plans, sku, quantity, key, hold_for, task_id, epochs))

    def has_pending(self, sku: str) -> bool:
        return self.executor.run(pending.has_pending(sku))

    def pending_count(self, sku: str | None = None) -> int:
        return self.executor.run(pending.pending_count(sku))

    def waiting_by_sku(self) -> dict[str, int]:
        return self.executor.run(pending.waiting_by_sku())

    def skus_waiting(self, *, older_than: float) -> list[str]:
        """SKUs with a request waiting for its holder longer than ``older_than`` seconds."""
        return self.executor.run(pending.skus_waiting(older_than))

    def purge_ended_waits(self) -> int:
        return self.executor.run(pending.drop_ended())

    def serve_pending(
        self,
        lease: Lease,
        sku: str,
        *,
        limit: int = 100,
        task_id: str | None = None,
        worker: str | None = None,
    ) -> list[RequestResult]:
        """Serve up to ``limit`` pending reservations of ``sku`` in one fenced transaction."""
        return self.executor.run(base.serve_pending(self.plans, lease, sku, limit, task_id, worker))

    def timeline(self, sku: str, manager: LeaseManager, *, limit: int = 1000) -> list[TimelineEntry]:
        """Lease events, accepted writes and rejections of ``sku`` as one ordered timeline."""
        scope = base.timeline_args(manager, LeaseManager, sku, limit)
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
        if not isinstance(manager, LeaseManager):
            raise InvalidRequest(f"expected a LeaseManager, got {type(manager).__name__}", field="manager")
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
