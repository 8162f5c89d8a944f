"""What the two inventory shells share: the construction of the plans, and the checks of the arguments
that the request and batching plans take unchecked, so :class:`~reservations.Inventory` and
:class:`~reservations.AsyncInventory` differ only in how they drive a plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from fencing import Lease
from fencing.plan import Plan
from fencing.sql_errors import Translate
from fencing.urls import mask_url
from reservations import batching, constraints, pending, requests
from reservations import validation as valid
from reservations.errors import InvalidRequest
from reservations.operations import InventoryPlans
from reservations.requests import Attempt, RequestResult
from reservations.reserve_statement import Speaker


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


def record_outcome(
    key: str, operation: str, status: str, detail: dict[str, Any], who: Mapping[str, Any]
) -> Plan[requests.RequestResult]:
    valid.idempotency_key(key)
    valid.operation(operation)
    valid.detail(detail)
    _check_who(who, _OUTCOME_FIELDS)
    return requests.record_outcome(key, operation, status, detail, **who)


def record_attempt(key: str, operation: str, result: str, who: Mapping[str, Any]) -> Plan[None]:
    valid.idempotency_key(key)
    valid.operation(operation)
    _check_who(who, _ATTEMPT_FIELDS)
    return requests.record_attempt(key, operation, result, **who)


def attempts(key: str) -> Plan[list[Attempt]]:
    return requests.attempts(valid.idempotency_key(key))


def purge_requests(older_than: float) -> Plan[int]:
    return requests.purge(valid.retention(older_than))


def skus_with_due_holds(limit: int) -> Plan[list[str]]:
    return requests.skus_with_due_holds(valid.limit(limit))


def hand_off(
    plans: InventoryPlans,
    sku: str,
    quantity: int,
    key: str,
    hold_for: float | None,
    task_id: str | None,
    epochs: int,
) -> Plan[pending.HandOff]:
    valid.task_and_worker(task_id)
    valid.epochs(epochs)
    return pending.hand_off(
        sku, quantity, key, hold_for, task_id=task_id, epochs=epochs, single_statement=plans.single_statement
    )


def reserve_request(
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


def serve_pending(
    plans: InventoryPlans, lease: Lease, sku: str, limit: int, task_id: str | None, worker: str | None
) -> Plan[list[RequestResult]]:
    valid.lease(lease)
    valid.task_and_worker(task_id, worker)
    return batching.serve(plans, lease, sku, limit=limit, task_id=task_id, worker=worker)


def timeline_args(manager: object, kind: type, sku: str, limit: int) -> str:
    if not isinstance(manager, kind):
        raise InvalidRequest(f"expected a {kind.__name__}, got {type(manager).__name__}", field="manager")
    valid.limit(limit)
    return valid.scope_of(valid.sku(sku))


def _single_statement(dialect: str, asked: bool | None) -> bool:
    if asked and dialect != "postgresql":
        raise InvalidRequest("a reservation as one statement needs PostgreSQL", field="single_statement")
    return dialect == "postgresql" if asked is None else asked


class InventoryBase(Generic[E]):
    """The plans both shells drive, and the executor that runs them on one database."""

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
            single_statement=_single_statement(dialect, single_statement),
        )
        self.url = mask_url(url) if url else ""
