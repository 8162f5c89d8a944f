"""What a worker makes sure of before it takes tasks, in its main process before the pool forks (bad
settings were refused when the ``celery`` command imported ``tasks``):

- the database and the lease backend answer: a backend restarting while the workers roll is waited for,
  saying so every few seconds, not crash-looped on. Misconfigured is refused; unreachable is waited for.
- the schema is one this code may run on (:func:`reservations.schema.fit`); behind it, the worker exits 2
  naming the revision it needs, so migrations go first and workers roll after them.
- behind a transaction pooler, the database or role bounds idle transactions and lock waits by the lease
  ttl (the worker cannot set them per connection there): otherwise a holder frozen in its transaction
  keeps its SKU's row locked as long as it is frozen. Exit 2, naming what is missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import click
import redis
import sqlalchemy as sa

from fencing import BackendUnavailable, LeaseManager, SchemaMissing
from fencing.engines import TransactionBounds, make_engine, transaction_bounds
from fencing.urls import mask_url
from reservations import schema
from tasks import failpoints
from tasks.connections import client_options
from tasks.logs import celery_says_json, say, warnings_as_json
from tasks.settings import Settings, json_logs
from tasks.variables import SettingsError

T = TypeVar("T")

SAY_EVERY = 10.0
# The scope the lease backend is asked about: a read, which takes no lease and writes nothing.
_PROBE_SCOPE = "readiness:probe"
# What "does not answer" looks like from each client; anything else is a bug or misconfiguration.
_UNANSWERED = (BackendUnavailable, sa.exc.OperationalError, sa.exc.InterfaceError, redis.RedisError, OSError)


def refuse(problem: str) -> NoReturn:
    """One line naming the problem, then exit 2: the code the command line gives a bad setting."""
    say(f"reservations: {problem}", level=logging.ERROR, event="worker_refused")
    raise SystemExit(2)


def wait_for(
    what: str,
    where: str,
    probe: Callable[[], T],
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``probe()``'s answer, once the backend answers (a missing schema is an answer); until then a line
    every :data:`SAY_EVERY` seconds."""
    said: float | None = None
    delay = 0.25
    while True:
        try:
            return probe()
        except SchemaMissing:
            raise
        except _UNANSWERED as exc:
            now = clock()
            if said is None or now - said >= SAY_EVERY:
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                say(
                    f"reservations worker waiting for its {what} at {where}: {reason}",
                    level=logging.WARNING,
                    event="waiting_for_backend",
                    backend=what,
                )
                said = now
        sleep(delay)
        delay = min(5.0, delay * 2)


def _bounds(url: str) -> TransactionBounds:
    engine = make_engine(url, pooling="transaction")
    try:
        return transaction_bounds(engine)
    finally:
        engine.dispose()


def wait_until_usable(settings: Settings, *, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once the backends answer and the schema fits this code; exit 2 when it does not."""
    where = mask_url(settings.database_url)
    fit = wait_for("database", where, lambda: schema.fit(settings.database_url), sleep=sleep)
    if not fit.ok:
        refuse(fit.message)
    if fit.found != fit.needed:
        say(f"reservations worker: {fit.message}", level=logging.WARNING, event="schema_ahead")
    if settings.database_pooling == "transaction":
        bounds = wait_for("database", where, lambda: _bounds(settings.database_url), sleep=sleep)
        beyond = bounds.beyond(settings.lease_ttl)
        if beyond:
            refuse(
                f"the database at {where} is behind a transaction pooler (RESERVATIONS_DATABASE_POOLING="
                f"transaction) and bounds transactions by more than the lease ttl ({settings.lease_ttl:g}s): "
                f"{', '.join(beyond)}; set both to at most the ttl on the database or role (ALTER ROLE ... "
                "SET ...); the pooler's open server sessions keep the old values until RECONNECT on its "
                "admin console (or server_lifetime): see PgBouncer in docs/operations.md"
            )
    leases = LeaseManager.from_url(
        settings.lease_url,
        prefix=settings.lease_prefix,
        **client_options(settings.lease_url, settings.lease_ttl, settings.database_pooling),
    )
    try:
        wait_for("lease backend", leases.url, lambda: leases.current(_PROBE_SCOPE), sleep=sleep)
    except SchemaMissing as exc:
        upgrade = "run `reservations db upgrade` on it"
        refuse(f"the lease backend at {leases.url} has no schema ({exc.reason}): {upgrade}")
    finally:
        leases.close()


def loaded_by_celery_command() -> bool:
    """Whether the ``celery`` command line is importing the app (``celery -A tasks worker``)."""
    context = click.get_current_context(silent=True)
    return context is not None and context.find_root().command.name == "celery"


def refuse_bad_settings() -> None:
    """A worker or beat with a bad setting says so in one line and exits 2, rather than a traceback from
    wherever Celery first reads its configuration."""
    if json_logs():  # from the first line on, before Celery sets up its logging
        warnings_as_json()
        celery_says_json()
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        refuse(str(exc))
    problem = failpoints.check(settings.failpoints, settings.failpoint_dir)
    if problem:
        refuse(problem)
