"""The sync and async shells behave alike. The inventory's and the lease managers' operations are written
once (:class:`fencing.plan.operation`) and made blocking in one shell and awaitable in the other, so
what is compared here is behaviour: one sequence of operations (stock writes, reservations and their
ends, counts, reads, request outcomes and attempts, dead letters and re-drives, hand-offs and their
serving, leases taken, renewed, repaired, released and broken) runs through the sync shell and through
the async shell, each on a fresh database of its own (SQLite files, PostgreSQL schemas; the leases also
on Redis), and every step must answer, or raise, the same once random ids and times are normalised. The
scenario also states what the steps must do, so two shells failing alike do not pass.

A small signature check remains for what is still written per shell (construction, ``hold``,
``hold_many``, the timeline, closing) and for the other sync/async pairs: the executors and the
producer's client.
"""

from __future__ import annotations

import asyncio
import inspect
import operator
import re
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from fencing import (
    AsyncLeaseManager,
    InvalidLeaseRequest,
    Lease,
    LeaseBusy,
    LeaseLost,
    LeaseManager,
    StaleToken,
)
from fencing.plan import Plan, operation
from fencing.redis_executor import AsyncRedisExecutor, SyncRedisExecutor
from fencing.sql import AsyncSqlExecutor, SyncSqlExecutor
from reservations import (
    AsyncInventory,
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    InvalidTransition,
    Inventory,
    ReservationError,
    UnknownReservation,
    reads,
    scope_of,
)
from reservations.errors import RedriveRefused
from reservations.values import HistoryEntry
from tasks.client import ReservationClient, ReservationHandle
from testing.stores import REDIS_URL, own_pg_schema, own_redis_prefix

# -- a transcript: what each step of a scenario answered -------------------------------------------------

_ID = re.compile(r"\b(?:r_)?[0-9a-f]{32}\b")  # reservation and lease ids
_MANAGER = re.compile(r"\ban? (?:Async)?LeaseManager\b")  # each shell names its own kind of manager
_SECONDS = re.compile(r"\b\d+\.\d+s\b")  # a wait in a message ("retry in 29.730s")


def _is_time(key: str | None) -> bool:
    return key is not None and (key in {"at", "through", "time_left"} or key.endswith("_at"))


def normal(value: Any, ids: dict[str, str], key: str | None = None) -> Any:
    """``value`` as plain dicts and lists, as it is now, with each random id replaced by its order of first
    appearance in ``ids`` and each time by a mark (a time that is None stays None)."""
    if value is not None and _is_time(key):
        return "<time>"
    if is_dataclass(value) and not isinstance(value, type):
        shown = {
            f.name: normal(getattr(value, f.name), ids, f.name) for f in fields(value) if f.name[0] != "_"
        }
        shown.pop("clock", None)
        if isinstance(value, Lease):
            shown["lost"] = value.lost
        return {"": type(value).__name__, **shown}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {k: normal(item, ids, k) for k, item in value.items()}
    if isinstance(value, list | tuple):
        return [normal(item, ids, key) for item in value]
    if isinstance(value, str):
        value = _MANAGER.sub("a lease manager", _SECONDS.sub("<seconds>", value))
        return _ID.sub(lambda found: ids.setdefault(found[0], f"<id{len(ids) + 1}>"), value)
    return value


