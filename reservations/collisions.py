"""Looking again after losing a race on a key: the one retry policy for collisions.

Every request row is written under a unique key (the idempotency record, the outcome, the pending
entry, the reservation). When two copies of a request race, the database lets the first commit and
fails the other on the unique key (:class:`~reservations.errors.KeyTaken`) without writing anything;
the loser's next round reads what the winner stored and answers from it. Two rounds settle every race a
key can have (the record, then the outcome written after it); the third is slack. A plan still
colliding after that has met something other than a race, and says so rather than looping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fencing.plan import Plan
from reservations.errors import KeyTaken

T = TypeVar("T")

ROUNDS = 3


class KeptColliding(RuntimeError):
    """A plan lost the race for its key in every round: not a race but a bug or a foreign writer."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"{what} kept colliding on its unique key after {ROUNDS} rounds")


def _look_again(taken: KeyTaken) -> None:
    return None


def settled(
    attempt: Callable[[], Plan[T]], what: str, *, on_taken: Callable[[KeyTaken], None] = _look_again
) -> Plan[T]:
    """Run ``attempt`` (a fresh plan each round) until it finishes without losing a race on its key.

    ``on_taken`` sees each collision first and may raise to end the plan (a clash that is not a race);
    by default every collision means "look again". ``what`` names the plan in :class:`KeptColliding`.
    """
    for _ in range(ROUNDS):
        try:
            return (yield from attempt())
        except KeyTaken as taken:
            on_taken(taken)
    raise KeptColliding(what)
