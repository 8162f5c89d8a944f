"""Plans: the one core behind the sync and async shells.

Every lease and fence operation is written once, as a generator that *yields* the I/O it needs (a Redis
script call, a SQL statement, a pause, an inner atomic step) and receives the result. A sync shell and an
async shell each drive it; neither contains decisions, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

Plan = Generator[Any, Any, T]


@dataclass(frozen=True, slots=True)
class Sleep:
    """Pause the plan; the shell uses its injected sleep (``time.sleep`` or ``asyncio.sleep``)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Alone:
    """One statement that is a whole transaction by itself: on PostgreSQL sent without BEGIN and COMMIT
    (autocommit), so it costs one round trip and holds no lock past its own execution; SQLite runs it in
    a transaction of its own. ``statement`` is a SQLAlchemy statement, or driver-level SQL with named
    ``%(name)s`` parameters in ``params`` (PostgreSQL only). The shell answers with its rows."""

    statement: Any
    params: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Atomic:
    """Run ``plan`` as its own unit (its own transaction on SQL) and send back its result or error."""

    plan: Plan[Any]


def run_sync(plan: Plan[T], handle: Callable[[Any], Any]) -> T:
    """Drive ``plan`` to completion, performing each yielded operation with ``handle``."""
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            op = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value, error = None, None
        try:
            value = handle(op)
        except Exception as exc:  # handed to the plan, which re-raises what it does not handle
            error = exc


async def run_async(plan: Plan[T], handle: Callable[[Any], Awaitable[Any]]) -> T:
    """The async twin of :func:`run_sync`: same plan, awaited operations."""
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            op = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value, error = None, None
        try:
            value = await handle(op)
        except Exception as exc:
            error = exc
