"""The inventory's operations, each written once: :class:`InventoryBase` builds the plans and, for every
operation that only runs a plan, holds that operation as the plan it runs (with the checks of the
arguments that the request and batching plans take unchecked). :class:`fencing.shells.operation` makes
each one blocking in :class:`~reservations.Inventory` and a coroutine function in
:class:`~reservations.AsyncInventory`, with the same name, parameters and docstring. The shells write only
what differs in kind: the executor ``from_url`` builds, the lease timeline and ``hold_many`` (which use a
lease manager of their own kind), closing and the context managers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from fencing import Lease
from fencing.plan import Plan
from fencing.shells import operation
from fencing.sql_errors import Translate
from fencing.urls import mask_url
from reservations import (
    acceptance,
    audit,
    batch_statement,
    batching,
    constraints,
    pending,
    reads,
    redrives,
    requests,
    schema,
)
from reservations import shell_checks as checks
from reservations import validation as valid
from reservations.counting import StockSeen
from reservations.operations import InventoryPlans
from reservations.requests import Attempt, RequestResult
from reservations.reserve_statement import Speaker
from reservations.views import ArchivedHistory, HistoryEntry, Outcome, ReservationView, StockLevel


class _Executor(Protocol):
    translate: Translate | None
    engine: Any  # an Engine or AsyncEngine: its dialect decides the statements


E = TypeVar("E", bound=_Executor)  # the shell's executor: SyncSqlExecutor or AsyncSqlExecutor


# Idempotency records are kept this long by default; ``purge_idempotency`` deletes older ones. A retry
# or redelivery arriving after its key was purged would be applied again, so keep this well above the
# broker's redelivery horizon (visibility timeout plus the longest retry backoff).
DEFAULT_IDEMPOTENCY_RETENTION = 7 * 24 * 3600.0


def lock_order(skus: Iterable[str]) -> list[str]:
    """The order in which an order's SKU leases are taken: sorted, so two orders cannot deadlock."""
    return sorted(set(valid.skus(skus)))


def _speaker(task_id: str | None, worker: str | None, epochs: int) -> Speaker:
    """Who a queued request's statement speaks for, checked: the plans take it unchecked."""
    valid.task_and_worker(task_id, worker)
    valid.epochs(epochs)
    return Speaker(task_id=task_id, worker=worker, epochs=epochs)


