"""The rules that live in :mod:`fencing` as SQLAlchemy expressions (the fence predicate, the database
clock), rendered as PostgreSQL text for the statements written by hand as one data-modifying CTE
(:mod:`reservations.reserve_statement`, :mod:`reservations.pending`). Those statements take the rule
from here, so it stays written once: a change to :meth:`fencing.Fence.admits` or to
:class:`fencing.sql.db_now_ms` changes them too.
"""

from __future__ import annotations

from typing import Any

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


def fence_admits(fence: Fence, *, token: str = "token", lease_id: str = "lease_id") -> str:
    """The fence predicate of ``fence``'s table, with the token and lease id as the named parameters."""
    return render(
        fence.admits(sa.bindparam(token, type_=sa.BigInteger), sa.bindparam(lease_id, type_=sa.String))
    )
