"""A small protected resource for fencing tests: rows with fence columns and a log of accepted writes;
the start gate of the contending worker processes the multi-process tests run (both sides); and the
``reservations`` command line, run in this process (``run``) or as the installed script (``cli``). The
worker processes import this module: what only the command line's helpers need is imported in them.

``Resource.write`` is the pattern every user of :class:`fencing.Fence` follows: the guarded UPDATE and
the record of what it did commit in one transaction, so the log shows exactly the accepted writes.
"""

from __future__ import annotations

import base64
import importlib
import json
import logging
import os
import selectors
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import sqlalchemy as sa

from fencing import Fence, FenceResult, Lease, fence_columns
from fencing.engines import make_engine

metadata = sa.MetaData()

items = sa.Table(
    "fenced_items",
    metadata,
    sa.Column("scope", sa.String(200), primary_key=True),
    sa.Column("quantity", sa.Integer, nullable=False),
    *fence_columns(),
)

accepted_writes = sa.Table(
    "fenced_accepted_writes",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("scope", sa.String(200), nullable=False),
    sa.Column("token", sa.BigInteger, nullable=False),
    sa.Column("lease_id", sa.String(32), nullable=False),
    sa.Column("delta", sa.Integer, nullable=False),
)


@dataclass
class Resource:
    url: str
    enforce: bool = True
    engine: sa.Engine = field(init=False)
    fence: Fence = field(init=False)

    def __post_init__(self) -> None:
        self.engine = make_engine(self.url)
        self.fence = Fence(items, enforce=self.enforce)

    def create(self, *scopes: str, quantity: int = 100) -> Resource:
        metadata.create_all(self.engine, checkfirst=True)
        with self.engine.begin() as conn:
            for scope in scopes:
                conn.execute(sa.insert(items).values(scope=scope, quantity=quantity))
        return self

    def write(self, lease: Lease, scope: str, delta: int) -> FenceResult:
        """Add ``delta`` to the row if the result stays non-negative, fenced by ``lease``."""
        with self.engine.begin() as conn:
            result = self.fence.update(
                conn,
                lease,
                scope=scope,
                where=[items.c.scope == scope],
                values={"quantity": items.c.quantity + delta},
                condition=items.c.quantity + delta >= 0,
                returning=[items.c.quantity],
                operation=f"add {delta}",
            )
            if result.applied:
                conn.execute(
                    sa.insert(accepted_writes).values(
                        scope=scope, token=lease.token, lease_id=lease.lease_id, delta=delta
                    )
                )
            return result

    def row(self, scope: str) -> tuple[int, int, str | None]:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(items.c.quantity, items.c.fence_token, items.c.fence_lease_id).where(
                    items.c.scope == scope
                )
            ).one()
            return int(found[0]), int(found[1]), found[2]

    def log(self, scope: str) -> list[tuple[int, str, int]]:
        """Accepted writes in commit order: (token, lease_id, delta)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(accepted_writes.c.token, accepted_writes.c.lease_id, accepted_writes.c.delta)
                .where(accepted_writes.c.scope == scope)
                .order_by(accepted_writes.c.id)
            ).all()
            return [(int(r[0]), r[1], int(r[2])) for r in rows]

    def close(self) -> None:
        self.engine.dispose()


def start_gate() -> bool:
    """A worker process's side of the start gate: print ``ready`` on stdout, then block until the parent
    writes ``go`` on stdin, so that every worker starts contending at once. False when the parent sent
    anything else or closed stdin: it gave up, and the worker should exit."""
    print("ready", flush=True)
    return sys.stdin.readline().strip() == "go"


class Gated:
    """The parent's side of the start gate: worker processes started with their stdin and stdout piped
    (stderr to a file each, so a traceback never fills a pipe nobody reads), released together."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], cwd: Path) -> None:
        n = len(self.processes)
        with (self.logs / f"worker-{n}.stderr").open("wb") as stderr:
            self.processes.append(
                subprocess.Popen(
                    argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, bufsize=0
                )
            )

    def stderr(self, n: int) -> str:
        return (self.logs / f"worker-{n}.stderr").read_text(errors="replace")

    def await_ready(self, timeout: float) -> None:
        """Block until every worker has printed ``ready`` (imports done, connections open)."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for n, process in enumerate(self.processes):
                assert process.stdout is not None
                selector.register(process.stdout, selectors.EVENT_READ, (n, process))
            while selector.get_map():
                events = selector.select(timeout=max(0.0, deadline - time.monotonic()))
                if not events:
                    raise TimeoutError(f"workers not ready within {timeout}s")
                for key, _ in events:
                    n, process = key.data
                    # Unbuffered pipe: readline takes bytes one at a time and never reads past the line.
                    if process.stdout.readline().strip() != b"ready":
                        process.wait(timeout=10)
                        raise AssertionError(f"worker {n} failed to start:\n{self.stderr(n)}")
                    selector.unregister(key.fileobj)

    def go(self, *, last: bool = True) -> None:
        """Release every worker at once; ``last`` closes their stdin (no further phase)."""
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(b"go\n")
            if last:
                process.stdin.close()

    def wait(self, deadline: float) -> None:
        """Every worker exits 0 by ``deadline`` (monotonic)."""
        for n, process in enumerate(self.processes):
            returncode = process.wait(timeout=max(0.0, deadline - time.monotonic()))
            assert returncode == 0, f"worker {n} exited {returncode}:\n{self.stderr(n)}"

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()


# -- the command line ------------------------------------------------------------------------------------

SCRIPT = shutil.which("reservations", path=str(Path(sys.executable).parent)) or "reservations"


class Done(NamedTuple):
    """How a run of the command line ended: its exit code and what it wrote on stdout and on stderr."""

    returncode: int
    stdout: str
    stderr: str


def _shell(env: Mapping[str, str], columns: int) -> dict[str, str | None]:
    """The environment a shell gives the command: none of our variables but ``env``, ``columns`` wide,
    no colours (None: the variable is unset)."""
    from tasks.settings import PREFIX

    ours: dict[str, str | None] = {k: None for k in os.environ if k.startswith(PREFIX)}
    return {**ours, **env, "NO_COLOR": "1", "COLUMNS": str(columns)}


@contextmanager
def _as_its_own_process() -> Iterator[None]:
    """Logging and warnings as a process of its own starts with them: the root logger at WARNING without
    handlers (pytest's set aside), Python's default warning filters, and warnings written on stderr rather
    than recorded by pytest. A library's warning then reaches the stderr of an in-process run as it would
    the script's. Afterwards the root logger is put back (JSON logs add a handler to it)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers[:] = []
    root.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = _warning_on_stderr
            yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _warning_on_stderr(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run(*args: str, env: Mapping[str, str], columns: int = 80, stdin: str | None = None) -> Done:
    """The command line in this process, as the installed script runs it from a shell (``_shell``) in a
    process of its own (``_as_its_own_process``), without the second an interpreter takes to start and
    import it, reading ``stdin`` (nothing by default). An exception the script would print as a
    traceback is raised here."""
    from typer.testing import CliRunner

    with _as_its_own_process():
        result = CliRunner().invoke(_script_app(), list(args), env=_shell(env, columns), input=stdin)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Done(result.exit_code, result.stdout, result.stderr)


def _script_app() -> Any:
    """The Typer app of the installed ``reservations`` script, found through its entry point as the script
    finds it (pyproject's [project.scripts]): the harness sits below the operator's floor and does not
    import it."""
    (entry,) = entry_points(group="console_scripts", name="reservations")
    return importlib.import_module(entry.module).app


def cli(*args: str, env: Mapping[str, str], columns: int = 80) -> Done:
    """The installed ``reservations`` console script in a subprocess, from a shell (``_shell``). For the
    few tests about the script itself; every other test runs the command line in process (``run``)."""
    shell = {k: v for k, v in {**os.environ, **_shell(env, columns)}.items() if v is not None}
    done = subprocess.run([SCRIPT, *args], env=shell, capture_output=True, text=True, timeout=60, check=False)
    return Done(done.returncode, done.stdout, done.stderr)


def refused_worker(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A ``celery worker`` that is expected to refuse to start: its exit code and what it wrote."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--pool", "solo", "--loglevel", "INFO"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def queued_messages(client: Any, queue: str = "celery") -> list[dict[str, Any]]:
    """The task messages in a Redis broker's queue, oldest first: their headers and keyword arguments."""
    messages = []
    for raw in reversed(client.lrange(queue, 0, -1)):
        message = json.loads(raw)
        _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        messages.append({"headers": message["headers"], "kwargs": kwargs})
    return messages