@dataclass
class Transcript:
    """What each step of a scenario answered (or raised), in order, normalised when it answered. A step
    is one call of the shell under test: on the async shell it must return a coroutine and check nothing
    before it is awaited, on the sync shell it must answer at once. ``raises``: the step must raise that
    (recorded with its message); without it, it must answer. ``order_by``: the answer is a list whose
    order is not the point (rows that tie in the query's own order)."""

    awaits: bool
    entries: list[tuple[str, Any]] = field(default_factory=list)
    ids: dict[str, str] = field(default_factory=dict)

    async def __call__(
        self,
        name: str,
        call: Callable[[], Any],
        *,
        raises: type[Exception] | None = None,
        order_by: Callable[[Any], Any] | None = None,
    ) -> Any:
        try:
            answer = await self._answer(name, call)
        except Exception as exc:
            if raises is None or not isinstance(exc, raises):
                raise
            self.record(name, ("raised", type(exc).__name__, str(exc)))
            return exc
        if raises is not None:
            pytest.fail(f"{name}: expected {raises.__name__}, answered {answer!r}")
        self.record(name, answer if order_by is None else sorted(answer, key=order_by))
        return answer

    def record(self, name: str, answer: Any) -> None:
        self.entries.append((name, normal(answer, self.ids)))

    async def _answer(self, name: str, call: Callable[[], Any]) -> Any:
        if not self.awaits:
            answer = call()
            assert not inspect.isawaitable(answer), f"{name}: the blocking shell answered an awaitable"
            return answer
        try:
            pending = call()
        except Exception as exc:
            raise AssertionError(f"{name}: the async shell raised before it was awaited") from exc
        assert inspect.iscoroutine(pending), f"{name}: the async shell answered {pending!r} at once"
        return await pending

    @asynccontextmanager
    async def entered(self, name: str, manager: Any) -> AsyncIterator[Any]:
        """``with`` on the sync shell, ``async with`` on the async one; what it gave is recorded."""
        if self.awaits:
            assert isinstance(manager, AbstractAsyncContextManager), name
            async with manager as value:
                self.record(name, value)
                yield value
        else:
            assert isinstance(manager, AbstractContextManager), name
            with manager as value:
                self.record(name, value)
                yield value


def differences(blocking: Transcript, awaiting: Transcript) -> list[tuple[str, Any, Any]]:
    """The steps whose answers differ, with both answers."""
    assert [name for name, _ in blocking.entries] == [name for name, _ in awaiting.entries]
    pairs = zip(blocking.entries, awaiting.entries, strict=True)
    return [(name, one, other) for (name, one), (_, other) in pairs if one != other]


# -- the scenarios, written once for either shell --------------------------------------------------------


async def lease_steps(leases: Any, step: Transcript) -> None:
    """Leases through either lease manager, on any lease backend."""
    first: Lease = await step("acquire", lambda: leases.acquire("job:1", ttl=30, holder="one"))
    assert first.token == 1
    await step("busy", lambda: leases.acquire("job:1", ttl=30, holder="two"), raises=LeaseBusy)
    await step("bad ttl", lambda: leases.acquire("job:1", ttl=-1), raises=InvalidLeaseRequest)
    await step("renew", lambda: leases.renew(first))
    await step("current", lambda: leases.current("job:1"))
    await step("none current", lambda: leases.current("job:2"))
    await step("release", lambda: leases.release(first))
    await step("release again", lambda: leases.release(first), raises=LeaseLost)
    await step("renew released", lambda: leases.renew(first), raises=LeaseLost)
    second: Lease = await step("acquire again", lambda: leases.acquire("job:1", ttl=30, holder="two"))
    assert second.token == 2
    # The resource has accepted token 7 (the coordinator lost its counter) while this holder is current:
    # the counter is raised past it and the holder's lease is lost.
    stale = StaleToken(scope="job:1", presented=second.token, highest=7)
    assert await step("repair", lambda: leases.handle_stale(second, stale)) is True
    await step("renew repaired", lambda: leases.renew(second), raises=LeaseLost)
    await step("break", lambda: leases.break_lease("job:1", reason="operator"))
    await step("break nothing", lambda: leases.break_lease("job:1", reason="operator"))
    third: Lease = await step("acquire repaired", lambda: leases.acquire("job:1", ttl=30, holder="three"))
    assert third.token == 8
    await step("break held", lambda: leases.break_lease("job:1", reason="operator"))
    await step("renew broken", lambda: leases.renew(third), raises=LeaseLost)
    await step("history", lambda: leases.history("job:1", limit=10))
    await step("bad limit", lambda: leases.history("job:1", limit=0), raises=InvalidLeaseRequest)
    await step("purge nothing old", lambda: leases.purge_history(older_than=3600))
    async with step.entered("hold", leases.hold("job:3", ttl=30, holder="three")) as held:
        await step("current while held", lambda: leases.current("job:3"))
    assert held.lost  # released on the way out
    await step("current after hold", lambda: leases.current("job:3"))


DEAD = {
    "reason": "backend unavailable",
    "request": {"type": "reserve", "arguments": {"sku": "A", "quantity": 1}},
}
BY_KEY = operator.attrgetter("sku", "idempotency_key")