class InventoryBase(Generic[E]):
    """The plans both shells drive, the executor that runs them on one database, and every operation that
    only runs a plan (:class:`~fencing.shells.operation`: blocking where the shell's ``awaits`` is False,
    awaitable where it is True), each in its own transaction."""

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
        dialect = executor.engine.dialect.name
        self.dialect = dialect
        self.executor = executor
        if executor.translate is None:
            # Integrity errors reach the plans as the domain's typed errors, however the executor was built.
            executor.translate = constraints.translate
        self.plans = InventoryPlans(
            enforce_fence=enforce_fence,
            before_statement=before_statement,
            single_statement=checks.single_statement(dialect, single_statement),
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
    @operation
    def add_sku(self, sku: str, *, on_hand: int = 0) -> Plan[StockLevel]:
        return self.plans.add_sku(sku, on_hand)

    @operation
    def restock(self, lease: Lease, sku: str, quantity: int, *, key: str) -> Plan[Outcome]:
        return self.plans.on_hand.restock(lease, sku, quantity, key)

    @operation
    def adjust(
        self, lease: Lease, sku: str, delta: int, *, key: str, reason: str | None = None
    ) -> Plan[Outcome]:
        return self.plans.on_hand.adjust(lease, sku, delta, key, reason)

    @operation
    def look(self, lease: Lease, sku: str) -> Plan[StockSeen]:
        """The SKU's stock and version read under ``lease``, to decide a count or a replenishment from. The
        row's fence rises to the lease's token, so no older epoch can write between this read and the write
        decided from it."""
        return self.plans.counting.look(lease, sku)

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
        """A cycle count: on hand becomes ``counted``; ``seen`` (:meth:`look`) is what it was decided from,
        ``shrinkage`` says the figure was decided from ``seen`` rather than sent."""
        return self.plans.counting.count(lease, sku, counted, key, seen=seen, shrinkage=shrinkage)

    @operation
    def replenish(self, lease: Lease, sku: str, par: int, *, key: str, seen: StockSeen) -> Plan[Outcome]:
        """Books ``par`` minus the on-hand figure ``seen`` (none at or above par) as a restock."""
        return self.plans.counting.replenish(lease, sku, par, key, seen=seen)

    @operation
    def reserve(
        self, lease: Lease, sku: str, quantity: int, *, key: str, hold_for: float | None = None
    ) -> Plan[Outcome]:
        return self.plans.reserve(lease, sku, quantity, key, hold_for)

    @operation
    def reserve_many(
        self,
        leases: Mapping[str, Lease],
        lines: list[tuple[str, int]],
        *,
        key: str,
        hold_for: float | None = None,
    ) -> Plan[Outcome]:
        return self.plans.reserve_many(leases, lines, key, hold_for)

    @operation
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
    ) -> Plan[requests.RequestReply]:
        """:meth:`reserve` for a queued request: also writes its attempt and final outcome (one statement
        on PostgreSQL), or answers from the outcome it already has."""
        return self.plans.reserve_request(
            lease, sku, quantity, key, hold_for, _speaker(task_id, worker, epochs)
        )

    # The later steps as queued requests: each also writes its attempt and final outcome (one statement on
    # PostgreSQL), or answers from the outcome the request already has, as reserve_request does.

    @operation
    def confirm_request(
        self, lease: Lease, reservation_id: str, *, key: str,
        task_id: str | None = None, worker: str | None = None, epochs: int = 0,
    ) -> Plan[requests.RequestReply]:  # fmt: skip
        return self.plans.confirm_request(lease, reservation_id, key, _speaker(task_id, worker, epochs))

    @operation
    def release_request(
        self, lease: Lease, reservation_id: str, *, key: str,
        task_id: str | None = None, worker: str | None = None, epochs: int = 0,
    ) -> Plan[requests.RequestReply]:  # fmt: skip
        return self.plans.release_request(lease, reservation_id, key, _speaker(task_id, worker, epochs))

    @operation
    def restock_request(
        self, lease: Lease, sku: str, quantity: int, *, key: str,
        task_id: str | None = None, worker: str | None = None, epochs: int = 0,
    ) -> Plan[requests.RequestReply]:  # fmt: skip
        return self.plans.restock_request(lease, sku, quantity, key, _speaker(task_id, worker, epochs))

    @operation
    def count_request(
        self, lease: Lease, sku: str, counted: int, *, key: str,
        seen: StockSeen | None = None, shrinkage: int | None = None,
        task_id: str | None = None, worker: str | None = None, epochs: int = 0,
    ) -> Plan[requests.RequestReply]:  # fmt: skip
        speaker = _speaker(task_id, worker, epochs)
        return self.plans.count_request(lease, sku, counted, key, speaker, seen=seen, shrinkage=shrinkage)

    @operation
    def replenish_request(
        self, lease: Lease, sku: str, par: int, *, key: str, seen: StockSeen,
        task_id: str | None = None, worker: str | None = None, epochs: int = 0,
    ) -> Plan[requests.RequestReply]:  # fmt: skip
        return self.plans.replenish_request(
            lease, sku, par, key, _speaker(task_id, worker, epochs), seen=seen
        )

    @operation
    def confirm(self, lease: Lease, reservation_id: str, *, key: str) -> Plan[Outcome]:
        return self.plans.lifecycle.confirm(lease, reservation_id, key)

    @operation
    def release(self, lease: Lease, reservation_id: str, *, key: str) -> Plan[Outcome]:
        return self.plans.lifecycle.release(lease, reservation_id, key)

    cancel = release

    @operation
    def expire_due(self, lease: Lease, sku: str, *, key: str | None = None) -> Plan[Outcome]:
        return self.plans.lifecycle.expire_due(lease, sku, key)

    @operation
    def purge_idempotency(self, *, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> Plan[int]:
        return self.plans.purge_idempotency(older_than)

    @operation
    def purge_requests(self, *, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> Plan[int]:
        """Delete request outcomes and attempts past the same retention as the idempotency records."""
        return requests.purge(valid.retention(older_than))

    # reads
    @operation
    def stock(self, sku: str) -> Plan[StockLevel]:
        return reads.stock_level(sku)

    @operation
    def all_stock(
        self, *, after: str | None = None, limit: int | None = None, prefix: str | None = None
    ) -> Plan[list[StockLevel]]:
        """Every SKU's stock in SKU order, or a page: after the SKU ``after``, at most ``limit``, whose
        SKU starts with ``prefix``."""
        return reads.all_stock(after=after, limit=limit, prefix=prefix)

    @operation
    def reservation(self, id_or_key: str) -> Plan[ReservationView]:
        return reads.reservation(id_or_key)

    @operation
    def reservations(
        self,
        sku: str | None = None,
        *,
        status: str | None = None,
        order_key: str | None = None,
        limit: int = 100,
    ) -> Plan[list[ReservationView]]:
        return reads.reservation_list(sku, status=status, order_key=order_key, limit=limit)

    @operation
    def history(self, sku: str, *, limit: int = 1000, since: float | None = None) -> Plan[list[HistoryEntry]]:
        return reads.history(sku, limit=limit, since=since)

    @operation
    def archived(self, sku: str) -> Plan[ArchivedHistory | None]:
        """What of the SKU's history was archived (``reservations archive``), or None."""
        return reads.archived(sku)

    @operation
    def rejection_counts(self, *, since: float | None = None) -> Plan[dict[str, int]]:
        return reads.rejection_counts(since)

    @operation
    def invariant_violations(self) -> Plan[list[audit.Violation]]:
        return audit.invariant_violations()

    @operation
    def request_outcome(self, key: str) -> Plan[RequestResult | None]:
        return requests.request_outcome(key)

    # -- requests as accepted (reservations.acceptance): the record each request has before it is sent

    @operation
    def admit(self, request: acceptance.Request, look_after: float) -> Plan[acceptance.Admission]:
        """The key's outcome if it has one; else ``request`` recorded under it, or the one recorded first."""
        return acceptance.admit(request, look_after)

    @operation
    def record_accepted(self, batch: Sequence[acceptance.Request], look_after: float) -> Plan[None]:
        """Record the requests of ``batch`` as accepted (a key recorded already keeps its first record)."""
        return acceptance.record(batch, look_after)

    @operation
    def accepted(self, key: str) -> Plan[acceptance.Accepted | None]:
        """The request accepted under ``key``, None for a key never accepted."""
        return acceptance.accepted(key)

    @operation
    def unfinished(self) -> Plan[tuple[int, float | None]]:
        """How many accepted requests have no outcome yet, and the age in seconds of the oldest."""
        return acceptance.unfinished()

    @operation
    def accepted_requests(
        self, *, state: str | None = None, operation: str | None = None, since_ms: int | None = None,
        stuck_after: float = 600.0, after: str | None = None, limit: int = 100,
    ) -> Plan[list[acceptance.Listed]]:  # fmt: skip
        """Accepted requests, newest first, filtered and paged as :func:`reservations.acceptance.listed`
        says."""
        return acceptance.listed(
            state=state, operation=operation, since_ms=since_ms, stuck_after=stuck_after, after=after,
            limit=limit,
        )  # fmt: skip

    @operation
    def own_outcome(self, key: str) -> Plan[RequestResult | None]:
        """The outcome row written under ``key`` itself: :meth:`request_outcome` without following a
        dead letter to its re-drive."""
        return requests.own_outcome(key)

    @operation
    def request_outcomes(self, keys: Sequence[str]) -> Plan[dict[str, RequestResult]]:
        """Final outcomes of those of ``keys`` (at most 1,000) that have one, in one read."""
        return requests.outcomes_of(keys, array=self.dialect == "postgresql")

    @operation
    def record_outcome(
        self, /, key: str, operation: str, status: str, detail: dict[str, Any], **who: Any
    ) -> Plan[RequestResult]:
        valid.idempotency_key(key)
        valid.operation(operation)
        valid.detail(detail)
        checks.who(who, checks.OUTCOME_FIELDS)
        return requests.record_outcome(key, operation, status, detail, **who)

    @operation
    def record_attempt(self, /, key: str, operation: str, result: str, **who: Any) -> Plan[None]:
        valid.idempotency_key(key)
        valid.operation(operation)
        checks.who(who, checks.ATTEMPT_FIELDS)
        return requests.record_attempt(key, operation, result, **who)

    @operation
    def attempts(self, key: str) -> Plan[list[Attempt]]:
        return requests.attempts(valid.idempotency_key(key))

    # dead letters and their re-drives
    @operation
    def dead_letters(
        self, *, since: float | None = None, reason: str | None = None, limit: int = 1000
    ) -> Plan[list[redrives.DeadLetter]]:
        """Dead-lettered requests, newest first, each with its latest re-drive (reservations.redrives)."""
        return redrives.dead_letters(since, reason, limit)

    @operation
    def redrives_of(self, key: str) -> Plan[list[redrives.RedriveLink]]:
        """Every re-drive of the request under ``key``, oldest first."""
        return redrives.redrives_of(key)

    @operation
    def claim_redrive(
        self, key: str, *, by: str | None = None, dry_run: bool = False
    ) -> Plan[redrives.Redrive]:
        """Claim the next re-drive of a dead-lettered request (recorded; ``dry_run``: only checked)."""
        return redrives.claim(key, by=by, dry_run=dry_run)

    @operation
    def drop_redrive(self, redrive_key: str) -> Plan[bool]:
        """Take back a claimed re-drive that was never sent."""
        return redrives.drop(redrive_key)

    @operation
    def skus_with_due_holds(self, limit: int = 1000) -> Plan[list[str]]:
        return requests.skus_with_due_holds(valid.limit(limit))

    # hot-SKU batching
    @operation
    def hand_off(
        self,
        sku: str,
        quantity: int,
        *,
        key: str,
        hold_for: float | None = None,
        task_id: str | None = None,
        epochs: int = 0,
    ) -> Plan[pending.HandOff]:
        """Queue a reservation for the SKU's lease holder (or find the outcome it already has)."""
        valid.task_and_worker(task_id)
        valid.epochs(epochs)
        single_statement = self.plans.single_statement
        return pending.hand_off(
            sku, quantity, key, hold_for, task_id=task_id, epochs=epochs, single_statement=single_statement
        )

    @operation
    def has_pending(self, sku: str) -> Plan[bool]:
        return pending.has_pending(sku)

    @operation
    def pending_count(self, sku: str | None = None) -> Plan[int]:
        return pending.pending_count(sku)

    @operation
    def waiting_by_sku(self) -> Plan[dict[str, int]]:
        return pending.waiting_by_sku()

    @operation
    def skus_waiting(self, *, older_than: float) -> Plan[list[str]]:
        """SKUs with a request waiting for its holder longer than ``older_than`` seconds."""
        return pending.skus_waiting(older_than)

    @operation
    def purge_ended_waits(self) -> Plan[int]:
        return pending.drop_ended()

    @operation
    def serve_pending(
        self,
        lease: Lease,
        sku: str,
        *,
        limit: int = 100,
        task_id: str | None = None,
        worker: str | None = None,
        in_hand: Sequence[batch_statement.InHand] = (),
    ) -> Plan[list[RequestResult]]:
        """Serve up to ``limit`` pending reservations of ``sku``, then the requests ``in_hand`` (handed over
        by threads of the caller's process, never listed), in one fenced transaction."""
        valid.lease(lease)
        valid.task_and_worker(task_id, worker)
        return batching.serve(
            self.plans, lease, sku, limit=limit, task_id=task_id, worker=worker, in_hand=in_hand
        )
