"""The inventory's public shells: :class:`Inventory` (blocking, for Celery workers and scripts) and
:class:`AsyncInventory` (asyncio services). Both only drive the plans of :mod:`reservations.operations`
and :mod:`reservations.reads`, each operation in its own transaction.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from typing import Any

from fencing import AsyncLeaseManager, Lease, LeaseManager
from fencing.plan import Plan
from fencing.sql import AsyncSqlExecutor, SyncSqlExecutor, make_async_engine, make_engine, mask_url
from reservations import audit, batching, reads, requests, schema
from reservations import validation as valid
from reservations.errors import InvalidRequest
from reservations.operations import InventoryPlans
from reservations.requests import Attempt, RequestResult
from reservations.reserve_statement import Speaker
from reservations.timeline import TimelineEntry, merge
from reservations.views import HistoryEntry, Outcome, ReservationView, StockLevel

# Idempotency records are kept this long by default; ``purge_idempotency`` deletes older ones. A retry
# or redelivery arriving after its key was purged would be applied again, so keep this well above the
# broker's redelivery horizon (visibility timeout plus the longest retry backoff).
DEFAULT_IDEMPOTENCY_RETENTION = 7 * 24 * 3600.0


def lock_order(skus: Iterable[str]) -> list[str]:
    """The order in which an order's SKU leases are taken: sorted, so two orders cannot deadlock."""
    return sorted(set(valid.skus(skus)))


# The checks of the arguments that the plans of reservations.requests and reservations.batching take
# unchecked, shared by both shells so neither sends a value the database would refuse with a raw error.

_OUTCOME_FIELDS = frozenset({"task_id", "worker", "epochs", "fingerprint"})
_ATTEMPT_FIELDS = frozenset({"task_id", "worker", "token", "detail"})


def _check_who(who: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(who) - allowed)
    if unknown:
        raise InvalidRequest(f"unexpected field(s): {', '.join(unknown)}", field=unknown[0])
    valid.task_and_worker(who.get("task_id"), who.get("worker"))
    if "epochs" in who:
        valid.epochs(who["epochs"])
    if "fingerprint" in who:
        valid.fingerprint(who["fingerprint"])
    if "token" in who:
        valid.token(who["token"])
    if "detail" in who:
        valid.text(who["detail"], field="detail", max_chars=valid.MAX_DETAIL_CHARS)


def _record_outcome(
    key: str, operation: str, status: str, detail: dict[str, Any], who: Mapping[str, Any]
) -> Plan[requests.RequestResult]:
    valid.idempotency_key(key)
    valid.operation(operation)
    valid.detail(detail)
    _check_who(who, _OUTCOME_FIELDS)
    return requests.record_outcome(key, operation, status, detail, **who)


def _record_attempt(key: str, operation: str, result: str, who: Mapping[str, Any]) -> Plan[None]:
    valid.idempotency_key(key)
    valid.operation(operation)
    _check_who(who, _ATTEMPT_FIELDS)
    return requests.record_attempt(key, operation, result, **who)


def _attempts(key: str) -> Plan[list[Attempt]]:
    return requests.attempts(valid.idempotency_key(key))


def _purge_requests(older_than: float) -> Plan[int]:
    return requests.purge(valid.retention(older_than))


def _skus_with_due_holds(limit: int) -> Plan[list[str]]:
    return requests.skus_with_due_holds(valid.limit(limit))


def _hand_off(
    plans: InventoryPlans,
    sku: str,
    quantity: int,
    key: str,
    hold_for: float | None,
    task_id: str | None,
    epochs: int,
) -> Plan[batching.HandOff]:
    valid.task_and_worker(task_id)
    valid.epochs(epochs)
    return batching.hand_off(
        sku, quantity, key, hold_for, task_id=task_id, epochs=epochs, single_statement=plans.single_statement
    )


def _reserve_request(
    plans: InventoryPlans,
    lease: Lease,
    sku: str,
    quantity: int,
    key: str,
    hold_for: float | None,
    task_id: str | None,
    worker: str | None,
    epochs: int,
) -> Plan[requests.RequestReply]:
    valid.task_and_worker(task_id, worker)
    valid.epochs(epochs)
    speaker = Speaker(task_id=task_id, worker=worker, epochs=epochs)
    return plans.reserve_request(lease, sku, quantity, key, hold_for, speaker)


def _serve_pending(
    plans: InventoryPlans, lease: Lease, sku: str, limit: int, task_id: str | None, worker: str | None
) -> Plan[list[RequestResult]]:
    valid.lease(lease)
    valid.task_and_worker(task_id, worker)
    return batching.serve(plans, lease, sku, limit=limit, task_id=task_id, worker=worker)