async def inventory_steps(inventory: Any, leases: Any, step: Transcript) -> None:
    """Every kind of inventory operation through either shell, with leases from a manager of its kind."""
    inv = inventory
    await step("add A", lambda: inv.add_sku("A", on_hand=10))
    await step("add B", lambda: inv.add_sku("B", on_hand=5))
    await step("add HOT", lambda: inv.add_sku("HOT", on_hand=20))
    await step("add A again", lambda: inv.add_sku("A"), raises=ReservationError)
    await step("bad sku", lambda: inv.add_sku(""), raises=InvalidRequest)
    a: Lease = await step("lease A", lambda: leases.acquire(scope_of("A"), ttl=30, holder="w:1"))
    b: Lease = await step("lease B", lambda: leases.acquire(scope_of("B"), ttl=30, holder="w:1"))

    # writes, reservations and their ends
    await step("restock", lambda: inv.restock(a, "A", 5, key="restock-1"))
    await step("restock replayed", lambda: inv.restock(a, "A", 5, key="restock-1"))
    await step("key reused", lambda: inv.restock(a, "A", 6, key="restock-1"), raises=IdempotencyConflict)
    await step("adjust", lambda: inv.adjust(a, "A", -1, key="adjust-1", reason="damaged"))
    held = await step("reserve", lambda: inv.reserve(a, "A", 3, key="res-1", hold_for=3600))
    await step("too many", lambda: inv.reserve(a, "A", 100, key="res-big"), raises=InsufficientStock)
    held_id = held.reservation_ids[0]
    await step("confirm", lambda: inv.confirm(a, held_id, key="confirm-1"))
    await step("end twice", lambda: inv.release(a, held_id, key="release-1"), raises=InvalidTransition)
    await step("unknown", lambda: inv.confirm(a, "r_" + "0" * 32, key="c-x"), raises=UnknownReservation)
    second = await step("reserve 2", lambda: inv.reserve(a, "A", 2, key="res-2"))
    await step("release", lambda: inv.release(a, second.reservation_ids[0], key="release-2"))
    third = await step("reserve 3", lambda: inv.reserve(a, "A", 1, key="res-3"))
    await step("cancel", lambda: inv.cancel(a, third.reservation_ids[0], key="cancel-3"))
    await step("order", lambda: inv.reserve_many({"A": a, "B": b}, [("A", 1), ("B", 2)], key="order-1"))
    seen = await step("look", lambda: inv.look(a, "A"))
    await step("count", lambda: inv.count(a, "A", seen.on_hand - 1, key="count-1", seen=seen, shrinkage=1))
    await step("count below held", lambda: inv.count(a, "A", 0, key="count-2"), raises=InvalidRequest)
    seen_b = await step("look B", lambda: inv.look(b, "B"))
    await step("replenish", lambda: inv.replenish(b, "B", 10, key="replenish-1", seen=seen_b))
    await step("short hold", lambda: inv.reserve(b, "B", 1, key="res-short", hold_for=0.001))
    for _ in range(500):  # a hold ends by the database's clock; how many looks that took is not recorded
        due = await inv.skus_with_due_holds() if step.awaits else inv.skus_with_due_holds()
        if due:
            break
        await asyncio.sleep(0.01)
    await step("due", lambda: inv.skus_with_due_holds())
    await step("expire", lambda: inv.expire_due(b, "B", key="expire-1"))
    await step("nothing due", lambda: inv.skus_with_due_holds(limit=10))
    await step("bad limit", lambda: inv.skus_with_due_holds(limit=0), raises=InvalidRequest)

    # a queued request, its attempts and outcomes
    request = {"key": "req-1", "hold_for": None, "task_id": "t-1", "worker": "w:1", "epochs": 1}
    await step("reserve request", lambda: inv.reserve_request(a, "A", 1, **request))
    await step("reserve request again", lambda: inv.reserve_request(a, "A", 1, **request))
    bad_epochs = {"key": "req-2", "epochs": -1}
    await step("bad epochs", lambda: inv.reserve_request(a, "A", 1, **bad_epochs), raises=InvalidRequest)
    await step("attempt", lambda: inv.record_attempt("req-3", "reserve", "busy", task_id="t-3", worker="w:2"))
    await step("bad attempt", lambda: inv.record_attempt("req-3", "reserve", "bogus"), raises=InvalidRequest)
    await step(
        "odd field", lambda: inv.record_attempt("req-3", "reserve", "busy", odd=1), raises=InvalidRequest
    )
    await step("attempts", lambda: inv.attempts("req-3"))
    await step("outcome", lambda: inv.record_outcome("req-3", "reserve", "invalid", {"why": "test"}))
    await step("outcome of", lambda: inv.request_outcome("req-3"))
    await step("own outcome", lambda: inv.own_outcome("req-1"))
    await step("no outcome", lambda: inv.request_outcome("req-none"))
    await step("outcomes", lambda: inv.request_outcomes(["req-1", "req-3", "req-none"]))

    # dead letters and their re-drives
    await step("dead letter", lambda: inv.record_outcome("dead-1", "reserve", "dead_lettered", DEAD))
    await step("dead letters", lambda: inv.dead_letters())
    await step("dry run", lambda: inv.claim_redrive("dead-1", by="ops", dry_run=True))
    redrive = await step("claim", lambda: inv.claim_redrive("dead-1", by="ops"))
    await step("claim twice", lambda: inv.claim_redrive("dead-1"), raises=RedriveRefused)
    await step("redrives", lambda: inv.redrives_of("dead-1"))
    await step("drop", lambda: inv.drop_redrive(redrive.key))
    await step("drop again", lambda: inv.drop_redrive(redrive.key))

    # hot-SKU hand-offs, served by the holder
    for i in range(3):
        await step(f"hand off {i}", lambda i=i: inv.hand_off("HOT", 1, key=f"hot-{i}", task_id=f"t-h{i}"))
    await step("hand off again", lambda: inv.hand_off("HOT", 1, key="hot-0", task_id="t-h0"))
    await step("hand off to B", lambda: inv.hand_off("B", 1, key="hot-b"))
    await step("has pending", lambda: inv.has_pending("HOT"))
    await step("pending", lambda: inv.pending_count())
    await step("pending HOT", lambda: inv.pending_count("HOT"))
    await step("waiting", lambda: inv.waiting_by_sku())
    await step("waiting long", lambda: inv.skus_waiting(older_than=3600))
    await step("bad wait", lambda: inv.skus_waiting(older_than=-1), raises=InvalidRequest)
    await step("end one", lambda: inv.record_outcome("hot-b", "reserve", "dead_lettered", {"reason": "x"}))
    await step("purge ended", lambda: inv.purge_ended_waits())
    hot: Lease = await step("lease HOT", lambda: leases.acquire(scope_of("HOT"), ttl=30, holder="w:2"))
    await step("serve", lambda: inv.serve_pending(hot, "HOT", limit=2, task_id="t-s", worker="w:2"))
    await step("serve rest", lambda: inv.serve_pending(hot, "HOT"))
    await step("none pending", lambda: inv.has_pending("HOT"))

    # a stale holder: A's lease broken and taken again, the old one refused
    await step("break A", lambda: leases.break_lease(scope_of("A"), reason="test"))
    newer: Lease = await step("lease A again", lambda: leases.acquire(scope_of("A"), ttl=30, holder="w:3"))
    await step("newer writes", lambda: inv.restock(newer, "A", 1, key="restock-2"))
    await step("stale write", lambda: inv.restock(a, "A", 1, key="restock-3"), raises=StaleToken)

    # reads
    await step("stock", lambda: inv.stock("A"))
    await step("no stock", lambda: inv.stock("NONE"), raises=ReservationError)
    await step("all stock", lambda: inv.all_stock())
    await step("reservation", lambda: inv.reservation(held_id))
    await step("reservation by key", lambda: inv.reservation("res-2"))
    await step("reservations", lambda: inv.reservations("A"), order_by=BY_KEY)
    await step("held", lambda: inv.reservations(status="held", limit=10), order_by=BY_KEY)
    await step("of order", lambda: inv.reservations(order_key="order-1"), order_by=BY_KEY)
    await step("history", lambda: inv.history("A", limit=100))
    await step("archived", lambda: inv.archived("A"))
    await step("rejections", lambda: inv.rejection_counts())
    await step("violations", lambda: inv.invariant_violations())
    await step("timeline", lambda: inv.timeline("A", leases, limit=100))
    await step("timeline of nothing", lambda: inv.timeline("A", object()), raises=InvalidRequest)
    await step("release B", lambda: leases.release(b))
    await step("release HOT", lambda: leases.release(hot))
    async with step.entered("hold many", inv.hold_many(leases, ["HOT", "B"], ttl=30, holder="w:4")) as both:
        await step("write held", lambda: inv.restock(both["B"], "B", 1, key="restock-4"))
    await step("lost after hold", lambda: inv.restock(both["B"], "B", 1, key="restock-5"), raises=LeaseLost)

    # purges
    await step("purge keys", lambda: inv.purge_idempotency(older_than=3600))
    await step("purge requests", lambda: inv.purge_requests(older_than=3600))
    await step("bad retention", lambda: inv.purge_requests(older_than=1), raises=InvalidRequest)


