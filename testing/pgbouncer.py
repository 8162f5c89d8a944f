"""A PgBouncer of a test's own in transaction pooling mode, in front of the test PostgreSQL, and a role of
the test's own to log in through it.

PgBouncer refuses the ``options`` startup parameter the other tests choose their schema with, and pools
server sessions per database and user: so a test reaches its schema as a role of its own, whose
``search_path`` (and any other setting given) the database applies to every server session PgBouncer
opens for it. The pooler runs in a temporary directory on a free port and is stopped, and the directory
removed, on exit. Run as root it drops to the ``postgres`` user (PgBouncer will not run as root).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from fencing.engines import make_engine
from testing.harness import free_port, spawn, wait_until
from testing.stores import POSTGRES_URL

PGBOUNCER = "/usr/sbin/pgbouncer"


def available() -> bool:
    return os.access(PGBOUNCER, os.X_OK)


@dataclass(frozen=True)
class PgBouncer:
    port: int
    folder: Path

    def url(self, user: str) -> str:
        """A URL of the test database through this pooler, as ``user`` (no password: trust)."""
        database = sa.make_url(POSTGRES_URL).database
        return f"postgresql+psycopg://{user}@127.0.0.1:{self.port}/{database}"

    def log(self) -> str:
        return (self.folder / "pgbouncer.log").read_text(errors="replace")


def _answers(port: int) -> bool:
    with suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


@contextmanager
def pgbouncer(
    users: Sequence[str], *, pool_size: int = 4, options: Mapping[str, str] | None = None
) -> Iterator[PgBouncer]:
    """A PgBouncer (pool_mode=transaction, trust, ``users`` allowed) on a free loopback port, forwarding
    to the test PostgreSQL; ``options``: more ``[pgbouncer]`` settings."""
    target = sa.make_url(POSTGRES_URL)
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    port = free_port()
    settings = {
        "listen_addr": "127.0.0.1",
        "listen_port": str(port),
        "unix_socket_dir": "",
        "auth_type": "trust",
        "auth_file": str(folder / "users.txt"),
        "pool_mode": "transaction",
        "default_pool_size": str(pool_size),
        "max_client_conn": "200",
        # Hand each transaction the server session that waited longest rather than the last one used: a
        # client's consecutive transactions then run in different sessions, as under load, so anything
        # kept in a session (a prepared statement, a SET) is missed at once instead of by chance.
        "server_round_robin": "1",
        **(options or {}),
    }
    server = f"host={target.host or '127.0.0.1'} port={target.port or 5432}"
    (folder / "pgbouncer.ini").write_text(
        f"[databases]\n* = {server}\n\n[pgbouncer]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items())
    )
    (folder / "users.txt").write_text("".join(f'"{user}" ""\n' for user in users))
    command = [PGBOUNCER, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        for path in (folder, *folder.iterdir()):
            os.chown(path, owner.pw_uid, owner.pw_gid)
        command[1:1] = ["-u", "postgres"]
    process = spawn(command, folder / "pgbouncer.log")
    running = PgBouncer(port, folder)
    try:

        def listening() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {process.returncode}:\n{running.log()}")
            return _answers(port)

        wait_until(listening, timeout=10, what="pgbouncer to listen")
        yield running
    finally:
        # SIGINT: shut down now, closing every client and server connection (SIGTERM waits for clients).
        with suppress(ProcessLookupError):
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def pooled_role(settings: Mapping[str, str] | None = None) -> Iterator[str]:
    """A login role of its own with an empty schema of the same name as its ``search_path``, and
    ``settings`` (``ALTER ROLE ... SET``) for every session it opens; both dropped on exit."""
    role = f"pgb_{uuid.uuid4().hex[:12]}"
    admin = make_engine(POSTGRES_URL)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE ROLE "{role}" LOGIN'))
            conn.execute(sa.text(f'CREATE SCHEMA "{role}" AUTHORIZATION "{role}"'))
            for name, value in {"search_path": f'"{role}"', **(settings or {})}.items():
                conn.execute(sa.text(f'ALTER ROLE "{role}" SET {name} = {value}'))
        yield role
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{role}" CASCADE'))
            conn.execute(sa.text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()
