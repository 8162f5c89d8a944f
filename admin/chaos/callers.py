"""The HTTP run's callers: ``clients`` threads, each on a connection of its own to the front door, POST the
requests the stream hands them, as a service's callers would. After the stream, every key that was answered
202 is followed by GET on its Location alone, never a second POST, until its outcome is there: the promise
under test is that an accepted request reaches its outcome whatever happened to its messages.
"""

from __future__ import annotations

import queue
import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import sqlalchemy as sa

from admin.chaos.options import FOLLOW_EVERY
from admin.chaos.workload import Sent
from fencing.engines import make_engine
from reservations.models import accepted_requests, request_outcomes
from testing.harness import tls

# The anonymous caller's space: the front door stores an anonymous caller's key K as "*:K".
SPACE = "*:"
# A POST waits for its outcome up to the service's HTTP wait (5 s by default), then answers 202.
REQUEST_TIMEOUT = 30.0
NO_ANSWER = 0  # a status standing for a connection refused, reset or timed out
ACCEPTED_LATER = 202


@dataclass
class HttpFigures:
    """What the callers saw: the POSTs' answers, the keys answered 202 and how they ended by GET alone."""

    clients: int
    posts: Counter[int] = field(default_factory=Counter)  # by status (NO_ANSWER: none)
    recorded: int = 0  # distinct keys the database holds a request or an outcome for
    answered_later: int = 0  # distinct keys some POST answered 202
    followed_to_outcome: int = 0  # of those, keys whose GET gave their outcome
    unresolved: dict[str, int] = field(default_factory=dict)  # key -> its last GET's status
    # From the last fault to the last of those outcomes found by GET (0: every outcome came before it).
    after_last_fault: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "clients": self.clients,
            "posts": {str(status): n for status, n in sorted(self.posts.items())},
            "recorded": self.recorded,
            "answered_202": self.answered_later,
            "reached_outcome_by_get": self.followed_to_outcome,
            "unresolved": self.unresolved,
            "last_outcome_after_last_fault_s": round(self.after_last_fault, 1),
        }


def location(request: Sent) -> str:
    """Where the front door says a request's outcome is (every chaos key is one plain path segment)."""
    bare = quote(request.key.removeprefix(SPACE), safe="")
    return f"/reservations/{bare}" if request.operation == "reserve" else f"/requests/{bare}"


class Callers:
    def __init__(self, url: str, clients: int, respond_async: float = 0.0) -> None:
        self.url = url
        self.respond_async = respond_async
        self.figures = HttpFigures(clients)
        self.answers: dict[str, list[int]] = defaultdict(list)
        self._queue: queue.Queue[Sent | None] = queue.Queue()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._call, daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def send(self, request: Sent) -> None:
        self._queue.put(request)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        """Every request handed over is sent and answered (or timed out) before this returns."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def _call(self) -> None:
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT, verify=tls()) as client:
            while (request := self._queue.get()) is not None:
                # The same requests ask for an answer at once in every run of a seed.
                at_once = zlib.crc32(request.key.encode()) % 1000 < self.respond_async * 1000
                status = _post(client, request, at_once)
                with self._lock:
                    self.answers[request.key].append(status)
                    self.figures.posts[status] += 1

    def follow(
        self, sent: dict[str, Sent], deadline: float, step: Callable[[], None], tick: Callable[[str], None]
    ) -> dict[str, float]:
        """GET every key answered 202 until it answers anything else (its outcome), up to ``deadline``
        (monotonic), calling ``step`` between rounds; when each was found (monotonic). A key still 202,
        404 or unanswered at the deadline is left in ``figures.unresolved`` with its last status."""
        later = sorted(key for key, statuses in self.answers.items() if ACCEPTED_LATER in statuses)
        self.figures.answered_later = len(later)
        found: dict[str, float] = {}
        last: dict[str, int] = {}
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT, verify=tls()) as client:
            while len(found) < len(later) and time.monotonic() < deadline:
                step()
                for key in later:
                    if key in found:
                        continue
                    last[key] = _get(client, location(sent[key]))
                    if last[key] not in (ACCEPTED_LATER, 404, NO_ANSWER) and last[key] < 500:
                        found[key] = time.monotonic()
                tick(f"{len(later) - len(found)} of {len(later)} keys answered 202 still without an outcome")
                if len(found) < len(later):
                    time.sleep(FOLLOW_EVERY)
        self.figures.followed_to_outcome = len(found)
        self.figures.unresolved = {key: last.get(key, NO_ANSWER) for key in later if key not in found}
        return found


def _post(client: httpx.Client, request: Sent, at_once: bool) -> int:
    bare = request.key.removeprefix(SPACE)
    if request.operation == "reserve":
        path, body = "/reservations", {k: request.kwargs[k] for k in ("sku", "quantity")}
    else:
        path, body = (
            f"/reservations/{quote(request.on.removeprefix(SPACE), safe='')}/{request.operation}",
            None,
        )
    try:
        headers = {"Idempotency-Key": bare, **({"Prefer": "respond-async"} if at_once else {})}
        return client.post(path, json=body, headers=headers).status_code
    except httpx.HTTPError:
        return NO_ANSWER


def _get(client: httpx.Client, path: str) -> int:
    try:
        return client.get(path).status_code
    except httpx.HTTPError:
        return NO_ANSWER


def recorded(database_url: str, keys: Iterable[str]) -> set[str]:
    """The keys the database holds a request record or an outcome for: the requests it accepted (a POST
    refused before its record, 4xx or 503, left nothing to check)."""
    wanted = list(keys)
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            found: set[str] = set()
            for table in (accepted_requests, request_outcomes):
                for start in range(0, len(wanted), 1000):
                    chunk = wanted[start : start + 1000]
                    found.update(conn.execute(sa.select(table.c.key).where(table.c.key.in_(chunk))).scalars())
            return found
    finally:
        engine.dispose()
