"""Plans: the one core behind the sync and async shells (docs/architecture.md, "Sync and async").

A plan is a generator that *yields* the I/O it needs (an :data:`Op`) and receives the result; the shells
only drive it, so they cannot drift apart. :class:`operation` makes a shell method of a plan.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Awaitable, Callable, Coroutine, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import MethodType
from typing import (
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    Protocol,
    TypeAlias,
    TypeVar,
    get_args,
    get_origin,
    overload,
)

from sqlalchemy.sql.expression import Executable

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Sleep:
    """Pause the plan; the shell uses its injected sleep (``time.sleep`` or ``asyncio.sleep``)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Alone:
    """One statement that is a whole transaction by itself: in autocommit on PostgreSQL, in a transaction
    of its own on SQLite (docs/architecture.md, "One statement and the portable plan"). ``statement`` is a
    SQLAlchemy statement (with ``params``, possibly sent on the driver's cursor:
    :func:`fencing.sql.driver_text`), or driver-level SQL with named ``%(name)s`` parameters in
    ``params`` (PostgreSQL only). The shell answers with its rows."""

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


@dataclass(frozen=True, slots=True)
class Gateway:
    """One call to etcd's JSON gateway: a path under ``/v3/`` (``kv/txn``, ``lease/grant``) and its body;
    the shell answers with the decoded reply."""

    path: str
    body: dict[str, Any]


# A SQLAlchemy statement (select, insert, update, delete, text), run in the plan's transaction.
Statement: TypeAlias = Executable | Bound

# Everything a plan may yield. A SQL executor refuses the Redis operations and a Redis executor the SQL
# ones, with a TypeError: a plan is written for one backend's core.
Op: TypeAlias = Sleep | Alone | Atomic | ScriptCall | ScriptCalls | Command | Gateway | Statement

# What a plan receives back is the answer to the operation it yielded (rows, a script's reply, a nested
# plan's result), so it is typed by the plan where it lands rather than here.
Plan: TypeAlias = Generator[Op, Any, T]

# A plan that only sends statements, so it can run inside a transaction its caller already holds (the
# fence's guarded write); it is a Plan too, and fits wherever one is yielded from.
StatementPlan: TypeAlias = Generator[Statement, Any, T]

OpT = TypeVar("OpT")  # the operations of the plan being driven: all of Op, or fewer (or an exchange's)


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


def taken(answer: Any) -> Any:
    """A blocking executor's answer, taken as it is: where an async shell runs the same executor in
    SQLAlchemy's greenlet bridge, its step is ``await_only`` instead."""
    return answer


def foreign(executor: str, op: Op) -> TypeError:
    """The error for an operation of another backend's plans, which this executor cannot run."""
    return TypeError(f"the {executor} executor cannot run {type(op).__name__}")


P = ParamSpec("P")
R = TypeVar("R")


class BlockingExecutor(Protocol):
    """Opens a unit of work (the SQL executors' transaction) whose operations block (the sync SQL and
    Redis executors); :func:`fencing.plan.run_sync` drives a plan through it."""

    def unit(self) -> AbstractContextManager[Callable[[Op], Any]]: ...


class AwaitingExecutor(Protocol):
    """Drives a plan when awaited (the async SQL and Redis executors)."""

    def run(self, plan: Plan[R], /) -> Awaitable[R]: ...


class BlockingShell(Protocol):
    @property
    def executor(self) -> BlockingExecutor: ...


class AwaitingShell(Protocol):
    @property
    def executor(self) -> AwaitingExecutor: ...


class operation(Generic[P, T]):
    """A shell method written once as the plan it runs (docs/architecture.md, "Sync and async"): blocking
    where the shell's class says ``awaits = False``, a coroutine function where it says ``awaits = True``
    (the plan is built, and its arguments checked, when the call is awaited, as in an ``async def``). Its
    return annotation is its plan's result type, and ``__wrapped__`` the plan builder."""

    def __init__(self, build: Callable[Concatenate[Any, P], Plan[T]], *, named: bool = True) -> None:
        self.build = build
        self._blocking = _dressed(_blocking(build), build)
        self._awaiting = _dressed(_awaiting(build), build)
        self.__doc__ = build.__doc__
        self._named = named

    @classmethod
    def of(cls, plan: Callable[P, Plan[T]]) -> operation[P, T]:
        """The operation that only runs the module-level ``plan`` with the caller's arguments, named as the
        shell's attribute it is assigned to, with ``plan``'s parameters and docstring."""

        def build(self: Any, /, *args: Any, **kwargs: Any) -> Plan[T]:
            return plan(*args, **kwargs)

        functools.update_wrapper(build, plan)
        signature = inspect.signature(plan)
        shell = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        build.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[shell, *signature.parameters.values()]
        )
        return cls(build, named=False)

    def __set_name__(self, owner: type[Any], name: str) -> None:
        if not self._named:  # made by ``of``: the method takes the attribute's name (an alias keeps it)
            self._named = True
            for method in (self.build, self._blocking, self._awaiting):
                method.__name__, method.__qualname__ = name, f"{owner.__qualname__}.{name}"

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> Callable[Concatenate[Any, P], Any]: ...

    @overload
    def __get__(self, instance: BlockingShell, owner: type[Any] | None = None) -> Callable[P, T]: ...

    @overload
    def __get__(
        self, instance: AwaitingShell, owner: type[Any] | None = None
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...

    def __get__(self, instance: object, owner: type[Any] | None = None) -> Callable[..., Any]:
        shell: Any = type(instance) if owner is None else owner  # a class that says whether it awaits
        method = self._awaiting if shell.awaits else self._blocking
        return method if instance is None else MethodType(method, instance)


# A blocking method drives the plan itself in the executor's unit of work, not through the executor's
# ``run``: one frame fewer on every write (docs/architecture.md, "A write's path, in frames"). An awaiting
# one awaits ``run``: the async SQL executor runs a whole plan in one greenlet.


def _blocking(build: Callable[..., Plan[Any]]) -> Callable[..., Any]:
    def method(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        plan = build(self, *args, **kwargs)
        with self.executor.unit() as handle:
            return run_sync(plan, handle)

    return method


def _awaiting(build: Callable[..., Plan[Any]]) -> Callable[..., Any]:
    async def method(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        return await self.executor.run(build(self, *args, **kwargs))

    return method


def _dressed(method: Callable[..., Any], build: Callable[..., Plan[Any]]) -> Callable[..., Any]:
    """``method`` with the name, docstring and parameters of ``build``, returning what its plan does."""
    functools.update_wrapper(method, build)
    signature = inspect.signature(build)
    result = _plan_result(signature.return_annotation)
    method.__signature__ = signature.replace(return_annotation=result)  # type: ignore[attr-defined]
    method.__annotations__ = {**build.__annotations__, "return": result}
    return method


_PLAN = re.compile(r"(?:Plan|StatementPlan)\[(?P<result>.*)\]", re.DOTALL)


def _plan_result(annotation: Any) -> Any:
    """``T`` of a ``Plan[T]`` annotation (a string under postponed evaluation); anything else as it is."""
    if isinstance(annotation, str) and (found := _PLAN.fullmatch(annotation.strip())):
        return found["result"]
    if get_origin(annotation) is Generator:
        return get_args(annotation)[2]
    return annotation
