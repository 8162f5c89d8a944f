"""The renewer thread of :meth:`fencing.LeaseManager.hold` and what follows a failed renewal in either
shell."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from fencing.errors import BackendUnavailable, FencingError
from fencing.lease import Lease

# A renewal the coordinator did not answer is asked again after this, while the lease has at least twice
# as long left on its local clock.
RETRY_UNANSWERED = 0.05


def retry_renewal(lease: Lease, error: Exception) -> float | None:
    """After a renewal of ``lease`` raised ``error``: the seconds until it is asked again or, when the lease
    cannot be assumed renewed, None with the lease marked lost. For the renewers of both shells (a thread
    for the sync one, a task for the async one).

    An unanswered renewal (:class:`BackendUnavailable`) may well have left the lease held: the answer, not
    the lease, went missing, so it is asked again while the lease has time left on its local clock for
    another try, and a coordinator stalled for less than the ttl costs no lease. Any other failure, or too
    little time, and the lease is lost."""
    if isinstance(error, BackendUnavailable) and lease.time_left() > 2 * RETRY_UNANSWERED:
        return RETRY_UNANSWERED
    lease.mark_lost(
        f"renewal failed: {error}" if isinstance(error, FencingError) else f"renewal failed: {error!r}"
    )
    return None


class Renewer:
    """One thread per lease manager renews every lease held through it when each is due, instead of a
    thread started and joined per hold (about half a millisecond of a reservation task). Renewals run
    one at a time; a failed one is asked again or marks its lease lost, as its verdict says. Rebuilt in
    a forked child, which inherits the state but not the thread.

    Adding a lease wakes the thread only when the lease is due before the thread's next wake-up: a
    worker adds and removes a lease per task, and a wake-up per task (a thread switch and the GIL
    changing hands twice) costs more than the rest of the bookkeeping. With nothing held the thread
    naps ``IDLE_NAP`` at a time, so a lease due later than that never needs to wake it."""

    IDLE_NAP = 1.0

    def __init__(self, renew: Callable[[Lease], Any]) -> None:
        self._renew = renew
        self._cond = threading.Condition()
        self._held: dict[str, tuple[float, Lease, float]] = {}  # lease id -> (due, lease, interval)
        self._busy: str | None = None  # the lease id being renewed right now
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False
        self._wakes_at = 0.0  # monotonic time the thread wakes by on its own (0: not waiting)

    def add(self, lease: Lease, every: float) -> None:
        with self._cond:
            if self._pid != os.getpid():
                self._held, self._busy, self._thread, self._pid = {}, None, None, os.getpid()
            self._closed = False
            due = time.monotonic() + every
            self._held[lease.lease_id] = (due, lease, every)
            if self._thread is None or not self._thread.is_alive():
                self._wakes_at = 0.0
                self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
                self._thread.start()
            elif due < self._wakes_at:
                self._cond.notify_all()

    def remove(self, lease: Lease) -> None:
        """Stop renewing ``lease``; returns once no renewal of it is in flight, so a release or a repair
        that follows never races one."""
        with self._cond:
            self._held.pop(lease.lease_id, None)
            while self._busy == lease.lease_id:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _next(self) -> tuple[str, Lease] | None:
        """Wait until a lease is due and claim it; None when closed with nothing held."""
        with self._cond:
            while True:
                if self._closed and not self._held:
                    self._thread = None  # a hold added after this starts a thread of its own
                    return None
                now = time.monotonic()
                if not self._held:
                    self._wakes_at = now + self.IDLE_NAP
                    self._cond.wait(self.IDLE_NAP)
                    continue
                lease_id, (due, lease, every) = min(self._held.items(), key=lambda item: item[1][0])
                if due > now:
                    self._wakes_at = due
                    self._cond.wait(due - now)
                    continue
                self._wakes_at = 0.0
                self._held[lease_id] = (now + every, lease, every)
                self._busy = lease_id
                return lease_id, lease

    def _run(self) -> None:
        while (claimed := self._next()) is not None:
            lease_id, lease = claimed
            failed, retry_in = False, None
            try:
                self._renew(lease)
            except Exception as exc:
                failed, retry_in = True, retry_renewal(lease, exc)
            with self._cond:
                if failed and retry_in is None:
                    self._held.pop(lease_id, None)
                elif retry_in is not None and lease_id in self._held:
                    _, held, every = self._held[lease_id]
                    self._held[lease_id] = (time.monotonic() + retry_in, held, every)
                self._busy = None
                self._cond.notify_all()