# -- fresh databases, one per shell -------------------------------------------------------------------------


@contextmanager
def fresh_inventories(kind: str, folder: Path, migrated_sqlite: Path) -> Iterator[tuple[str, str]]:
    """Two migrated inventory databases of ``kind``: the sync shell's and the async shell's."""
    if kind == "postgresql":
        with own_pg_schema(migrated=True) as one, own_pg_schema(migrated=True) as other:
            yield one, other
        return
    folder.mkdir(parents=True, exist_ok=True)
    urls = []
    for name in ("sync", "async"):
        path = folder / f"{name}.sqlite3"
        shutil.copyfile(migrated_sqlite, path)
        urls.append(f"sqlite:///{path}")
    yield urls[0], urls[1]


async def run_inventory(shell: type[Inventory] | type[AsyncInventory], url: str) -> Transcript:
    """The inventory scenario through ``shell`` on ``url``, with the SQL leases of the same database."""
    step = Transcript(awaits=shell.awaits)
    if issubclass(shell, AsyncInventory):
        async with shell.from_url(url) as inventory, AsyncLeaseManager.from_url(url) as leases:
            await inventory_steps(inventory, leases, step)
    else:
        with shell.from_url(url) as inventory, LeaseManager.from_url(url) as leases:
            await inventory_steps(inventory, leases, step)
    return step


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_both_inventory_shells_answer_one_sequence_alike(
    kind: str, tmp_path: Path, migrated_sqlite: Path
) -> None:
    with fresh_inventories(kind, tmp_path, migrated_sqlite) as (one, other):
        blocking = await run_inventory(Inventory, one)
        awaiting = await run_inventory(AsyncInventory, other)
    assert differences(blocking, awaiting) == []
    # What the sequence leaves, so that two shells going wrong alike do not pass. A: 10, restocked 5,
    # adjusted -1, 3 confirmed, counted one short, restocked 1 under its second lease (token 2); held: 1
    # by the order, 1 by the queued request.
    answers = dict(blocking.entries)
    level = {"sku": "A", "on_hand": 11, "reserved": 2, "available": 9, "fence_token": 2}
    assert answers["stock"] == {"": "StockLevel", **level}
    assert answers["violations"] == []
    assert answers["rejections"] == {"A": 1}
    assert answers["due"] == ["B"]
    held = [(r["sku"], r["quantity"]) for r in answers["held"]]
    assert held == [("A", 1), ("A", 1), ("B", 2), ("HOT", 1), ("HOT", 1), ("HOT", 1)]
    assert answers["pending"] == 4 and answers["purge ended"] == 1
    assert len(answers["serve"]) == 2 and len(answers["serve rest"]) == 1


