"""The sync and async shells stay twins: every pair offers the same public methods with the same
parameters, blocking on one side and awaitable on the other, except the members listed (with why) in
the allow-lists below. Then the async inventory's methods that only the sync shell used to have, run
against SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

from fencing import AsyncLeaseManager, InvalidLeaseRequest, Lease, LeaseManager
from fencing.engines import make_engine
from fencing.redis_executor import AsyncRedisExecutor, SyncRedisExecutor
from fencing.sql_executor import AsyncSqlExecutor, SyncSqlExecutor
from reservations import AsyncInventory, InvalidRequest, Inventory, scope_of
from reservations.models import request_outcomes, task_attempts
from tasks.client import ReservationClient, ReservationHandle

# Dunders that belong to the public face: construction and the context-manager protocol. A sync
# shell's ``with`` is an async shell's ``async with``.
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
        if self.sync is self.async_:
            return self.sync.__name__
        return f"{self.sync.__name__}/{self.async_.__name__}"


def _client_twin(name: str) -> str:
    """In the producer's client one class holds both: ``enqueue`` pairs with ``enqueue_sync``."""
    return {"aclose": "close", **_NATURAL_TWINS}.get(name, f"{name}_sync")


PAIRS = [
    Pair(Inventory, AsyncInventory),
    Pair(LeaseManager, AsyncLeaseManager),
    Pair(SyncSqlExecutor, AsyncSqlExecutor),
    Pair(SyncRedisExecutor, AsyncRedisExecutor),
    Pair(
        ReservationClient,
        ReservationClient,
        twin=_client_twin,
        async_only={
            # Not async by nature: a gap to close in tasks/client.py with an enqueue_order_sync. Until
            # then a blocking producer sends an order as enqueue_sync("reserve_order", lines=...), whose
            # lines the worker's message check validates instead of the client.
            "enqueue_order": "no enqueue_order_sync yet; enqueue_sync('reserve_order', ...) serves",
        },
    ),
    Pair(ReservationHandle, ReservationHandle, twin=_client_twin),
]


def _members(cls: type) -> dict[str, Any]:
    """The class's public face: public attributes, including inherited ones, and the face dunders it
    defines beyond ``object``'s."""
    found = {}
    for name in dir(cls):
        if name.startswith("_") and name not in _FACE_DUNDERS:
            continue
        value = inspect.getattr_static(cls, name)
        if name.startswith("_") and value is inspect.getattr_static(object, name, None):
            continue
        found[name] = value
    return found


def _is_awaitable_api(value: Any) -> bool:
    """A coroutine function, or an async context manager's factory (``@asynccontextmanager``)."""
    function = value.__func__ if isinstance(value, classmethod | staticmethod) else value
    if inspect.iscoroutinefunction(function):
        return True
    wrapped = getattr(function, "__wrapped__", None)
    return wrapped is not None and inspect.isasyncgenfunction(wrapped)


def _is_plain_function(value: Any) -> bool:
    return inspect.isfunction(value)


def _sides(pair: Pair) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sync members, async members). For a class that holds both sides, its methods are split: the
    awaitable ones on the async side, the blocking ones (but the shared ``__init__``) on the sync side."""
    sync, async_ = _members(pair.sync), _members(pair.async_)
    if pair.sync is not pair.async_:
        return sync, async_
    methods = {n: v for n, v in sync.items() if _is_plain_function(v) and n != "__init__"}
    return (
        {n: v for n, v in methods.items() if not _is_awaitable_api(v)},
        {n: v for n, v in methods.items() if _is_awaitable_api(v)},
    )


def _shape(value: Any) -> list[tuple[str, str, object]]:
    """Each parameter's name, kind and default. Defaults that are callables (``time.sleep`` against
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
        if _is_plain_function(sync_value) and _is_awaitable_api(sync_value):
            problems.append(f"{pair.name}: {sync_name} is awaitable in the blocking shell")
        if _is_plain_function(async_value) and not _is_awaitable_api(async_value):
            problems.append(f"{pair.name}: {name} blocks in the asyncio shell")
    return problems


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair.name)
def test_the_sync_and_async_shells_are_twins(pair: Pair) -> None:
    assert parity_problems(pair) == []


def test_the_parity_check_sees_a_missing_method_and_a_changed_parameter() -> None:
    """The check itself: a method missing on either side, and one parameter renamed, are each found."""

    class Blocking:
        def __init__(self, url: str) -> None: ...
        def read(self, key: str, *, limit: int = 10) -> None: ...
        def write(self, key: str) -> None: ...
        def close(self) -> None: ...
        def __enter__(self) -> Blocking:
            return self

        def __exit__(self, *exc: object) -> None: ...

    class Awaiting:
        def __init__(self, url: str) -> None: ...
        async def read(self, key: str, *, maximum: int = 10) -> None: ...
        async def close(self) -> None: ...
        async def extra(self) -> None: ...
        def blocking(self) -> None: ...
        async def __aenter__(self) -> Awaiting:
            return self

        async def __aexit__(self, *exc: object) -> None: ...

    problems = parity_problems(Pair(Blocking, Awaiting))
    assert any("write has no async twin" in p for p in problems), problems
    assert any("extra has no sync twin" in p for p in problems), problems
    assert any("blocking has no sync twin" in p for p in problems), problems
    assert any(p.startswith("Blocking/Awaiting: read takes") for p in problems), problems
    assert len(problems) == 4, problems
    assert parity_problems(Pair(Blocking, Awaiting, sync_only={"write": "w"}, async_only={"read": "r"}))


# -- the async inventory's methods, on SQLite and PostgreSQL -------------------------------------------


def lease_for(leases: LeaseManager, sku: str, holder: str = "holder") -> Lease:
    return leases.acquire(scope_of(sku), ttl=30, holder=holder)


