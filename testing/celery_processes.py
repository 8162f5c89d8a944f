"""``celery worker`` and ``celery beat`` processes, each in its own session, started, frozen, killed and
stopped as the demo, the chaos run, the benchmarks and the tests need, and the environment they run in."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from tasks.settings import PREFIX, Settings
from testing.harness import (
    START_TIMEOUT,
    STOP_TIMEOUT,
    HarnessError,
    HarnessTimeout,
    children,
    end_process,
    process_state,
    wait_until,
)

if TYPE_CHECKING:
    from testing.netns import Host


@dataclass
class CeleryProcess:
    """One ``celery worker`` (or ``celery beat`` with ``kind="beat"``) in its own session, logging to
    ``log_path``; readiness is read from the log, after where it stood when the process was started.
    ``cwd`` matters only for an ``app`` that is not installed (``python -m celery`` imports it from there).
    With a ``host`` (:mod:`testing.netns`) it runs on that host: same process, its own network namespace."""

    name: str
    env: Mapping[str, str]
    log_path: Path
    kind: str = "worker"
    app: str = "tasks"
    pool: str = "prefork"
    concurrency: int = 1
    cwd: Path | None = None
    host: Host | None = None
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)
    _log_from: int = field(default=0, repr=False)

    def command(self) -> list[str]:
        return self.host.wrap(self._command()) if self.host is not None else self._command()

    def _command(self) -> list[str]:
        celery = [sys.executable, "-m", "celery", "-A", self.app]
        if self.kind == "beat":
            schedule = self.log_path.with_name(f"{self.name}-schedule")
            return [*celery, "beat", "-s", str(schedule), "--loglevel", "INFO"]
        return [
            *celery,
            *("worker", "--pool", self.pool, "-c", str(self.concurrency), "-n", f"{self.name}@%h"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"),
        ]

    def start(self) -> None:
        """Start (or start again after a kill), appending to the same log."""
        self.close_log()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log_from = self._log.tell()
        self.process = subprocess.Popen(
            self.command(),
            env={**self.env, "PYTHONUNBUFFERED": "1"},  # readiness is read from the log, not a buffer
            cwd=self.cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        if self.process is None:
            raise HarnessError(f"{self.name} was never started")
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        """This start's part of the log."""
        with self.log_path.open("rb") as log:
            log.seek(self._log_from)
            return log.read().decode(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return f"--- last lines of {self.name}'s log ---\n" + "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        if self.kind == "beat":
            ready = re.compile(r"beat: Starting")
        else:
            ready = re.compile(rf"\b{re.escape(self.name)}@\S+ ready\.")

        def is_ready() -> bool:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise HarnessError(f"{self.name} exited with {code}\n{self.tail()}")
            return bool(ready.search(self.log()))

        try:
            wait_until(is_ready, timeout=timeout, what=f"{self.name} to be ready")
        except HarnessTimeout as exc:
            raise HarnessTimeout(f"{exc}\n{self.tail()}") from None

    def pool_children(self) -> list[int]:
        """The pool processes that run the tasks (forked by the worker's main process)."""
        return [] if self.process is None else children(self.process.pid)

    def pool_child(self, timeout: float = START_TIMEOUT) -> int:
        """The one live pool child; waits while the main process replaces a child that died."""

        def one() -> int | None:
            live = [pid for pid in self.pool_children() if process_state(pid) not in (None, "Z")]
            return live[0] if len(live) == 1 else None

        return wait_until(one, timeout=timeout, what=f"{self.name} to have one live pool child")

    def stopped_child(self) -> int | None:
        """A pool child in the stopped state (T), if any."""
        return next((pid for pid in self.pool_children() if process_state(pid) == "T"), None)

    def signal_group(self, sig: signal.Signals) -> None:
        if self.process is not None:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP the whole group: a pause the process cannot notice until it is thawed."""
        self.signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal_group(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the group (the worker and its pool children), as a crash would."""
        self.signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()

    def terminate(self) -> None:
        """Ask for a warm shutdown; a stopped child cannot exit, so thaw first."""
        self.thaw()
        self.signal_group(signal.SIGTERM)

    def stop(self, deadline: float | None = None) -> None:
        """Wait for the process until ``deadline`` (monotonic), then SIGKILL whatever is left."""
        if self.process is not None:
            end_process(
                self.process, time.monotonic() + STOP_TIMEOUT if deadline is None else deadline, group=True
            )
        self.close_log()

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_all(processes: Iterable[CeleryProcess], timeout: float = STOP_TIMEOUT) -> None:
    """Warm shutdown for all at once (each finishes the task it runs, in parallel), SIGKILL at the end."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.stop(deadline)


def start_all(processes: Iterable[CeleryProcess], timeout: float = START_TIMEOUT) -> None:
    """Start all before waiting for any: their imports overlap."""
    processes = list(processes)
    for process in processes:
        process.start()
    for process in processes:
        process.wait_ready(timeout)


def worker_env(
    settings: Settings | Mapping[str, str], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` (our environment by default) without any ``RESERVATIONS_*`` of its own, plus ``settings``:
    a :class:`Settings` (its ``to_env()``) or the variables themselves."""
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if not k.startswith(PREFIX)}
    env.update(settings.to_env() if isinstance(settings, Settings) else settings)
    return env
