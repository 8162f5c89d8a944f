"""Exit codes, and the one mapping from an error to one line on stderr and its documented exit code
instead of a traceback: not found, bad input, a backend unreachable or without its schema, a check failed.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer
from rich.markup import escape

from admin.cli.context import config, lease_url_shown
from admin.cli.render import err
from fencing import BackendUnavailable, FencingError, InvalidLeaseRequest, SchemaMissing
from fencing.sql import schema_missing
from fencing.urls import mask_url
from reservations.errors import (
    InvalidRequest,
    ReservationError,
    UnknownRequest,
    UnknownReservation,
    UnknownSku,
)
from tasks.settings import json_logs

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNREACHABLE = 0, 1, 2, 3, 4


def complain(level: int, message: str) -> None:
    """A warning or an error on stderr: ``warning:`` or ``error:`` and the message, or with
    ``RESERVATIONS_LOG_FORMAT=json`` one JSON object, as every line a worker writes."""
    if json_logs():
        from tasks.logs import say  # only then: importing tasks loads Celery

        say(message, level=level, logger="reservations.cli", stream=sys.stderr)
        return
    word, colour = ("error", "red") if level >= logging.ERROR else ("warning", "yellow")
    # The message is text, not markup: a URL form such as "[/db]" must print as written.
    err.print(f"[bold {colour}]{word}:[/] {escape(message)}", highlight=False)


def fail(code: int, message: str) -> NoReturn:
    complain(logging.ERROR, message)
    raise typer.Exit(code)


@contextmanager
def errors() -> Iterator[None]:
    """One clear line and a documented exit code instead of a traceback."""
    import redis

    from reservations.schema import RevisionNotFound

    try:
        yield
    except (UnknownSku, UnknownReservation, UnknownRequest) as exc:
        fail(EXIT_NOT_FOUND, str(exc))
    except (InvalidRequest, InvalidLeaseRequest, RevisionNotFound) as exc:
        fail(EXIT_USAGE, str(exc))
    except SchemaMissing as exc:
        _fail_schema(exc)
    except BackendUnavailable as exc:
        fail(EXIT_UNREACHABLE, f"{exc} ({mask_url(config.database_url)}, leases {lease_url_shown()})")
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        fail(EXIT_UNREACHABLE, f"Redis unreachable at {lease_url_shown()}: {exc}")
    except (ReservationError, FencingError) as exc:
        fail(EXIT_FAILED, str(exc))
    except Exception as exc:
        # A database error raised outside the executors (which map them to the errors above).
        from sqlalchemy.exc import DBAPIError

        if not isinstance(exc, DBAPIError):
            raise
        missing = schema_missing(exc, "statement")
        if missing is not None:
            _fail_schema(missing)
        first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
        fail(EXIT_UNREACHABLE, f"database error at {mask_url(config.database_url)}: {first}")


def _fail_schema(exc: SchemaMissing) -> NoReturn:
    """One line naming the upgrade, and the database it is for."""
    # The lease tables may live in a database of their own (RESERVATIONS_LEASE_URL): name the one to upgrade.
    if config.lease_url and "fencing_lease" in exc.reason:
        where = f" on the lease database {mask_url(config.lease_url)}"
    else:
        where = f" on {mask_url(config.database_url)}"
    fail(EXIT_UNREACHABLE, f"schema {exc.problem}: run `reservations db upgrade`{where} ({exc.reason})")
