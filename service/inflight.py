"""Each caller's write requests in flight in this process, bounded per caller: the door's backpressure
(service.backlog) bounds the broker's queue for everyone at once, so one caller sending without pause
would fill it and every other caller hear 503. Counting each caller's own requests while they are
admitted, published and waited on lets the door refuse that caller alone (429) before it takes the room
of the others. Pure: the routes take a slot and give it back on the event loop's one thread.
"""

from __future__ import annotations

__all__ = ["InFlight"]


class InFlight:
    """Requests in flight per caller space, at most ``bound`` each (0: no bound)."""

    def __init__(self, bound: int) -> None:
        if bound < 0:
            raise ValueError(f"a bound of requests in flight is 0 (none) or more, got {bound}")
        self.bound = bound
        self._held: dict[str, int] = {}  # only spaces with a request in flight: it never grows with callers

    def take(self, space: str) -> bool:
        """Count one more request of ``space`` in flight; False (nothing counted) when it has ``bound``
        already."""
        held = self._held.get(space, 0)
        if self.bound and held >= self.bound:
            return False
        self._held[space] = held + 1
        return True

    def give_back(self, space: str) -> None:
        """One request of ``space`` was answered (or its caller went away)."""
        held = self._held.get(space, 0)
        if held <= 0:
            raise ValueError(f"no request of {space!r} is in flight")
        if held == 1:
            del self._held[space]
        else:
            self._held[space] = held - 1
