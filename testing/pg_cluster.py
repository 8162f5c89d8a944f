"""A private PostgreSQL primary and its streaming standby (Debian's binaries) on loopback ports, in a
folder of their own, for the failover drill: the primary can be killed as a host that dies (SIGKILL to its
whole process group: nothing flushed, no client told), the standby stopped, started again and promoted. The
standby is synchronous (the primary's ``synchronous_standby_names`` names it: a commit returns once the
standby has flushed it) or asynchronous (not named: a commit returns at once, the standby follows when it
can).

The servers run as the ``postgres`` OS user, as initdb refuses root; their folder is made outside pytest's
own (those are their owner's alone) and removed with everything in it when the cluster stops.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from testing.harness import (
    STOP_TIMEOUT,
    HarnessError,
    end_process,
    free_port,
    spawn,
    wait_answering,
    wait_until,
)

PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
OS_USER = "postgres"
START_TIMEOUT = 30.0
STANDBY_NAME = "standby"

# Both servers: TCP on loopback only (no socket in /var/run/postgresql, which the system's server owns), and
# a checkpoint rarely: the drill's writes are seconds long. The primary's replication settings follow.
SERVER_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "''",
    "max_connections": "40",
    "shared_buffers": "'32MB'",
    "max_wal_size": "'256MB'",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] %b '",
}


def pg_unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    missing = [name for name in ("initdb", "postgres", "pg_basebackup") if not (PG_BIN / name).is_file()]
    if missing:
        return f"{', '.join(missing)} not in {PG_BIN} (Debian: postgresql-15; or set PG_BIN)"
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        return f"no {OS_USER!r} OS user to run the servers as"
    if os.geteuid() != 0:
        return f"the servers run as the {OS_USER!r} user, which only root can switch to"
    return None


def _as_owner(env: Mapping[str, str] | None) -> dict[str, Any]:
    """How a process runs as the servers' OS user (initdb and postgres refuse root), with ``env`` added."""
    owner = pwd.getpwnam(OS_USER)
    return {
        "user": owner.pw_uid,
        "group": owner.pw_gid,
        "extra_groups": [],
        "env": {**os.environ, **(env or {})},
    }


