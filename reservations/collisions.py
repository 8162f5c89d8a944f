"""Looking again after losing a race on a key: the one retry policy for collisions.

Every request row is written under a unique key (the idempotency record, the outcome, the pending
entry, the reservation). When two copies of a request race, the database lets the first commit and
fails the other on the unique key (:class:`~reservations.errors.KeyTaken`) without writing anything;
the loser's next round reads what the winner stored and answers from it. Two rounds settle every race a
key can have (the record, then the outcome written after it); the third is slack. A plan still
colliding after that has met something other than a race, and says so rather than looping.

A plan writes its rounds in place, as tenacity's ``for attempt in Retrying(): with attempt:`` does, so
the statement is sent from the plan itself::

    for round_ in rounds():
        with round_:
            return (yield Atomic(insert(...)))
    raise KeptColliding(f"the outcome of {key!r}")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType

from reservations.errors import KeyTaken

ROUNDS = 3


class KeptColliding(RuntimeError):
    """A plan lost the race for its key in every round: not a race but a bug or a foreign writer."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"{what} kept colliding on its unique key after {ROUNDS} rounds")


@dataclass(slots=True)
class Round:
    """One round: a lost race on the key ends it quietly (the loop starts the next); any other error
    passes. ``on_taken`` sees each collision first and may raise to end the plan (a clash that is not
    a race)."""

    on_taken: Callable[[KeyTaken], None]

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if not isinstance(error, KeyTaken):
            return False
        self.on_taken(error)
        return True


def rounds(*, on_taken: Callable[[KeyTaken], None] = lambda taken: None) -> Iterator[Round]:
    """The rounds of a plan that writes under a unique key, after which it raises
    :class:`KeptColliding`. By default every collision means "look again"."""
    for _ in range(ROUNDS):
        yield Round(on_taken)
