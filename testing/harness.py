"""The process harness: the polling every wait goes through, free ports, and what /proc says of a process.

The demo, the fault-injection run, the benchmarks and the tests all start their processes through the
harness (private redis-servers: :mod:`testing.redis_servers`, Sentinel and Cluster topologies:
:mod:`testing.redis_topologies`, ``celery worker`` and ``celery beat``: :mod:`testing.celery_processes`), so a
fix (ports, signals, readiness) is made once.

Every process runs in its own session: a Ctrl-C in the terminal reaches only us, and a signal to the
group reaches a worker's pool children too.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

POLL = 0.02
START_TIMEOUT = 60.0  # a worker imports celery, sqlalchemy and the app: seconds on a busy 2-CPU box
STOP_TIMEOUT = 10.0


@functools.cache
def tls() -> ssl.SSLContext:
    """The TLS context every HTTP client of this process is given (``httpx.Client(verify=tls())``): without
    one, httpx builds a context per client and loads the CA bundle into it, about 30 ms of CPU, and a wait
    that polls with a client of its own each time spent most of a core on that. The harness's clients speak
    plain HTTP to loopback; the context is there for the odd https URL."""
    return ssl.create_default_context()


class HarnessError(RuntimeError):
    """A process of the harness did not start, or exited while it was being waited for."""


class HarnessTimeout(HarnessError, TimeoutError):
    """A wait of the harness passed its deadline."""


def wait_until(check: Callable[[], T | None], *, timeout: float, what: str, interval: float = POLL) -> T:
    """Poll ``check`` until it returns something truthy; :class:`HarnessTimeout` naming ``what`` at the
    deadline. ``check`` may raise to give up early (a process it waits for has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise HarnessTimeout(f"gave up after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def spawn(argv: Sequence[str | Path], log: Path, **options: Any) -> subprocess.Popen[bytes]:
    """``argv`` started in a session of its own, its output appended to ``log``; ``options`` go to Popen
    (the environment, the working directory, the user)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **options
        )


def wait_answering(
    process: subprocess.Popen[bytes], answers: Callable[[], bool], *, name: str, log: Path, timeout: float
) -> None:
    """Wait until the server ``process`` ``answers()``; :class:`HarnessError` at once, pointing at its
    ``log``, when it exits first."""

    def up() -> bool:
        if process.poll() is not None:
            raise HarnessError(f"{name} exited: see {log}")
        return answers()

    wait_until(up, timeout=timeout, what=f"{name} to answer")


def free_port() -> int:
    """A free TCP port on loopback below the ephemeral range.

    Not one the kernel hands out for outgoing connections: while a server is down (killed by a test, or
    not bound yet), a client's reconnect attempt to that port could be given it as its own source port and
    connect to itself, and the port would then stay taken (in TIME-WAIT) for a minute.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.Random()
    for _ in range(200):
        port = pick.randrange(max(1024, low - 12000), max(1025, low))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise HarnessError(f"no free port below the ephemeral range (from {low})")


def process_state(pid: int) -> str | None:
    """The one-letter state from /proc (R, S, T for stopped, Z...), None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]  # the command name may itself contain ") "


def children(pid: int) -> list[int]:
    """The direct children of ``pid``, from /proc."""
    found: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        with suppress(OSError):
            found.extend(int(p) for p in path.read_text().split())
    return sorted(set(found))


def end_process(process: subprocess.Popen[bytes], deadline: float, *, group: bool) -> None:
    """Wait for ``process`` until ``deadline``, then SIGKILL it (and its group)."""
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    with suppress(ProcessLookupError, PermissionError):
        if group:  # the main process may be gone; a pool child it orphaned must not outlive us
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    process.wait()
