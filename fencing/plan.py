"""Plans: the one core behind the sync and async shells.

Every lease and fence operation is written once, as a generator that *yields* the I/O it needs (an
:data:`Op`: a SQL statement, a Redis script call or command, a pause, an inner atomic step) and receives
the result. A sync shell and an async shell each drive it; neither contains decisions, so the two cannot
drift apart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from sqlalchemy.sql.expression import Executable

T = TypeVar("T")


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

    statement: Executable | str
    params: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Atomic:
    """Run ``plan`` as its own unit (its own transaction on SQL) and send back its result or error."""

    plan: Plan[Any]


@dataclass(frozen=True, slots=True)
class Bound:
    """A statement built once with bind parameters, and this execution's values for them. A ``str`` is
    driver-level SQL in the driver's parameter style, sent as it is: nothing to compile, whatever the
    number of rows its parameters carry."""

    statement: Executable | str
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """One Lua script run on Redis (registered once per client); the shell answers with its reply."""

    source: str
    keys: tuple[str, ...]
    args: tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class ScriptCalls:
    """One Lua script run over many key sets (``calls``: the keys and args of each), in one round trip
    where the client pipelines them (one server, a Sentinel-managed primary) and one call after another
    on a Cluster; the shell answers with the replies, in order. For reads of many scopes at once."""

    source: str
    calls: tuple[tuple[tuple[str, ...], tuple[str | int, ...]], ...]


@dataclass(frozen=True, slots=True)
class Command:
    """One plain Redis command; the shell answers with its reply."""

    args: tuple[str | int, ...]


# A SQLAlchemy statement (select, insert, update, delete, text), run in the plan's transaction.
Statement: TypeAlias = Executable | Bound

# Everything a plan may yield. A SQL executor refuses the Redis operations and a Redis executor the SQL
# ones, with a TypeError: a plan is written for one backend's core.
Op: TypeAlias = Sleep | Alone | Atomic | ScriptCall | ScriptCalls | Command | Statement

# What a plan receives back is the answer to the operation it yielded (rows, a script's reply, a nested
# plan's result), so it is typed by the plan where it lands rather than here.
Plan: TypeAlias = Generator[Op, Any, T]

# A plan that only sends statements, so it can run inside a transaction its caller already holds (the
# fence's guarded write); it is a Plan too, and fits wherever one is yielded from.
StatementPlan: TypeAlias = Generator[Statement, Any, T]

OpT = TypeVar("OpT", bound=Op)  # the operations of the plan being driven: all of Op, or fewer


def run_sync(plan: Generator[OpT, Any, T], handle: Callable[[OpT], Any]) -> T:
    """Drive ``plan`` to completion, performing each yielded operation with ``handle``."""
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            op = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            result: T = stop.value
            return result
        value, error = None, None
        try:
            value = handle(op)
        except Exception as exc:  # handed to the plan, which re-raises what it does not handle
            error = exc


async def run_async(plan: Generator[OpT, Any, T], handle: Callable[[OpT], Awaitable[Any]]) -> T:
    """The async twin of :func:`run_sync`: same plan, awaited operations."""
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            op = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            result: T = stop.value
            return result
        value, error = None, None
        try:
            value = await handle(op)
        except Exception as exc:
            error = exc


def foreign(executor: str, op: Op) -> TypeError:
    """The error for an operation of another backend's plans, which this executor cannot run."""
    return TypeError(f"the {executor} executor cannot run {type(op).__name__}")
