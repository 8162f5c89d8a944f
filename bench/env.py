"""Where the benchmarks run: service URLs, the scratch space they write to, and the machine context.

Everything a run creates (a Redis key prefix, a PostgreSQL schema, a SQLite file in a temp dir) is
unique to the run and removed on exit, also when a benchmark fails or the run is interrupted.
"""

from __future__ import annotations

import os
import platform
import shutil
import sqlite3
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.schema import CreateSchema, DropSchema

from fencing import LeaseManager
from fencing.engines import make_engine
from fencing.urls import mask_url

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@dataclass(frozen=True)
class Settings:
    redis_url: str
    postgres_url: str

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            redis_url=os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS_URL),
            postgres_url=os.environ.get("BENCH_POSTGRES_URL", DEFAULT_POSTGRES_URL),
        )


def _short_error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:160]


@dataclass(frozen=True)
class Context:
    """What the numbers depend on; ``None`` versions mean the service could not be reached."""

    python: str
    platform: str
    cpus: int
    cpus_usable: int
    redis_version: str | None
    redis_error: str | None
    postgres_version: str | None
    postgres_error: str | None
    sqlite_version: str
    packages: dict[str, str]
    redis_url: str
    postgres_url: str
    code: str


def code_revision(root: Path = ROOT) -> str:
    """The commit measured and the files changed since, as ``git`` sees them; 'unknown' without git."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True)
        return done.stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git checkout)"
    if not changed:
        return f"commit {commit}, no uncommitted changes"
    shown = ", ".join(changed[:10]) + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
    return f"commit {commit} with uncommitted changes to {shown}"


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def probe(settings: Settings) -> Context:
    """Collect the context, reaching each service once; a failure is recorded, not raised."""
    redis_version = redis_error = postgres_version = postgres_error = None
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=3)
        try:
            redis_version = str(client.info("server")["redis_version"])
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        redis_error = _short_error(exc)
    try:
        engine = make_engine(settings.postgres_url, connect_args={"connect_timeout": 3})
        try:
            with engine.connect() as conn:
                postgres_version = str(conn.execute(sa.text("SHOW server_version")).scalar_one())
        finally:
            engine.dispose()
    except Exception as exc:  # any driver or URL problem only disables the PostgreSQL rows
        postgres_error = _short_error(exc)
    return Context(
        python=f"{platform.python_implementation()} {platform.python_version()}",
        platform=platform.platform(terse=True),
        cpus=os.cpu_count() or 0,
        cpus_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,
        redis_version=redis_version,
        redis_error=redis_error,
        postgres_version=postgres_version,
        postgres_error=postgres_error,
        sqlite_version=sqlite3.sqlite_version,
        packages={
            name: _package_version(name) for name in ("redis", "SQLAlchemy", "psycopg", "celery", "kombu")
        },
        redis_url=mask_url(settings.redis_url),
        postgres_url=mask_url(settings.postgres_url),
        code=code_revision(),
    )


class Scratch:
    """The run's private space in each service, created on first use and removed by :meth:`close`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        run = uuid.uuid4().hex[:10]
        self.redis_prefix = f"bench-{run}"
        self.pg_schema = f"bench_{run}"
        self._redis_used = False
        self._pg_schemas: list[str] = []
        self._tmpdir: Path | None = None

    def redis_client(self) -> redis.Redis:
        # decode_responses=True is what LeaseManager.from_url uses, so the raw baseline pays the same
        # reply decoding as the library.
        self._redis_used = True
        return redis.Redis.from_url(self.settings.redis_url, decode_responses=True)

    def redis_manager(self) -> LeaseManager:
        """A Redis lease manager whose keys live under the run's prefix."""
        self._redis_used = True
        return LeaseManager.from_url(self.settings.redis_url, prefix=self.redis_prefix)

    def postgres_url(self, part: str = "") -> str:
        """The PostgreSQL URL with the run's schema (or its sibling ``<schema>_<part>``) first on the
        search path.

        The SQL lease backend's tables have fixed names; a private schema keeps them (and the
        benchmark tables) away from anything already in the database. A section whose tables are
        created by migrations asks for its own ``part``, since those would collide with the tables
        another section created by hand.
        """
        name = f"{self.pg_schema}_{part}" if part else self.pg_schema
        if name not in self._pg_schemas:
            engine = make_engine(self.settings.postgres_url)
            try:
                with engine.begin() as conn:
                    conn.execute(CreateSchema(name))
            finally:
                engine.dispose()
            self._pg_schemas.append(name)
        url = make_url(self.settings.postgres_url)
        given = url.query.get("options", ())
        parts = [given] if isinstance(given, str) else list(given)
        options = " ".join([*parts, f"-csearch_path={name}"])
        return url.update_query_dict({"options": options}).render_as_string(hide_password=False)

    def sqlite_url(self) -> str:
        if self._tmpdir is None:
            self._tmpdir = Path(tempfile.mkdtemp(prefix="fencing-bench-"))
        return f"sqlite:///{self._tmpdir / 'bench.sqlite3'}"

    def close(self) -> list[str]:
        """Remove everything; return a line per thing that could not be removed."""
        problems: list[str] = []
        if self._redis_used:
            try:
                client = self.redis_client()
                try:
                    keys = list(client.scan_iter(match=f"{self.redis_prefix}:*", count=1000))
                    for start in range(0, len(keys), 1000):
                        client.unlink(*keys[start : start + 1000])
                finally:
                    client.close()
            except (redis.RedisError, OSError) as exc:
                problems.append(f"redis keys {self.redis_prefix}:* not removed: {_short_error(exc)}")
        for name in self._pg_schemas:
            try:
                engine = make_engine(self.settings.postgres_url)
                try:
                    with engine.begin() as conn:
                        conn.execute(DropSchema(name, cascade=True))
                finally:
                    engine.dispose()
            except Exception as exc:
                problems.append(f"schema {name} not dropped: {_short_error(exc)}")
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        return problems
