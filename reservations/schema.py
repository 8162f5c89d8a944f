"""Schema management: run the Alembic migrations shipped inside the package, without an alembic.ini.

``upgrade(url)`` brings a database to the newest revision (idempotent); ``current(url)`` reports the
revision a database is at; ``fit(url)`` says whether this code may run on it (a worker asks before it
takes tasks). The SQL lease backend's tables are part of the same migrations.

Rolling upgrades: migrate first, then roll the workers. A worker refuses a database behind its code; it
accepts one ahead of it only when the migrations since its own newest revision declared themselves
compatible with it (``oldest_compatible_code`` in a migration module, recorded in the database's
``schema_compatibility`` row by every migration run), so old workers keep serving while new ones roll out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa

from fencing.engines import Pooling, make_engine
from reservations.models import schema_compatibility

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic is imported when the schema is touched, not with the package: every command line call and
# worker would otherwise pay for it at start (a tenth of the CLI's start-up).

# The engines here (and the migrations', reservations/migrations/env.py) live for a handful of statements:
# they never prepare one and hold nothing in their session, so they work through a transaction pooler
# (PgBouncer) whatever RESERVATIONS_DATABASE_POOLING says, and directly at no cost.
ONE_SHOT: Pooling = "transaction"


class RevisionNotFound(ValueError):
    """A revision (the one asked for, or the one the database is at) that the migrations shipped with
    this package do not know."""

    def __init__(self, revision: str, detail: str) -> None:
        self.revision = revision
        super().__init__(f"cannot migrate to {revision!r}: {detail} (this package's newest is {head()})")


def _config(url: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", "reservations:migrations")
    # ConfigParser interpolation would choke on a '%' in a URL-encoded password.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command
    from alembic.util import CommandError

    try:
        command.upgrade(_config(url), revision)
    except CommandError as exc:
        # Alembic raises this when it cannot resolve a revision, before any migration runs.
        raise RevisionNotFound(revision, str(exc)) from exc


def current(url: str) -> str | None:
    """The revision the database at ``url`` is at (None: no schema)."""
    return fit(url).found


def head() -> str:
    return revisions()[-1]


def revisions() -> list[str]:
    """This package's revisions, oldest first; the last is its head."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(_config("sqlite://"))
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


@dataclass(frozen=True)
class Fit:
    """Whether code of these revisions may run on a database: ``ok``, and the line that says why."""

    ok: bool
    found: str | None  # the database's revision (None: no schema)
    needed: str  # this code's newest revision
    message: str


def judge(found: str | None, oldest_code: str | None, known: Sequence[str]) -> Fit:
    """The decision, free of I/O: ``found`` is the database's revision, ``oldest_code`` the oldest code
    revision its migrations declared compatible (None where the database does not say), ``known`` this
    code's revisions, oldest first."""
    head = known[-1]
    upgrade = "run `reservations db upgrade`"
    at = f"the database schema is at revision {found}"
    if found is None:
        ok, message = False, f"the database has no schema; it needs revision {head}: {upgrade}"
    elif found == head:
        ok, message = True, at
    elif found in known:
        ok, message = False, f"{at}, behind {head}: {upgrade}"
    elif oldest_code is not None and oldest_code in known:
        ok, compatible = True, f"declared compatible with code from revision {oldest_code}"
        message = f"{at}, newer than this code's {head} and {compatible}"
    else:
        ok, unknown = False, f"which this code (revision {head}) does not know and which is not declared"
        message = f"{at}, {unknown} compatible with it: run code of that revision"
    return Fit(ok, found, head, message)


def fit(url: str) -> Fit:
    """Whether this code may run on the database at ``url`` (one connection; errors as SQLAlchemy's)."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url, pooling=ONE_SHOT)
    try:
        with engine.connect() as conn:
            found = MigrationContext.configure(conn).get_current_revision()
            oldest = None
            if found is not None and sa.inspect(conn).has_table(schema_compatibility.name):
                oldest = conn.execute(
                    sa.select(schema_compatibility.c.oldest_code).where(
                        schema_compatibility.c.revision == found
                    )
                ).scalar()
    finally:
        engine.dispose()
    return judge(found, oldest, revisions())
