"""The inventory's two shells, :class:`Inventory` (blocking, for Celery workers and scripts) and
:class:`AsyncInventory` (asyncio), over :class:`InventoryBase`, which holds each operation once as the plan
it runs (with the checks of who a queued request speaks for, which the request plans take unchecked).
The shells write only what differs in kind: the executor, the lease timeline and ``hold_many`` (which use
a lease manager of their own kind), closing and the context managers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from typing import Any, ClassVar, Generic, Protocol, Self, TypedDict, TypeVar, Unpack

from fencing import AsyncLeaseManager, Lease, LeaseManager
from fencing.engines import make_async_engine, make_engine
from fencing.plan import Plan, operation
from fencing.sql import AsyncSqlExecutor, SyncSqlExecutor, Translate
from fencing.urls import mask_url
from reservations import (
    acceptance,
    actions,
    audit,
    batching,
    constraints,
    counting,
    lifecycle,
    on_hand,
    operations,
    pending,
    reads,
    redrives,
    schema,
)
from reservations import request_outcomes as outcomes
from reservations import validation as valid
from reservations.acceptance import Admission
from reservations.counting import StockSeen, count_step, replenish_step
from reservations.errors import InvalidRequest
from reservations.keyed_steps import alone, request
from reservations.ledger import Ledger
from reservations.lifecycle import finish_step, reserve_step
from reservations.models import CONFIRMED, RELEASED
from reservations.on_hand import restock_step
from reservations.request_outcomes import DEFAULT_IDEMPOTENCY_RETENTION, RequestReply, RequestResult
from reservations.reserve_statement import Speaker
from reservations.timeline import TimelineEntry, merge
from reservations.values import Outcome

__all__ = ["DEFAULT_IDEMPOTENCY_RETENTION", "AsyncInventory", "Inventory", "lock_order"]


class _Executor(Protocol):
    translate: Translate | None
    engine: Any  # an Engine or AsyncEngine: its dialect decides the statements


E = TypeVar("E", bound=_Executor)  # the shell's executor: SyncSqlExecutor or AsyncSqlExecutor


class Who(TypedDict, total=False):
    """Who a queued request's statement speaks for: its task, its worker, the leases it outlived."""

    task_id: str | None
    worker: str | None
    epochs: int


def lock_order(skus: Iterable[str]) -> list[str]:
    """The order in which an order's SKU leases are taken: sorted, so two orders cannot deadlock."""
    return sorted(set(valid.skus(skus)))


def _speaker(task_id: str | None = None, worker: str | None = None, epochs: int = 0) -> Speaker:
    valid.task_and_worker(task_id, worker)
    valid.epochs(epochs)
    return Speaker(task_id=task_id, worker=worker, epochs=epochs)


def _timeline_scope(manager: object, kind: type, sku: str, limit: int) -> str:
    _check_manager(manager, kind)
    valid.limit(limit)
    return valid.scope_of(valid.sku(sku))


