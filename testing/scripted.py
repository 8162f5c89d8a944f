"""Plans (:mod:`fencing.plan`) stepped through with scripted answers, for the tests of their decisions.

A :class:`Script` plays the shell: it hands a plan, one by one, the replies the database, Redis or a
nested step would have given, and records every operation the plan asked for. The replies are what the
test is about: the plan's decisions on them are what it checks.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite

from fencing.plan import Atomic, Op, Sleep, run_sync
from fencing.sql import Rows


@dataclass
class Clock:
    """The monotonic clock the plans read; only a scripted pause moves it."""

    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Raises:
    """A reply that is an error: the operation failed, as a shell raises it into the plan (a unique key
    taken, a database that did not answer)."""

    error: Exception


@dataclass
class Script:
    """The replies to a plan's operations, in order; a :class:`Raises` among them is raised into the plan.
    A :class:`Sleep` is answered by moving the clock, never from the replies. An :class:`Atomic` step is
    answered by a reply standing for its whole result (a nested plan's answer may be an error it returns,
    such as a ``LeaseBusy``), or with ``nested`` by running its plan on the following replies, as a shell
    runs it in a transaction of its own: its result or error is what the outer plan gets. ``ops`` records
    every operation asked for, the nested ones included."""

    replies: list[Any]
    clock: Clock = field(default_factory=Clock)
    nested: bool = False
    ops: list[Op] = field(default_factory=list)

    def answer(self, op: Op) -> Any:
        self.ops.append(op)
        if isinstance(op, Sleep):
            self.clock.now += op.seconds
            return None
        if self.nested and isinstance(op, Atomic):
            return run_sync(op.plan, self.answer)
        assert self.replies, f"the plan asked for more than the script answers: {op!r}"
        reply = self.replies.pop(0)
        if isinstance(reply, Raises):
            raise reply.error
        return reply

    def run(self, plan: Generator[Any, Any, Any]) -> Any:
        """The plan's result; every scripted reply must have been asked for."""
        result = run_sync(plan, self.answer)
        assert not self.replies, f"replies the plan never asked for: {self.replies!r}"
        return result

    @property
    def sleeps(self) -> list[float]:
        return [op.seconds for op in self.ops if isinstance(op, Sleep)]


def rows(*found: Any) -> Rows:
    return Rows(rows=list(found))


def kinds(ops: list[Op]) -> list[str]:
    """The operations as their kind: the statement's (``update fenced_items``) or the op's class name."""
    named = []
    for op in ops:
        if isinstance(op, sa.Update | sa.Insert | sa.Delete):
            named.append(f"{type(op).__name__.lower()} {op.table.name}")  # type: ignore[union-attr]
        elif isinstance(op, sa.Select):
            named.append(f"select {op.get_final_froms()[0].name}")  # type: ignore[attr-defined]
        else:
            named.append(type(op).__name__)
    return named


def sql_text(op: Op) -> str:
    """A statement as SQLite is sent it."""
    assert isinstance(op, sa.ClauseElement), op
    return str(op.compile(dialect=sqlite.dialect()))


def sql_params(op: Op) -> dict[str, Any]:
    """A statement's bound values, as SQLite is sent them."""
    assert isinstance(op, sa.ClauseElement), op
    return dict(op.compile(dialect=sqlite.dialect()).params)
