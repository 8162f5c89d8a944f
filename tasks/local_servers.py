"""The SKUs a thread of this process serves under the SKU's lease right now, and the requests handed to
that thread in memory (docs/architecture.md, "A hot SKU", step 5): a request joins the server's queue here
(:meth:`LocalServers.join`), the server takes it into its next batch (:meth:`LocalServers.take`), and the
request's own task thread waits for the batch's answer.

A request queued in the pending list by a thread of this process (:meth:`LocalServers.handed_off`) also
leaves it to that server: the server reads the hand-off count before each batch and, having served an
empty one, stops only if the count did not move and nobody joined meanwhile (:meth:`LocalServers.leave`).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from reservations.batch_statement import InHand
from reservations.request_outcomes import RequestResult


@dataclass(slots=True, eq=False)
class Joined:
    """A request handed to this process's server of its SKU: set once its batch is written, or once the
    server gave it back unserved (``result`` None: the request takes the usual way)."""

    request: InHand
    result: RequestResult | None = None
    stored: bool = False  # its Celery result was stored with its batch's
    _done: threading.Event = field(default_factory=threading.Event, init=False)

    def answered(self, result: RequestResult | None, *, stored: bool = False) -> None:
        self.result, self.stored = result, stored
        self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


@dataclass(slots=True)
class _Entry:
    servers: int = 0
    handoffs: int = 0
    joined: deque[Joined] = field(default_factory=deque)


class LocalServers:
    """See the module docstring. Every method takes one lock; none does I/O."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._serving: dict[str, _Entry] = {}

    def enter(self, sku: str) -> None:
        with self._lock:
            self._serving.setdefault(sku, _Entry()).servers += 1

    def serving(self, sku: str) -> bool:
        with self._lock:
            return sku in self._serving

    def joined(self, sku: str) -> bool:
        """Whether a request waits for this process's server of ``sku``."""
        with self._lock:
            entry = self._serving.get(sku)
            return entry is not None and bool(entry.joined)

    def handoffs(self, sku: str) -> int:
        with self._lock:
            return self._serving[sku].handoffs

    def handed_off(self, sku: str) -> bool:
        """Count a request queued (committed) for ``sku``; False when no thread of this process serves it."""
        with self._lock:
            entry = self._serving.get(sku)
            if entry is None:
                return False
            entry.handoffs += 1
            return True

    def join(self, request: InHand) -> Joined | None:
        """Hand ``request`` to this process's server of its SKU; None when no thread serves it."""
        with self._lock:
            entry = self._serving.get(request.sku)
            if entry is None:
                return None
            joined = Joined(request)
            entry.joined.append(joined)
            return joined

    def take(self, sku: str, most: int) -> list[Joined]:
        """The requests joined for ``sku``, oldest first, at most ``most``: the server answers each."""
        with self._lock:
            queue = self._serving[sku].joined
            return [queue.popleft() for _ in range(min(most, len(queue)))]

    def withdraw(self, joined: Joined) -> bool:
        """Take back a request no server has taken yet; False once a batch has it (it will be answered)."""
        with self._lock:
            entry = self._serving.get(joined.request.sku)
            if entry is None or joined not in entry.joined:
                return False
            entry.joined.remove(joined)
            return True

    def leave(self, sku: str, seen: int | None = None) -> bool:
        """Stop serving ``sku``, unless ``seen`` is given and a request was handed off since it was read or
        one joined (then the server reads its queues again). The last server to leave gives the requests
        still joined back unserved."""
        with self._lock:
            entry = self._serving[sku]
            if seen is not None and (entry.handoffs != seen or entry.joined):
                return False
            entry.servers -= 1
            if entry.servers > 0:
                return True
            del self._serving[sku]
            left = list(entry.joined)
        for joined in left:
            joined.answered(None)
        return True


local_servers = LocalServers()