async def test_the_comparison_finds_the_steps_of_an_operation_that_drifted(
    tmp_path: Path, migrated_sqlite: Path
) -> None:
    """The comparison itself: an async shell whose history read keeps five entries at most, which no
    expectation of the scenario notices, is told apart exactly at the steps that read the history."""

    class Drifted(AsyncInventory):
        @operation
        def history(
            self, sku: str, *, limit: int = 1000, since: float | None = None
        ) -> Plan[list[HistoryEntry]]:
            return reads.history(sku, limit=min(limit, 5), since=since)

    with fresh_inventories("sqlite", tmp_path, migrated_sqlite) as (one, other):
        blocking = await run_inventory(Inventory, one)
        drifted = await run_inventory(Drifted, other)
    assert [name for name, _, _ in differences(blocking, drifted)] == ["history", "timeline"]


@pytest.fixture(params=["redis", "sqlite", "postgresql"])
def lease_urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[dict[str, str], ...]]:
    """``from_url`` arguments of two fresh lease backends of one kind: the sync shell's and the async's."""
    if request.param == "redis":
        with own_redis_prefix() as one, own_redis_prefix() as other:
            yield {"url": REDIS_URL, "prefix": one}, {"url": REDIS_URL, "prefix": other}
    elif request.param == "postgresql":
        with own_pg_schema() as one, own_pg_schema() as other:
            yield {"url": one}, {"url": other}
    else:
        yield (
            {"url": f"sqlite:///{tmp_path / 'sync.sqlite3'}"},
            {"url": f"sqlite:///{tmp_path / 'async.sqlite3'}"},
        )


