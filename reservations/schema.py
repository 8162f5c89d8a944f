"""Schema management: run the Alembic migrations shipped inside the package, without an alembic.ini.

``upgrade(url)`` brings a database to the newest revision (idempotent); ``current(url)`` reports the
revision a database is at. The SQL lease backend's tables are part of the same migrations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fencing.sql import make_engine

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic is imported when the schema is touched, not with the package: every command line call and
# worker would otherwise pay for it at start (a tenth of the CLI's start-up).


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
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config("sqlite://")).get_current_head()