def _check_manager(manager: object, kind: type) -> None:
    """InvalidRequest unless ``manager`` is a lease manager of the shell's own kind (``kind``)."""
    if not isinstance(manager, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        raise InvalidRequest(
            f"expected {article} {kind.__name__}, got {type(manager).__name__}", field="manager"
        )


class InventoryBase(Generic[E]):
    """The executor of one database and the operations both shells share, each in its own transaction."""

    awaits: ClassVar[bool] = False

    def __init__(
        self,
        executor: E,
        *,
        url: str = "",
        enforce_fence: bool = True,
        before_statement: Callable[[Lease], None] | None = None,
        single_statement: bool | None = None,
    ) -> None:
        """``single_statement`` (default: on PostgreSQL) sends a single-SKU reservation as one statement;
        False keeps the multi-statement transaction that SQLite uses."""
        self.dialect = executor.engine.dialect.name
        self.executor = executor
        if executor.translate is None:
            # Integrity errors reach the plans as the domain's typed errors, however the executor was built.
            executor.translate = constraints.translate
        if single_statement and self.dialect != "postgresql":
            raise InvalidRequest("a reservation as one statement needs PostgreSQL", field="single_statement")
        # The plans every operation builds, on one ledger (the envelope of every fenced write).
        self.ledger = Ledger(
            enforce_fence=enforce_fence,
            before_statement=before_statement,
            single_statement=self.dialect == "postgresql" if single_statement is None else single_statement,
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
        sleep: Callable[[float], Any] | None = None,
        single_statement: bool | None = None,
        **engine_options: Any,
    ) -> Self:
        """``migrate=True`` brings the schema to the newest revision first (embedded use, tests).

        ``before_statement`` is called (not awaited) just before each fenced statement is sent (fault
        injection); ``sleep`` is the shell's own pause (``time.sleep``, ``asyncio.sleep``) by default.
        """
        if migrate:
            schema.upgrade(url)
        return cls(
            cls.executor_for(url, sleep, engine_options),
            url=url,
            enforce_fence=enforce_fence,
            before_statement=before_statement,
            single_statement=single_statement,
        )

    @classmethod
    def executor_for(cls, url: str, sleep: Callable[[float], Any] | None, options: dict[str, Any]) -> E:
        """The shell's executor on a new engine for ``url``."""
        raise NotImplementedError

    # writes
    add_sku = operation.of(operations.add_sku)
    add_skus = operation(operations.add_skus)

    @operation
    def restock(self, lease: Lease, sku: str, quantity: int, *, key: str) -> Plan[Outcome]:
        return alone(self.ledger, restock_step(self.ledger, lease, sku, quantity, key))

    adjust = operation(on_hand.adjust)
    look = operation(counting.look)

    @operation
    def count(
        self,
        lease: Lease,
        sku: str,
        counted: int,
        *,
        key: str,
        seen: StockSeen | None = None,
        shrinkage: int | None = None,
    ) -> Plan[Outcome]:
        """A cycle count: on hand becomes ``counted`` (available: ``counted`` - reserved), an absolute
        write; refused with :class:`CountBelowHeld`, writing nothing, below the units held. ``seen`` is
        what the count was decided from (:meth:`look` under ``lease``; see
        :func:`reservations.counting.seen_of`), recorded with it; ``shrinkage`` says the figure was decided
        from ``seen`` (see :func:`reservations.counting.short_count`) rather than sent."""
        return alone(self.ledger, count_step(self.ledger, lease, sku, counted, key, seen, shrinkage))

    @operation
    def replenish(self, lease: Lease, sku: str, par: int, *, key: str, seen: StockSeen) -> Plan[Outcome]:
        """Replenishment to par: books ``par`` minus the on-hand figure ``seen`` (read under ``lease``; see
        :func:`reservations.counting.seen_of`), none when at or above par, as a restock. The size was
        decided from the read, so the row records par and what was seen; the request is named by its par,
        so a redelivery that reads another level replays the first."""
        return alone(self.ledger, replenish_step(self.ledger, lease, sku, par, key, seen))

    @operation
    def reserve(
        self, lease: Lease, sku: str, quantity: int, *, key: str, hold_for: float | None = None
    ) -> Plan[Outcome]:
        return alone(self.ledger, reserve_step(self.ledger, lease, sku, quantity, key, hold_for))

    reserve_many = operation(lifecycle.reserve_many)

    # The steps as queued requests: each also writes the request's attempt and final outcome (one
    # statement on PostgreSQL), or answers from the outcome it already has. A reservation raises what
    # ``reserve`` raises, but never InsufficientStock: that is an outcome.

    @operation
    def reserve_request(
        self,
        lease: Lease,
        sku: str,
        quantity: int,
        *,
        key: str,
        hold_for: float | None = None,
        **who: Unpack[Who],
    ) -> Plan[RequestReply]:
        step = reserve_step(self.ledger, lease, sku, quantity, key, hold_for)
        return request(self.ledger, step, _speaker(**who))

    @operation
    def confirm_request(
        self, lease: Lease, reservation_id: str, *, key: str, **who: Unpack[Who]
    ) -> Plan[RequestReply]:
        step = finish_step(self.ledger, lease, reservation_id, key, CONFIRMED)
        return request(self.ledger, step, _speaker(**who))

    @operation
    def release_request(
        self, lease: Lease, reservation_id: str, *, key: str, **who: Unpack[Who]
    ) -> Plan[RequestReply]:
        step = finish_step(self.ledger, lease, reservation_id, key, RELEASED)
        return request(self.ledger, step, _speaker(**who))

    @operation
    def restock_request(
        self, lease: Lease, sku: str, quantity: int, *, key: str, **who: Unpack[Who]
    ) -> Plan[RequestReply]:
        return request(self.ledger, restock_step(self.ledger, lease, sku, quantity, key), _speaker(**who))

    @operation
    def count_request(
        self,
        lease: Lease,
        sku: str,
        counted: int,
        *,
        key: str,
        seen: StockSeen | None = None,
        shrinkage: int | None = None,
        **who: Unpack[Who],
    ) -> Plan[RequestReply]:
        step = count_step(self.ledger, lease, sku, counted, key, seen, shrinkage)
        return request(self.ledger, step, _speaker(**who))

    @operation
    def replenish_request(
        self, lease: Lease, sku: str, par: int, *, key: str, seen: StockSeen, **who: Unpack[Who]
    ) -> Plan[RequestReply]:
        step = replenish_step(self.ledger, lease, sku, par, key, seen)
        return request(self.ledger, step, _speaker(**who))

    @operation
    def confirm(self, lease: Lease, reservation_id: str, *, key: str) -> Plan[Outcome]:
        """The held units become a committed deduction: they leave ``on_hand`` and ``reserved``."""
        return alone(self.ledger, finish_step(self.ledger, lease, reservation_id, key, CONFIRMED))

    @operation
    def release(self, lease: Lease, reservation_id: str, *, key: str) -> Plan[Outcome]:
        """The held units go back to ``available`` (cancel is the same operation)."""
        return alone(self.ledger, finish_step(self.ledger, lease, reservation_id, key, RELEASED))

    cancel = release

    expire_due = operation(lifecycle.expire_due)

    purge_idempotency = operation.of(operations.purge_idempotency)
    purge_requests = operation.of(outcomes.purge)

    # reads
    stock = operation.of(reads.stock_alone)
    all_stock = operation.of(reads.all_stock)
    existing_skus = operation.of(reads.existing_skus)
    sku_count = operation.of(reads.sku_count)
    reservation = operation.of(reads.reservation)
    reservations = operation.of(reads.reservation_list)
    history = operation.of(reads.history)
    archived = operation.of(reads.archived)
    rejection_counts = operation.of(reads.rejection_counts)
    invariant_violations = operation.of(audit.invariant_violations)
    request_outcome = operation.of(outcomes.request_outcome)
    own_outcome = operation.of(outcomes.own_outcome)
    outcomes_for_tokens = operation.of(outcomes.outcomes_for_tokens)

    # -- requests as accepted (reservations.acceptance): the record each request has before it is sent
    admit = operation.of(acceptance.admit)

    @operation
    def admit_many(self, requests: Sequence[acceptance.Request], look_after: float) -> Plan[list[Admission]]:
        """:meth:`admit` of each of ``requests``, the new keys in one statement on PostgreSQL."""
        return acceptance.admit_many(requests, look_after, arrays=self.dialect == "postgresql")

    @operation
    def record_accepted(self, batch: Sequence[acceptance.Request], look_after: float) -> Plan[None]:
        """Record ``batch`` (:func:`reservations.acceptance.record`): one statement built once on
        PostgreSQL, whatever the batch's size."""
        return acceptance.record(batch, look_after, arrays=self.dialect == "postgresql")

    accepted = operation.of(acceptance.accepted)
    unfinished = operation.of(acceptance.unfinished)
    accepted_requests = operation.of(acceptance.listed)
    # the relay's (tasks.relay): claim the records due, and say what became of each
    keep = operation.of(acceptance.keep)
    claim_due = operation.of(acceptance.due)
    close_records = operation.of(acceptance.closed)
    look_later = operation.of(acceptance.later)
    record_republished = operation.of(acceptance.republished)
    cancel_request = operation.of(acceptance.cancel)

    @operation
    def request_outcomes(self, keys: Sequence[str]) -> Plan[dict[str, RequestResult]]:
        """Final outcomes of those of ``keys`` (at most 1,000) that have one, in one read."""
        return outcomes.outcomes_of(keys, array=self.dialect == "postgresql")

    record_outcome = operation.of(outcomes.record_outcome)
    record_attempt = operation.of(outcomes.record_attempt)
    attempts = operation.of(outcomes.attempts)

    # dead letters and their re-drives
    dead_letters = operation.of(redrives.dead_letters)
    redrives_of = operation.of(redrives.redrives_of)
    claim_redrive = operation.of(redrives.claim)
    drop_redrive = operation.of(redrives.drop)
    skus_with_due_holds = operation.of(outcomes.skus_with_due_holds)

    # what operators did by hand, and why
    record_action = operation.of(actions.record)
    operator_actions = operation.of(actions.listed)

    # hot-SKU batching
    hand_off = operation(pending.hand_off)
    has_pending = operation.of(pending.has_pending)
    pending_count = operation.of(pending.pending_count)
    waiting_by_sku = operation.of(pending.waiting_by_sku)
    skus_waiting = operation.of(pending.skus_waiting)
    purge_ended_waits = operation.of(pending.drop_ended)

    serve_pending = operation(batching.serve_pending)


class Inventory(InventoryBase[SyncSqlExecutor]):
    """Fenced stock operations on one database (SQLite or PostgreSQL)."""

    @classmethod
    def executor_for(
        cls, url: str, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> SyncSqlExecutor:
        return SyncSqlExecutor(make_engine(url, **options), sleep or time.sleep)

    def timeline(self, sku: str, manager: LeaseManager, *, limit: int = 1000) -> list[TimelineEntry]:
        """Lease events, accepted writes and rejections of ``sku`` as one ordered timeline."""
        scope = _timeline_scope(manager, LeaseManager, sku, limit)
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
        _check_manager(manager, LeaseManager)
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
        scope = _timeline_scope(manager, AsyncLeaseManager, sku, limit)
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
        _check_manager(manager, AsyncLeaseManager)
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
