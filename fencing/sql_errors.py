"""Database errors as callers catch them: an unreachable database, a schema the migrations have not
made, or the caller's own typed error; anything else stays the driver's."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from fencing.errors import BackendUnavailable, SchemaMissing

# SQLSTATEs that end the session rather than the statement: the server shut down or terminated it, or
# ended a transaction left idle past idle_in_transaction_session_timeout (psycopg raises the last one as
# an InternalError).
_SESSION_ENDED = ("57P01", "57P02", "57P03", "25P03")


def unavailable(exc: DBAPIError, operation: str) -> BackendUnavailable | None:
    """The error to raise for a database that cannot be reached, or None for any other database error."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    ended = isinstance(sqlstate, str) and (sqlstate.startswith("08") or sqlstate in _SESSION_ENDED)
    if isinstance(exc, OperationalError | InterfaceError) or exc.connection_invalidated or ended:
        detail = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        return BackendUnavailable(backend="database", operation=operation, detail=detail)
    return None


# A table or column the migrations create, as PostgreSQL (SQLSTATE) and SQLite (message) report it.
_SCHEMA_STATES = {"42P01": "missing", "42703": "out of date"}
_SCHEMA_MESSAGES = {
    "no such table": "missing",
    "no such column": "out of date",
    "has no column": "out of date",
}


def schema_missing(exc: DBAPIError, operation: str) -> SchemaMissing | None:
    """The error to raise for a table or column the migrations create being absent, else None."""
    if exc.orig is None:
        return None
    first = str(exc.orig).strip().splitlines()[0]
    state = getattr(exc.orig, "sqlstate", None)
    if state is not None:
        problem = _SCHEMA_STATES.get(state)
    else:
        problem = next((v for k, v in _SCHEMA_MESSAGES.items() if k in first), None)
    return None if problem is None else SchemaMissing(operation=operation, problem=problem, detail=first)


# Maps a database error to the caller's own typed error (for example by constraint name), or None.
Translate = Callable[[DBAPIError], Exception | None]


def mapped(exc: DBAPIError, operation: str, translate: Translate | None = None) -> Exception:
    """The one place a database error becomes what callers catch: the caller's translation first, then a
    missing schema, then an unreachable database; anything else stays the driver's error."""
    found = translate(exc) if translate is not None else None
    return found or schema_missing(exc, operation) or unavailable(exc, operation) or exc