async def test_both_lease_managers_answer_one_sequence_alike(lease_urls: tuple[dict[str, str], ...]) -> None:
    one, other = lease_urls
    blocking, awaiting = Transcript(awaits=False), Transcript(awaits=True)
    with LeaseManager.from_url(**one) as leases:
        leases.create_schema()
        await lease_steps(leases, blocking)
    async with AsyncLeaseManager.from_url(**other) as async_leases:
        await async_leases.create_schema()
        await lease_steps(async_leases, awaiting)
    assert differences(blocking, awaiting) == []
    events = [(event["event"], event["token"]) for event in dict(blocking.entries)["history"]]
    assert events[-5:] == [  # Redis keeps the last few epochs only: the first acquisition has gone there
        ("released", 1),
        ("acquired", 2),
        ("repaired", 7),
        ("acquired", 8),
        ("broken", 8),
    ]


# -- what each shell constructs and holds itself -----------------------------------------------------------


async def test_the_async_before_statement_runs_before_each_fenced_statement(inventory_url: str) -> None:
    """``before_statement`` reaches the plans through the async shell's own ``from_url`` (called, not
    awaited)."""
    seen: list[int] = []
    async with (
        AsyncInventory.from_url(
            inventory_url, before_statement=lambda lease: seen.append(lease.token)
        ) as inv,
        AsyncLeaseManager.from_url(inventory_url) as leases,
    ):
        await inv.add_sku("HOOK", on_hand=5)
        lease = await leases.acquire(scope_of("HOOK"), ttl=30)
        await inv.reserve(lease, "HOOK", 1, key="hooked")
        assert seen and set(seen) == {lease.token}


@pytest.mark.parametrize("awaits", [False, True], ids=["sync", "async"])
async def test_hold_many_renews_at_the_interval_asked(inventory_url: str, awaits: bool) -> None:
    """Each shell's renewal (a thread, a task) renews at the interval asked and releases on the way out;
    with a 30 s ttl the default renewal would come after 10 s."""
    step = Transcript(awaits=awaits)
    shells = (AsyncInventory, AsyncLeaseManager) if awaits else (Inventory, LeaseManager)
    inventory, leases = shells[0].from_url(inventory_url), shells[1].from_url(inventory_url)
    try:
        with pytest.raises(InvalidLeaseRequest):
            async with step.entered("bad", inventory.hold_many(leases, ["A"], ttl=30, renew_every=-1)):
                pass
        async with step.entered(
            "held", inventory.hold_many(leases, ["B", "A"], ttl=30, renew_every=0.05)
        ) as held:
            assert list(held) == ["A", "B"]
            first = {sku: lease.expires_at for sku, lease in held.items()}
            deadline = time.monotonic() + 5
            while any(held[sku].expires_at == first[sku] for sku in held):
                assert time.monotonic() < deadline, "no renewal at the interval asked"
                await asyncio.sleep(0.01)  # yields to the renewal tasks, and lets the thread run
        assert all(lease.lost for lease in held.values())
    finally:
        for shell in (inventory, leases):
            closed = shell.close()
            if inspect.isawaitable(closed):
                await closed


# -- the signatures of what is still written twice -----------------------------------------------------------

# Dunders of the public face: construction and the context-manager protocol (a sync shell's ``with`` is an
# async shell's ``async with``).
_FACE_DUNDERS = ("__init__", "__enter__", "__exit__", "__aenter__", "__aexit__")
_NATURAL_TWINS = {"__aenter__": "__enter__", "__aexit__": "__exit__"}