async def test_async_batching_reads_and_the_purge_of_ended_waits(
    inventory_url: str, leases: LeaseManager
) -> None:
    async with AsyncInventory.from_url(inventory_url) as inventory:
        await inventory.add_sku("HOT", on_hand=10)
        await inventory.add_sku("COLD", on_hand=1)
        assert await inventory.has_pending("HOT") is False
        for i in range(3):
            await inventory.hand_off("HOT", 1, key=f"w-{i}")
        await inventory.hand_off("COLD", 1, key="cold-0")
        assert await inventory.has_pending("HOT") is True
        assert await inventory.waiting_by_sku() == {"COLD": 1, "HOT": 3}
        assert sorted(await inventory.skus_waiting(older_than=0)) == ["COLD", "HOT"]
        assert await inventory.skus_waiting(older_than=3600) == []
        with pytest.raises(InvalidRequest):
            await inventory.skus_waiting(older_than=-1)
        # A waiting request that ended on its own (dead-lettered) is dropped by the purge; the rest wait.
        await inventory.record_outcome("cold-0", "reserve", "dead_lettered", {"reason": "test"})
        assert await inventory.purge_ended_waits() == 1
        assert await inventory.waiting_by_sku() == {"HOT": 3}
        assert await inventory.purge_ended_waits() == 0
        await inventory.serve_pending(lease_for(leases, "HOT"), "HOT", limit=10)
        assert await inventory.has_pending("HOT") is False
        assert await inventory.waiting_by_sku() == {}


async def test_async_attempts_are_recorded_and_old_requests_purged(inventory_url: str) -> None:
    async with AsyncInventory.from_url(inventory_url) as inventory:
        await inventory.record_attempt("k-1", "reserve", "busy", task_id="t-1", worker="w:1")
        await inventory.record_attempt("k-1", "reserve", "applied", task_id="t-2", worker="w:1", token=7)
        attempts = await inventory.attempts("k-1")
        seen = [(a.result, a.task_id, a.token) for a in attempts]
        assert seen == [("busy", "t-1", None), ("applied", "t-2", 7)]
        with pytest.raises(InvalidRequest):
            await inventory.record_attempt("k-1", "reserve", "bogus")
        with pytest.raises(InvalidRequest):
            await inventory.record_attempt("k-1", "reserve", "applied", unknown="x")
        await inventory.record_outcome("k-1", "reserve", "reserved", {})
        await inventory.record_outcome("k-2", "reserve", "reserved", {})

        assert await inventory.purge_requests(older_than=3600) == 0
        engine = make_engine(inventory_url)
        with engine.begin() as conn:  # age k-1's outcome and attempts by two hours
            for table in (request_outcomes, task_attempts):
                aged = table.c.at_ms - 7_200_000
                conn.execute(sa.update(table).where(table.c.key == "k-1").values(at_ms=aged))
        engine.dispose()
        assert await inventory.purge_requests(older_than=3600) == 1
        assert await inventory.request_outcome("k-1") is None
        assert await inventory.attempts("k-1") == []
        assert await inventory.request_outcome("k-2") is not None
        with pytest.raises(InvalidRequest):
            await inventory.purge_requests(older_than=1)


async def test_async_skus_with_due_holds_follow_the_database_clock(
    inventory_url: str, leases: LeaseManager
) -> None:
    async with AsyncInventory.from_url(inventory_url) as inventory:
        await inventory.add_sku("DUE", on_hand=5)
        await inventory.add_sku("LATER", on_hand=5)
        await inventory.reserve(lease_for(leases, "DUE"), "DUE", 1, key="short", hold_for=0.001)
        await inventory.reserve(lease_for(leases, "LATER"), "LATER", 1, key="long", hold_for=3600)
        deadline = time.monotonic() + 5
        while "DUE" not in await inventory.skus_with_due_holds():  # holds end by the database's clock
            assert time.monotonic() < deadline
        assert await inventory.skus_with_due_holds() == ["DUE"]
        with pytest.raises(InvalidRequest):
            await inventory.skus_with_due_holds(limit=0)


async def test_async_before_statement_runs_before_each_fenced_statement(
    inventory_url: str, leases: LeaseManager
) -> None:
    seen: list[int] = []
    hook = AsyncInventory.from_url(inventory_url, before_statement=lambda lease: seen.append(lease.token))
    async with hook as inventory:
        await inventory.add_sku("HOOK", on_hand=5)
        lease = lease_for(leases, "HOOK")
        await inventory.reserve(lease, "HOOK", 1, key="hooked")
        assert seen and set(seen) == {lease.token}


async def test_async_hold_many_renews_at_the_interval_asked(inventory_url: str) -> None:
    manager = AsyncLeaseManager.from_url(inventory_url)
    try:
        async with AsyncInventory.from_url(inventory_url) as inventory:
            with pytest.raises(InvalidLeaseRequest):
                async with inventory.hold_many(manager, ["A"], ttl=30, renew_every=-1):
                    pass
            # With a 30 s ttl the default renewal comes after 10 s; 0.05 s must renew well before that.
            async with inventory.hold_many(manager, ["B", "A"], ttl=30, renew_every=0.05) as held:
                assert list(held) == ["A", "B"]
                first = {sku: lease.expires_at for sku, lease in held.items()}
                deadline = time.monotonic() + 5
                while any(held[sku].expires_at == first[sku] for sku in held):
                    assert time.monotonic() < deadline, "no renewal at the interval asked"
                    await asyncio.sleep(0.01)  # yields to the renewal tasks; the loop is the deadline
            assert all(lease.lost for lease in held.values())  # released on the way out
    finally:
        await manager.close()
