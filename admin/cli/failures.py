"""Exit codes, and the one mapping from an error to one line on stderr and its documented exit code
instead of a traceback: not found, bad input, a backend unreachable or without its schema, a check failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer

from admin.cli.context import config, lease_url_shown
from admin.cli.render import err
from fencing import BackendUnavailable, FencingError, InvalidLeaseRequest, mask_url
from reservations.errors import InvalidRequest, ReservationError, UnknownReservation, UnknownSku

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNREACHABLE = 0, 1, 2, 3, 4

# A table or column the migrations create, as PostgreSQL (SQLSTATE) and SQLite (message) report it.
_SCHEMA_STATES = {"42P01": "missing", "42703": "out of date"}
_SCHEMA_MESSAGES = {
    "no such table": "missing",
    "no such column": "out of date",
    "has no column": "out of date",
}


def fail(code: int, message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@contextmanager
def errors() -> Iterator[None]:
    """One clear line and a documented exit code instead of a traceback."""
    import redis

    from reservations.schema import RevisionNotFound

    try:
        yield
    except (UnknownSku, UnknownReservation) as exc:
        fail(EXIT_NOT_FOUND, str(exc))
    except (InvalidRequest, InvalidLeaseRequest, RevisionNotFound) as exc:
        fail(EXIT_USAGE, str(exc))
    except BackendUnavailable as exc:
        # The SQL lease backend reports every OperationalError as unreachable, and SQLite's "no such
        # table" is one: a database that answers but was never migrated needs an upgrade, not a network.
        _fail_if_schema_missing(exc)
        fail(EXIT_UNREACHABLE, f"{exc} ({mask_url(config.database_url)}, leases {lease_url_shown()})")
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        fail(EXIT_UNREACHABLE, f"Redis unreachable at {lease_url_shown()}: {exc}")
    except (ReservationError, FencingError) as exc:
        fail(EXIT_FAILED, str(exc))
    except Exception as exc:
        found = _database_error(exc, chained=False)
        if found is None:
            raise
        _fail_if_schema_missing(exc)
        fail(EXIT_UNREACHABLE, f"database error at {mask_url(config.database_url)}: {found[0]}")


def _database_error(exc: BaseException, *, chained: bool) -> tuple[str, str | None] | None:
    """The first line and SQLSTATE (PostgreSQL's; None from SQLite) of the driver error that ``exc`` is,
    or with ``chained`` that it was raised from; None when it is no database error.

    The one place that knows SQLAlchemy's raw DBAPIError."""
    from sqlalchemy.exc import DBAPIError

    seen: BaseException | None = exc
    while chained and seen is not None and not isinstance(seen, DBAPIError):
        seen = seen.__cause__ or seen.__context__
    if not isinstance(seen, DBAPIError):
        return None
    if seen.orig is None:
        return type(seen).__name__, None
    return str(seen.orig).strip().splitlines()[0], getattr(seen.orig, "sqlstate", None)


def _fail_if_schema_missing(exc: BaseException) -> None:
    """Exit with one line naming the upgrade when the database error in ``exc``'s chain is a table or
    column the migrations create; return for any other error."""
    found = _database_error(exc, chained=True)
    if found is None:
        return
    first, state = found
    if state is not None:
        problem = _SCHEMA_STATES.get(state)
    else:
        problem = next((v for k, v in _SCHEMA_MESSAGES.items() if k in first), None)
    if problem is None:
        return
    # The lease tables may live in a database of their own (RESERVATIONS_LEASE_URL): name the one to upgrade.
    if config.lease_url and "fencing_lease" in first:
        where = f" on the lease database {mask_url(config.lease_url)}"
    else:
        where = f" on {mask_url(config.database_url)}"
    fail(EXIT_UNREACHABLE, f"schema {problem}: run `reservations db upgrade`{where} ({first})")