def _timeline_args(manager: object, kind: type, sku: str, limit: int) -> str:
    if not isinstance(manager, kind):
        raise InvalidRequest(f"expected a {kind.__name__}, got {type(manager).__name__}", field="manager")
    valid.limit(limit)
    return valid.scope_of(valid.sku(sku))


def _single_statement(dialect: str, asked: bool | None) -> bool:
    if asked and dialect != "postgresql":
        raise InvalidRequest("a reservation as one statement needs PostgreSQL", field="single_statement")
    return dialect == "postgresql" if asked is None else asked


class Inventory:
    """Fenced stock operations on one database (SQLite or PostgreSQL)."""

    def __init__(
        self,
        executor: SyncSqlExecutor,
        *,
        url: str = "",
        enforce_fence: bool = True,
        before_statement: Callable[[Lease], None] | None = None,
        single_statement: bool | None = None,
    ) -> None:
        """``single_statement`` (default: on PostgreSQL) sends a single-SKU reservation as one statement;
        False keeps the multi-statement transaction that SQLite uses."""
        self.executor = executor
        self.plans = InventoryPlans(
            enforce_fence=enforce_fence,
            before_statement=before_statement,
            single_statement=_single_statement(executor.engine.dialect.name, single_statement),
        )
        self.url = mask_url(url) if url else ""

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

    def _run(self, plan: Any) -> Any:
        return self.executor.run(plan)

    # writes
    def add_sku(self, sku: str, *, on_hand: int = 0) -> StockLevel:
        return self._run(self.plans.add_sku(sku, on_hand))  # type: ignore[no-any-return]

    def restock(self, lease: Lease, sku: str, quantity: int, *, key: str) -> Outcome:
        return self._run(self.plans.restock(lease, sku, quantity, key))  # type: ignore[no-any-return]

    def adjust(self, lease: Lease, sku: str, delta: int, *, key: str, reason: str | None = None) -> Outcome:
        return self._run(self.plans.adjust(lease, sku, delta, key, reason))  # type: ignore[no-any-return]

    def reserve(
        self, lease: Lease, sku: str, quantity: int, *, key: str, hold_for: float | None = None
    ) -> Outcome:
        return self._run(self.plans.reserve(lease, sku, quantity, key, hold_for))  # type: ignore[no-any-return]

    def reserve_many(
        self,
        leases: Mapping[str, Lease],
        lines: list[tuple[str, int]],
        *,
        key: str,
        hold_for: float | None = None,
    ) -> Outcome:
        return self._run(self.plans.reserve_many(leases, lines, key, hold_for))  # type: ignore[no-any-return]

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
        plan = _reserve_request(self.plans, lease, sku, quantity, key, hold_for, task_id, worker, epochs)
        return self._run(plan)  # type: ignore[no-any-return]

    def confirm(self, lease: Lease, reservation_id: str, *, key: str) -> Outcome:
        return self._run(self.plans.confirm(lease, reservation_id, key))  # type: ignore[no-any-return]

    def release(self, lease: Lease, reservation_id: str, *, key: str) -> Outcome:
        return self._run(self.plans.release(lease, reservation_id, key))  # type: ignore[no-any-return]

    cancel = release

    def expire_due(self, lease: Lease, sku: str, *, key: str | None = None) -> Outcome:
        return self._run(self.plans.expire_due(lease, sku, key))  # type: ignore[no-any-return]

    def purge_idempotency(self, *, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> int:
        return self._run(self.plans.purge_idempotency(older_than))  # type: ignore[no-any-return]

    def purge_requests(self, *, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> int:
        """Delete request outcomes and attempts past the same retention as the idempotency records."""
        return self._run(_purge_requests(older_than))  # type: ignore[no-any-return]

    # reads
    def stock(self, sku: str) -> StockLevel:
        return self._run(reads.stock_level(sku))  # type: ignore[no-any-return]

    def all_stock(self) -> list[StockLevel]:
        return self._run(reads.all_stock())  # type: ignore[no-any-return]

    def reservation(self, id_or_key: str) -> ReservationView:
        return self._run(reads.reservation(id_or_key))  # type: ignore[no-any-return]

    def reservations(
        self,
        sku: str | None = None,
        *,
        status: str | None = None,
        order_key: str | None = None,
        limit: int = 100,
    ) -> list[ReservationView]:
        return self._run(reads.reservation_list(sku, status=status, order_key=order_key, limit=limit))  # type: ignore[no-any-return]

    def history(self, sku: str, *, limit: int = 1000, since: float | None = None) -> list[HistoryEntry]:
        return self._run(reads.history(sku, limit=limit, since=since))  # type: ignore[no-any-return]

    def rejection_counts(self, *, since: float | None = None) -> dict[str, int]:
        return self._run(reads.rejection_counts(since))  # type: ignore[no-any-return]

    def invariant_violations(self) -> list[audit.Violation]:
        return self._run(audit.invariant_violations())  # type: ignore[no-any-return]

    def request_outcome(self, key: str) -> RequestResult | None:
        return self._run(requests.request_outcome(key))  # type: ignore[no-any-return]

    def request_outcomes(self, keys: Sequence[str]) -> dict[str, RequestResult]:
        """Final outcomes of those of ``keys`` (at most 1,000) that have one, in one read."""
        return self._run(requests.outcomes_of(keys))  # type: ignore[no-any-return]

    def record_outcome(
        self, key: str, operation: str, status: str, detail: dict[str, Any], **who: Any
    ) -> RequestResult:
        return self._run(_record_outcome(key, operation, status, detail, who))  # type: ignore[no-any-return]

    def record_attempt(self, key: str, operation: str, result: str, **who: Any) -> None:
        self._run(_record_attempt(key, operation, result, who))

    def attempts(self, key: str) -> list[Attempt]:
        return self._run(_attempts(key))  # type: ignore[no-any-return]

    def skus_with_due_holds(self, limit: int = 1000) -> list[str]:
        return self._run(_skus_with_due_holds(limit))  # type: ignore[no-any-return]

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
    ) -> batching.HandOff:
        """Queue a reservation for the SKU's lease holder (or find the outcome it already has)."""
        return self._run(_hand_off(self.plans, sku, quantity, key, hold_for, task_id, epochs))  # type: ignore[no-any-return]

    def has_pending(self, sku: str) -> bool:
        return self._run(batching.has_pending(sku))  # type: ignore[no-any-return]

    def pending_count(self, sku: str | None = None) -> int:
        return self._run(batching.pending_count(sku))  # type: ignore[no-any-return]

    def waiting_by_sku(self) -> dict[str, int]:
        return self._run(batching.waiting_by_sku())  # type: ignore[no-any-return]

    def skus_waiting(self, *, older_than: float) -> list[str]:
        """SKUs with a request waiting for its holder longer than ``older_than`` seconds."""
        return self._run(batching.skus_waiting(older_than))  # type: ignore[no-any-return]

    def purge_ended_waits(self) -> int:
        return self._run(batching.drop_ended())  # type: ignore[no-any-return]

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
        return self._run(_serve_pending(self.plans, lease, sku, limit, task_id, worker))  # type: ignore[no-any-return]

    def timeline(self, sku: str, manager: LeaseManager, *, limit: int = 1000) -> list[TimelineEntry]:
        """Lease events, accepted writes and rejections of ``sku`` as one ordered timeline."""
        scope = _timeline_args(manager, LeaseManager, sku, limit)
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


class AsyncInventory:
    """The asyncio shell over the same plans."""

    def __init__(
        self,
        executor: AsyncSqlExecutor,
        *,
        url: str = "",
        enforce_fence: bool = True,
        single_statement: bool | None = None,
    ) -> None:
        self.executor = executor
        self.plans = InventoryPlans(
            enforce_fence=enforce_fence,
            single_statement=_single_statement(executor.engine.dialect.name, single_statement),
        )
        self.url = mask_url(url) if url else ""

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        migrate: bool = False,
        enforce_fence: bool = True,
        sleep: Callable[[float], Any] = asyncio.sleep,
        single_statement: bool | None = None,
        **engine_options: Any,
    ) -> AsyncInventory:
        if migrate:
            schema.upgrade(url)
        return cls(
            AsyncSqlExecutor(make_async_engine(url, **engine_options), sleep),
            url=url,
            enforce_fence=enforce_fence,
            single_statement=single_statement,
        )

    async def _run(self, plan: Any) -> Any:
        return await self.executor.run(plan)

    async def add_sku(self, sku: str, *, on_hand: int = 0) -> StockLevel:
        return await self._run(self.plans.add_sku(sku, on_hand))  # type: ignore[no-any-return]

    async def restock(self, lease: Lease, sku: str, quantity: int, *, key: str) -> Outcome:
        return await self._run(self.plans.restock(lease, sku, quantity, key))  # type: ignore[no-any-return]

    async def adjust(
        self, lease: Lease, sku: str, delta: int, *, key: str, reason: str | None = None
    ) -> Outcome:
        return await self._run(self.plans.adjust(lease, sku, delta, key, reason))  # type: ignore[no-any-return]

    async def reserve(
        self, lease: Lease, sku: str, quantity: int, *, key: str, hold_for: float | None = None
    ) -> Outcome:
        return await self._run(self.plans.reserve(lease, sku, quantity, key, hold_for))  # type: ignore[no-any-return]

    async def reserve_many(
        self,
        leases: Mapping[str, Lease],
        lines: list[tuple[str, int]],
        *,
        key: str,
        hold_for: float | None = None,
    ) -> Outcome:
        return await self._run(self.plans.reserve_many(leases, lines, key, hold_for))  # type: ignore[no-any-return]

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
        plan = _reserve_request(self.plans, lease, sku, quantity, key, hold_for, task_id, worker, epochs)
        return await self._run(plan)  # type: ignore[no-any-return]

    async def confirm(self, lease: Lease, reservation_id: str, *, key: str) -> Outcome:
        return await self._run(self.plans.confirm(lease, reservation_id, key))  # type: ignore[no-any-return]

    async def release(self, lease: Lease, reservation_id: str, *, key: str) -> Outcome:
        return await self._run(self.plans.release(lease, reservation_id, key))  # type: ignore[no-any-return]

    cancel = release

    async def expire_due(self, lease: Lease, sku: str, *, key: str | None = None) -> Outcome:
        return await self._run(self.plans.expire_due(lease, sku, key))  # type: ignore[no-any-return]

    async def purge_idempotency(self, *, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> int:
        return await self._run(self.plans.purge_idempotency(older_than))  # type: ignore[no-any-return]

    async def stock(self, sku: str) -> StockLevel:
        return await self._run(reads.stock_level(sku))  # type: ignore[no-any-return]

    async def all_stock(self) -> list[StockLevel]:
        return await self._run(reads.all_stock())  # type: ignore[no-any-return]

    async def reservation(self, id_or_key: str) -> ReservationView:
        return await self._run(reads.reservation(id_or_key))  # type: ignore[no-any-return]

    async def reservations(
        self,
        sku: str | None = None,
        *,
        status: str | None = None,
        order_key: str | None = None,
        limit: int = 100,
    ) -> list[ReservationView]:
        return await self._run(reads.reservation_list(sku, status=status, order_key=order_key, limit=limit))  # type: ignore[no-any-return]

    async def history(self, sku: str, *, limit: int = 1000, since: float | None = None) -> list[HistoryEntry]:
        return await self._run(reads.history(sku, limit=limit, since=since))  # type: ignore[no-any-return]

    async def rejection_counts(self, *, since: float | None = None) -> dict[str, int]:
        return await self._run(reads.rejection_counts(since))  # type: ignore[no-any-return]

    async def invariant_violations(self) -> list[audit.Violation]:
        return await self._run(audit.invariant_violations())  # type: ignore[no-any-return]

    async def request_outcome(self, key: str) -> RequestResult | None:
        return await self._run(requests.request_outcome(key))  # type: ignore[no-any-return]

    async def request_outcomes(self, keys: Sequence[str]) -> dict[str, RequestResult]:
        return await self._run(requests.outcomes_of(keys))  # type: ignore[no-any-return]

    async def record_outcome(
        self, key: str, operation: str, status: str, detail: dict[str, Any], **who: Any
    ) -> RequestResult:
        return await self._run(_record_outcome(key, operation, status, detail, who))  # type: ignore[no-any-return]

    async def attempts(self, key: str) -> list[Attempt]:
        return await self._run(_attempts(key))  # type: ignore[no-any-return]

    async def hand_off(
        self,
        sku: str,
        quantity: int,
        *,
        key: str,
        hold_for: float | None = None,
        task_id: str | None = None,
        epochs: int = 0,
    ) -> batching.HandOff:
        return await self._run(_hand_off(self.plans, sku, quantity, key, hold_for, task_id, epochs))  # type: ignore[no-any-return]

    async def pending_count(self, sku: str | None = None) -> int:
        return await self._run(batching.pending_count(sku))  # type: ignore[no-any-return]

    async def serve_pending(
        self,
        lease: Lease,
        sku: str,
        *,
        limit: int = 100,
        task_id: str | None = None,
        worker: str | None = None,
    ) -> list[RequestResult]:
        return await self._run(_serve_pending(self.plans, lease, sku, limit, task_id, worker))  # type: ignore[no-any-return]

    async def timeline(
        self, sku: str, manager: AsyncLeaseManager, *, limit: int = 1000
    ) -> list[TimelineEntry]:
        scope = _timeline_args(manager, AsyncLeaseManager, sku, limit)
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
    ) -> AsyncIterator[dict[str, Lease]]:
        if not isinstance(manager, AsyncLeaseManager):
            raise InvalidRequest(
                f"expected an AsyncLeaseManager, got {type(manager).__name__}", field="manager"
            )
        async with AsyncExitStack() as stack:
            leases = {}
            for sku in lock_order(skus):
                leases[sku] = await stack.enter_async_context(
                    manager.hold(valid.scope_of(sku), ttl=ttl, holder=holder, wait=wait)
                )
            yield leases

    async def close(self) -> None:
        await self.executor.close()

    async def __aenter__(self) -> AsyncInventory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