def as_server_user(
    argv: Sequence[str | Path], *, env: Mapping[str, str] | None = None, timeout: float = START_TIMEOUT
) -> str:
    """Run one of the binaries as the servers' OS user to its end; its output, or :class:`HarnessError`
    with it."""
    done = subprocess.run(
        [str(a) for a in argv],
        **_as_owner(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise HarnessError(f"{' '.join(map(str, argv))} exited {done.returncode}: {done.stderr.strip()}")
    return str(done.stdout)


@dataclass
class PgServer:
    """One server of the cluster: its data directory ``folder/name``, its port, its process group."""

    name: str
    folder: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.folder / self.name

    @property
    def log_path(self) -> Path:
        return self.folder / f"{self.name}.log"

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of ``database`` on this server (trust auth, the bootstrap superuser)."""
        return f"postgresql+psycopg://{OS_USER}@127.0.0.1:{self.port}/{database}"

    def conninfo(self, **extra: str) -> str:
        params = {"host": "127.0.0.1", "port": str(self.port), "user": OS_USER, **extra}
        return " ".join(f"{key}={value}" for key, value in params.items())

    def configure(self, settings: Mapping[str, str]) -> None:
        """Add ``settings`` to postgresql.auto.conf (read at the next start; the last line of a name wins)."""
        lines = "".join(f"{name} = {value}\n" for name, value in settings.items())
        with (self.data / "postgresql.auto.conf").open("a") as conf:
            conf.write(lines)

    def start(
        self, command: Sequence[str | Path] | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        """Start the server (``command``: what starts it, by default the postgres binary on its data
        directory and port) in a session of its own, and wait until it takes connections."""
        argv = command or [PG_BIN / "postgres", "-D", self.data, "-p", str(self.port)]
        self.process = spawn(argv, self.log_path, **_as_owner(env))

        def answers() -> bool:
            try:
                psycopg.connect(self.conninfo(dbname="postgres"), connect_timeout=2).close()
            except psycopg.OperationalError:
                return False
            return True

        name = f"PostgreSQL {self.name} on port {self.port}"
        wait_answering(self.process, answers, name=name, log=self.log_path, timeout=START_TIMEOUT)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """One statement in autocommit as the superuser; its rows."""
        with psycopg.connect(self.conninfo(dbname="postgres"), autocommit=True, connect_timeout=5) as conn:
            cursor = conn.execute(sql.encode(), params)
            return cursor.fetchall() if cursor.description else []

    def kill(self) -> None:
        """SIGKILL to the postmaster and every backend at once, as when its host dies: nothing is flushed,
        no client is told, the data directory stays as the crash left it."""
        process, self.process = self.process, None
        if process is not None:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def stop(self) -> None:
        """A fast shutdown (SIGINT: sessions ended, a checkpoint written), then SIGKILL at the deadline."""
        process, self.process = self.process, None
        if process is not None:
            with suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)
            end_process(process, time.monotonic() + STOP_TIMEOUT, group=True)


class PgCluster:
    """A primary and one standby streaming from it under the application name :data:`STANDBY_NAME`,
    synchronous (``synchronous_commit = on`` waits for its flush) or not, under ``folder``."""

    def __init__(
        self, folder: Path, *, synchronous: bool = True, primary_settings: Mapping[str, str] | None = None
    ) -> None:
        self.folder = folder
        self.synchronous = synchronous
        self.primary_settings = dict(primary_settings or {})
        self.primary = PgServer("primary", folder)
        self.standby = PgServer("standby", folder)

    def start(self, *, standby: bool = True) -> None:
        """initdb and start the primary, then (``standby``) make the standby from its base backup and wait
        until it streams (and, when synchronous, until the primary counts it as its synchronous standby).
        Without, the standby is the caller's to make, as a deployment's own script makes it."""
        as_server_user(
            [PG_BIN / "initdb", "-D", self.primary.data, "-U", OS_USER, "--auth=trust", "-E", "UTF8",
             "--no-instructions", "--no-sync"]
        )  # fmt: skip
        self.primary.configure(
            {
                **SERVER_SETTINGS,
                "wal_level": "replica",
                "synchronous_commit": "on",
                "synchronous_standby_names": f"'{STANDBY_NAME}'" if self.synchronous else "''",
                **self.primary_settings,
            }
        )
        self.primary.start()
        if not standby:
            return
        self.base_backup()
        self.standby.start()
        self.wait_streaming()

    def base_backup(self) -> None:
        """The standby's data directory: a base backup of the running primary with the WAL it needs, and
        the settings that make it follow the primary (standby.signal, primary_conninfo)."""
        as_server_user(
            [PG_BIN / "pg_basebackup", "-d", self.primary.conninfo(), "-D", self.standby.data,
             "-X", "stream", "-R", "--checkpoint=fast", "--no-sync"]
        )  # fmt: skip
        # -R writes the connection it used; the name is what the primary's synchronous_standby_names matches.
        conninfo = self.primary.conninfo(application_name=STANDBY_NAME)
        # The backup carries the primary's synchronous_standby_names: once promoted, the standby would wait
        # on every commit for a standby of its own that does not exist.
        self.standby.configure(
            {**SERVER_SETTINGS, "primary_conninfo": f"'{conninfo}'", "synchronous_standby_names": "''"}
        )

    def replication(self) -> list[tuple[str, str, str]]:
        """(application name, state, sync state) of each standby the primary sends to."""
        rows = self.primary.query("SELECT application_name, state, sync_state FROM pg_stat_replication")
        return [(str(a), str(b), str(c)) for a, b, c in rows]

    def wait_streaming(self) -> None:
        wanted = (STANDBY_NAME, "streaming", "sync" if self.synchronous else "async")
        wait_until(
            lambda: wanted in self.replication(),
            timeout=START_TIMEOUT,
            what=f"the standby streaming {wanted}",
        )

    def fail_over(self) -> None:
        """The primary's host dies (SIGKILL), then the standby is started if it was down (on what it had
        received: the primary is gone) and promoted."""
        self.primary.kill()
        if self.standby.process is None:
            self.standby.start()
        self.promote()

    def promote(self) -> None:
        """Make the standby a primary, and wait until it takes writes."""
        (promoted,) = self.standby.query("SELECT pg_promote(true, 30)")[0]
        if not promoted:
            raise HarnessError(f"the standby was not promoted within 30 s: see {self.standby.log_path}")

    def stop(self) -> None:
        for server in (self.standby, self.primary):
            server.stop()


def server_folder(prefix: str) -> Path:
    """A new folder the servers' OS user owns, beside (not inside) pytest's own."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    owner = pwd.getpwnam(OS_USER)
    os.chown(folder, owner.pw_uid, owner.pw_gid)
    return folder


@contextmanager
def pg_cluster(
    *, synchronous: bool = True, standby: bool = True, primary_settings: Mapping[str, str] | None = None
) -> Iterator[PgCluster]:
    """A started primary and (``standby``) its standby; both stopped and their folder removed on exit,
    whatever happened. ``primary_settings`` go into the primary's configuration after the cluster's own."""
    folder = server_folder("pg-cluster-")
    cluster = PgCluster(folder, synchronous=synchronous, primary_settings=primary_settings)
    try:
        cluster.start(standby=standby)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
