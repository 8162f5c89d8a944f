"""Named fault-injection points for fault tests and chaos runs; inert unless configured.

``RESERVATIONS_FAILPOINTS="before_write=stop,once;after_write=kill"`` makes the worker stop itself with
SIGSTOP right after taking its leases, or die with SIGKILL after its stock change committed but before
its outcome was recorded and its message acknowledged. ``in_write`` sits inside the fenced write, after
the lease's local checks and before the statement is sent: a pause there is the delayed packet. ``once`` fires
in one process only, coordinated by an exclusive marker file in ``RESERVATIONS_FAILPOINT_DIR``, which it
requires: the markers outlive the processes, so whoever starts a run gives it a directory of its own (or
empties it) and a later run is not left with a failpoint that already fired.
``renew=skip`` makes the process's lease holders never renew: a holder whose renewals do not arrive (its
requests stuck in the network), so its lease runs out while it works and only the fence stops its write.
``build_inventory`` and ``build_leases`` sit where a worker process builds its database and lease clients
(after the checks at start): ``raise`` there is a client that cannot be built in a running worker.
``retry_published`` sits right after a task published its own retry and before that attempt ends (when
Celery handles the retry): a pause there lets the retry run to its end on another worker first.
Actions: ``stop``, ``kill``, ``sleep:SECONDS``, ``raise``, and ``skip`` for ``renew``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from functools import cache
from pathlib import Path
from typing import Any

from celery import current_task
from celery.signals import after_task_publish

from fencing.lease import MAX_TTL
from tasks.errors import TasksError
from tasks.settings import variable

log = logging.getLogger("tasks.failpoints")

# Read from the environment at each point rather than from the settings object: the points sit where no
# settings are at hand, and a test changes them within its process.
FAILPOINTS = variable("failpoints").name
FAILPOINT_DIR = variable("failpoint_dir").name

POINTS = (
    "before_write",
    "in_write",
    "after_write",
    "build_inventory",
    "build_leases",
    "retry_published",
    "renew",
)
ACTIONS = ("stop", "kill", "raise", "skip")


class FailpointFired(TasksError, RuntimeError):
    """The ``raise`` action: the fault a failpoint stands for."""


@cache
def _configured(spec: str) -> dict[str, tuple[str, bool]]:
    points: dict[str, tuple[str, bool]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, action = part.partition("=")
        action, _, flag = action.partition(",")
        if name not in POINTS or not (action in ACTIONS or action.startswith("sleep:")):
            raise ValueError(f"bad failpoint {part!r}; points: {', '.join(POINTS)}")
        if (name == "renew") != (action == "skip"):
            raise ValueError(f"bad failpoint {part!r}: skip is renew's action, and renew's only one")
        points[name] = (action, flag == "once")
    return points


def check(spec: str, folder: str) -> str | None:
    """What is wrong with a failpoint configuration, or None: a worker refuses it at start instead of
    failing every task that reaches a point."""
    try:
        points = _configured(spec) if spec else {}
    except ValueError as exc:
        return f"{FAILPOINTS}: {exc}"
    if not folder and any(once for _, once in points.values()):
        return f"{FAILPOINTS}: 'once' needs {FAILPOINT_DIR}, a directory for this run"
    return None


def _claim(name: str) -> bool:
    configured = os.environ.get(FAILPOINT_DIR)
    if not configured:
        raise ValueError(f"failpoint {name}: 'once' needs {FAILPOINT_DIR}, a directory for this run")
    folder = Path(configured)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def failpoint(name: str) -> None:
    configured = _configured(os.environ.get(FAILPOINTS) or "").get(name)
    if configured is None or (configured[1] and not _claim(name)):  # once, and fired already
        return
    action = configured[0]
    log.warning("failpoint %s: %s in process %d", name, action, os.getpid())
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise FailpointFired(f"failpoint {name}")
    else:
        time.sleep(float(action.removeprefix("sleep:")))


@after_task_publish.connect
def _retry_published(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """The ``retry_published`` point. A message published from inside a task with that task's own id is its
    retry (anything else a task sends has an id of its own)."""
    if not os.environ.get(FAILPOINTS) or headers is None:
        return
    if current_task and current_task.request.id == headers.get("id"):  # the proxy is false outside a task
        failpoint("retry_published")


def renew_every(configured: float | None) -> float | None:
    """The renewal interval a holder of this process uses: the configured one, or with ``renew=skip``
    the longest a lease can last, so that no renewal comes while it holds (settings refuse an interval
    that long: outside fault injection it is a misconfiguration)."""
    skip = _configured(os.environ.get(FAILPOINTS) or "").get("renew", ("", False))[0] == "skip"
    return MAX_TTL if skip else configured
