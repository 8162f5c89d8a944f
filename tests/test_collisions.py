"""The one retry policy for a lost race on a key (reservations.collisions), stepped through with scripted
answers: the database's reply to each yielded statement is played by the test, the decisions are the
plan's. No services."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fencing.plan import Atomic, Plan, run_sync
from reservations.collisions import ROUNDS, KeptColliding, rounds
from reservations.errors import KeyTaken


def _look_again(taken: KeyTaken) -> None:
    return None


def _step(n: int) -> Plan[int]:
    yield Atomic(iter(()))  # a placeholder operation; the scripted answers decide what it returns
    return n


def _written(
    attempt: Callable[[], Plan[int]], on_taken: Callable[[KeyTaken], None] = _look_again
) -> Plan[int]:
    """A plan writing under a key as the library's plans do: its rounds in place."""
    for round_ in rounds(on_taken=on_taken):
        with round_:
            return (yield from attempt())
    raise KeptColliding("the test request")


def _scripted(answers: list[BaseException | None]) -> tuple[list[int], object]:
    """Drive a settled plan whose n-th operation is answered by ``answers[n]`` (an error thrown into the
    plan, or None for success); return the rounds started and the result."""
    rounds: list[int] = []

    def attempt() -> Plan[int]:
        rounds.append(len(rounds))
        return _step(len(rounds))

    replies = iter(answers)

    def handle(op: object) -> None:
        error = next(replies)
        if error is not None:
            raise error

    return rounds, run_sync(_written(attempt), handle)


def _taken(where: str = "record") -> KeyTaken:
    return KeyTaken(where=where, constraint=f"{where}_pkey")


def test_a_lost_race_is_looked_at_again_and_the_next_round_answers() -> None:
    rounds, result = _scripted([_taken(), None])
    assert rounds == [0, 1]
    assert result == 2


def test_a_plan_that_never_wins_its_key_says_so_instead_of_looping() -> None:
    with pytest.raises(KeptColliding, match=f"the test request kept colliding .* {ROUNDS} rounds"):
        _scripted([_taken()] * ROUNDS + [None])


def test_a_collision_that_is_not_a_race_ends_the_plan_with_the_callers_error() -> None:
    class NotARace(Exception):
        pass

    def refuse(taken: KeyTaken) -> None:
        if taken.where == "reservation":
            raise NotARace(taken.constraint)

    started: list[int] = []

    def attempt() -> Plan[int]:
        started.append(1)
        return _step(1)

    answers = iter([_taken("reservation"), None])

    def handle(op: object) -> None:
        error = next(answers)
        if error is not None:
            raise error

    with pytest.raises(NotARace, match="reservation_pkey"):
        run_sync(_written(attempt, refuse), handle)
    assert started == [1]


def test_other_errors_pass_through_at_once() -> None:
    with pytest.raises(ValueError, match="not a collision"):
        _scripted([ValueError("not a collision"), None])