@dataclass(frozen=True)
class Pair:
    """A sync shell and its async twin. ``twin`` names the sync member an async member mirrors; the
    allow-lists hold members that have no twin, each with the reason."""

    sync: type
    async_: type
    twin: Callable[[str], str] = lambda name: _NATURAL_TWINS.get(name, name)
    sync_only: dict[str, str] = field(default_factory=dict)
    async_only: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return (
            self.sync.__name__ if self.sync is self.async_ else f"{self.sync.__name__}/{self.async_.__name__}"
        )


def _client_twin(name: str) -> str:
    """In the producer's client one class holds both: ``enqueue`` pairs with ``enqueue_sync``."""
    return {"aclose": "close", **_NATURAL_TWINS}.get(name, f"{name}_sync")


PAIRS = [
    Pair(Inventory, AsyncInventory),
    Pair(LeaseManager, AsyncLeaseManager),
    # A blocking shell drives its plans in the executor's unit of work itself; an awaiting one awaits run.
    Pair(SyncSqlExecutor, AsyncSqlExecutor, sync_only={"unit": "driven by the blocking shells only"}),
    Pair(SyncRedisExecutor, AsyncRedisExecutor, sync_only={"unit": "driven by the blocking shells only"}),
    Pair(
        ReservationClient,
        ReservationClient,
        twin=_client_twin,
        async_only={
            "enqueue_order": "no enqueue_order_sync yet; enqueue_sync('reserve_order', ...) serves",
            "publish_recorded": "a request recorded already, published by the event loop's publishing thread",
            "admit": "the front door's, admitted with what else came by the event loop's publishing thread",
        },
    ),
    Pair(ReservationHandle, ReservationHandle, twin=_client_twin),
]


def _members(cls: type) -> dict[str, Any]:
    """The class's public face: public attributes, inherited ones too, and the face dunders it defines
    beyond ``object``'s. An operation is taken as the method it makes on this class."""
    found = {}
    for name in dir(cls):
        if name.startswith("_") and name not in _FACE_DUNDERS:
            continue
        value = inspect.getattr_static(cls, name)
        if name.startswith("_") and value is inspect.getattr_static(object, name, None):
            continue
        found[name] = getattr(cls, name) if isinstance(value, operation) else value
    return found


def _is_awaitable_api(value: Any) -> bool:
    """A coroutine function, or an async context manager's factory (``@asynccontextmanager``)."""
    function = value.__func__ if isinstance(value, classmethod | staticmethod) else value
    if inspect.iscoroutinefunction(function):
        return True
    wrapped = getattr(function, "__wrapped__", None)
    return wrapped is not None and inspect.isasyncgenfunction(wrapped)


