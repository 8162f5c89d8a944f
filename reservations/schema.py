"""Schema management: run the Alembic migrations shipped inside the package, without an alembic.ini.

``upgrade(url)`` brings a database to the newest revision (idempotent); ``current(url)`` reports the
revision a database is at. The SQL lease backend's tables are part of the same migrations.
"""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from fencing.sql import make_engine


def _config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", "reservations:migrations")
    # ConfigParser interpolation would choke on a '%' in a URL-encoded password.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(_config(url), revision)


def current(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str | None:
    return ScriptDirectory.from_config(_config("sqlite://")).get_current_head()
