"""The rules that live in :mod:`fencing` as SQLAlchemy expressions (the fence predicate, the database
clock), rendered as PostgreSQL text for the statements written by hand as one data-modifying CTE
(:mod:`reservations.reserve_statement`, :mod:`reservations.pending`). Those statements take the rule
from here, so it stays written once: a change to :meth:`fencing.Fence.admits` or to
:class:`fencing.sql.db_now_ms` changes them too. The same clock stamps the rows the portable plans insert
(:func:`stamped`, for each request table's one writer).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg

from fencing import Fence
from fencing.sql import db_now_ms

# The dialect the statements are sent with: psycopg renders a bind parameter as ``%(name)s``, with the
# cast of its type, as the hand-written statements name theirs.
_DIALECT = psycopg.dialect()  # type: ignore[no-untyped-call]


def render(expression: sa.ColumnElement[Any]) -> str:
    """``expression`` as PostgreSQL text, bind parameters as ``%(name)s``, in parentheses."""
    return f"({expression.compile(dialect=_DIALECT)})"


# The database's clock in milliseconds, as every fenced write stamps its rows.
NOW_MS = render(db_now_ms())


def stamped(table: sa.Table, at: str, rows: tuple[dict[str, Any], ...]) -> sa.Insert:
    """The portable insert of ``rows`` into ``table``, column ``at`` stamped by the database's clock (one
    row is sent as a single-row insert, as SQLAlchemy names its parameters)."""
    many = [{**row, at: db_now_ms()} for row in rows]
    return sa.insert(table).values(many[0] if len(many) == 1 else many)


def fence_admits(fence: Fence, *, token: str = "token", lease_id: str = "lease_id") -> str:
    """The fence predicate of ``fence``'s table, with the token and lease id as the named parameters."""
    return render(
        fence.admits(sa.bindparam(token, type_=sa.BigInteger), sa.bindparam(lease_id, type_=sa.String))
    )


@dataclass(frozen=True, slots=True)
class Sent:
    """A statement as sent, and the order of its parameters (named p0, p1, ... in its text)."""

    text: str
    names: tuple[str, ...]
    # (p0, name), (p1, name)...: bound on every call, so the placeholders are not formatted each time
    pairs: tuple[tuple[str, str], ...] = ()

    def bind(self, values: dict[str, Any]) -> dict[str, Any]:
        return {placeholder: values[name] for placeholder, name in self.pairs}


def sent(sql: str) -> Sent:
    """``sql`` with whitespace collapsed and its parameters renamed p0, p1, ... psycopg caches its parse
    of a query only up to 4 KB; a longer one is parsed again on every call (0.6 ms of CPU a reservation)."""
    names = tuple(dict.fromkeys(re.findall(r"%\((\w+)\)s", sql)))
    for number, name in enumerate(names):
        sql = sql.replace(f"%({name})s", f"%(p{number})s")
    # No literal in these statements holds a space, comma, parenthesis or equals sign.
    text = re.sub(r"\s*([(),=])\s*", r"\1", re.sub(r"\s+", " ", sql)).strip()
    if len(text.encode()) > 4096:  # pragma: no cover - caught by the tests of each statement
        raise RuntimeError(f"a statement of {len(text)} characters is parsed again on every call")
    return Sent(text, names, tuple((f"p{number}", name) for number, name in enumerate(names)))


# A one-statement write four ways, by (fenced, speaking for a queued request): fenced or lease-only (the
# token written but not checked, for measuring what the fence prevents), with the request's outcome and
# attempt or without them.
Variants: TypeAlias = dict[tuple[bool, bool], Sent]


def variants(render: Callable[[bool, bool], str]) -> Variants:
    """The four variants of the statement ``render(fenced, speaking)`` writes."""
    return {
        (fenced, speaking): sent(render(fenced, speaking))
        for fenced in (True, False)
        for speaking in (True, False)
    }