def _sides(pair: Pair) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sync members, async members). A class that holds both sides is split: its awaitable methods on
    the async side, the blocking ones (but the shared ``__init__``) on the sync side."""
    sync, async_ = _members(pair.sync), _members(pair.async_)
    if pair.sync is not pair.async_:
        return sync, async_
    methods = {n: v for n, v in sync.items() if inspect.isfunction(v) and n != "__init__"}
    return (
        {n: v for n, v in methods.items() if not _is_awaitable_api(v)},
        {n: v for n, v in methods.items() if _is_awaitable_api(v)},
    )


def _shape(value: Any) -> list[tuple[str, str, object]]:
    """Each parameter's name, kind and default; callable defaults (``time.sleep`` against
    ``asyncio.sleep``) differ by nature and are compared as present only."""
    function = value.fget if isinstance(value, property) else value
    if isinstance(function, classmethod | staticmethod):
        function = function.__func__
    if not callable(function):
        return []
    shape = []
    for parameter in inspect.signature(function).parameters.values():
        default = parameter.default
        if default is not inspect.Parameter.empty and callable(default):
            default = "<callable>"
        shape.append((parameter.name, parameter.kind.name, default))
    return shape


def parity_problems(pair: Pair) -> list[str]:
    """Everything that keeps the pair from being twins; empty when they are."""
    sync, async_ = _sides(pair)
    problems = []
    mirrored = {pair.twin(name): name for name in async_}
    for name in sorted(set(sync) - set(mirrored) - set(pair.sync_only)):
        problems.append(f"{pair.name}: {name} has no async twin")
    for sync_name, name in sorted(mirrored.items()):
        if sync_name not in sync and name not in pair.async_only:
            problems.append(f"{pair.name}: {name} has no sync twin {sync_name}")
    for name in sorted(set(pair.sync_only) & set(mirrored)):
        problems.append(f"{pair.name}: {name} is allow-listed as sync-only but has an async twin")
    for name in sorted(pair.async_only):
        if name not in async_ or pair.twin(name) in sync:
            problems.append(f"{pair.name}: {name} is allow-listed as async-only but is not")
    for sync_name, name in sorted(mirrored.items()):
        if sync_name not in sync:
            continue
        sync_value, async_value = sync[sync_name], async_[name]
        if _shape(sync_value) != _shape(async_value):
            problems.append(f"{pair.name}: {name} takes {_shape(async_value)}, its twin {_shape(sync_value)}")
        if name in _FACE_DUNDERS and name not in _NATURAL_TWINS:
            continue  # __init__ is plain on both sides
        if inspect.isfunction(sync_value) and _is_awaitable_api(sync_value):
            problems.append(f"{pair.name}: {sync_name} is awaitable in the blocking shell")
        if inspect.isfunction(async_value) and not _is_awaitable_api(async_value):
            problems.append(f"{pair.name}: {name} blocks in the asyncio shell")
    return problems


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair.name)
def test_the_sync_and_async_shells_are_twins(pair: Pair) -> None:
    assert parity_problems(pair) == []


def test_the_parity_check_sees_a_missing_method_a_changed_parameter_and_a_wrong_kind() -> None:
    """The check itself: a method missing on either side, a parameter renamed, and an operation made on a
    shell that says it awaits while its twin does not, are each found."""

    class Blocking:
        awaits = False

        def __init__(self, url: str) -> None: ...
        def read(self, key: str, *, limit: int = 10) -> None: ...
        def write(self, key: str) -> None: ...
        def close(self) -> None: ...
        def __enter__(self) -> Blocking:
            return self

        def __exit__(self, *exc: object) -> None: ...

        @operation
        def look(self, key: str) -> Plan[Any]:
            return reads.all_stock()

    class Awaiting:
        awaits = False  # wrong: its operations come out blocking

        def __init__(self, url: str) -> None: ...
        async def read(self, key: str, *, maximum: int = 10) -> None: ...
        async def close(self) -> None: ...
        async def extra(self) -> None: ...
        def blocking(self) -> None: ...
        async def __aenter__(self) -> Awaiting:
            return self

        async def __aexit__(self, *exc: object) -> None: ...

        look = Blocking.__dict__["look"]

    problems = parity_problems(Pair(Blocking, Awaiting))
    assert any("write has no async twin" in p for p in problems), problems
    assert any("extra has no sync twin" in p for p in problems), problems
    assert any("blocking has no sync twin" in p for p in problems), problems
    assert any(p.startswith("Blocking/Awaiting: read takes") for p in problems), problems
    assert any("look blocks in the asyncio shell" in p for p in problems), problems
    assert len(problems) == 5, problems
    Awaiting.awaits = True
    assert not any("look" in p for p in parity_problems(Pair(Blocking, Awaiting)))
    assert parity_problems(Pair(Blocking, Awaiting, sync_only={"write": "w"}, async_only={"read": "r"}))


def test_an_operation_keeps_its_name_parameters_and_docstring() -> None:
    """``help()`` shows each operation as written: same parameters (keyword-only markers, defaults) and
    docstring on both shells, the plan's result as what it returns, and ``async`` on the async one."""
    assert not Inventory.awaits and not LeaseManager.awaits
    assert AsyncInventory.awaits and AsyncLeaseManager.awaits
    count = AsyncInventory.count
    assert count.__name__ == "count" and count.__doc__ and count.__doc__.startswith("A cycle count")
    assert inspect.iscoroutinefunction(count) and not inspect.iscoroutinefunction(Inventory.count)
    parameters = inspect.signature(Inventory.count).parameters
    assert [(p.name, p.kind.name, p.default) for p in parameters.values()][-3:] == [
        ("key", "KEYWORD_ONLY", inspect.Parameter.empty),
        ("seen", "KEYWORD_ONLY", None),
        ("shrinkage", "KEYWORD_ONLY", None),
    ]
    assert inspect.signature(AsyncLeaseManager.acquire).return_annotation == "Lease"
    assert Inventory.cancel.__name__ == "release"  # an alias, as it was
