"""The options and arguments commands share, and their parsers: counts and seconds written with the
digits 0-9 only and kept within a range, ``--since`` as a relative or ISO time, ``--json``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from admin.cli.failures import EXIT_USAGE, fail
from reservations import numerals
from reservations import validation as valid

# Numbers are written as the settings take them (reservations.numerals); typer's own int type would also
# take "3.0".


def parse_since(text: str | None) -> float | None:
    """``30m``, ``2h``, ``1d`` ago, or an ISO 8601 time (UTC when it has no zone) -> epoch seconds, for every
    command (:func:`reservations.validation.since_text`, as the console takes it too)."""
    return valid.since_text(text, field="--since")


def whole(name: str, low: int = 0, high: int | None = None) -> Callable[[str | int], int]:
    """A typer parser for a whole number written with the digits 0-9 only, within [low, high]."""

    def parse(text: str | int) -> int:
        if isinstance(text, int):  # a default, already typed
            return text
        number = numerals.whole(text)
        if number is None:
            fail(EXIT_USAGE, f"{name} {text!r}: write a whole number with the digits 0-9 only")
        return _within(name, number, low, high)

    return parse


def decimal(name: str, low: float, high: float) -> Callable[[str | float], float]:
    """A typer parser for a number written as digits 0-9 with an optional fraction (``2``, ``0.5``)."""

    def parse(text: str | float) -> float:
        if isinstance(text, int | float):  # a default, already typed
            return float(text)
        number = numerals.decimal(text)
        if number is None:
            fail(EXIT_USAGE, f"{name} {text!r}: write a number with the digits 0-9, like 2 or 0.5")
        return _within(name, number, low, high)

    return parse


Number = TypeVar("Number", int, float)


def _within(name: str, value: Number, low: Number, high: Number | None) -> Number:
    if value < low or (high is not None and value > high):
        span = f"at least {low:g}" if high is None else f"between {low:g} and {high:g}"
        fail(EXIT_USAGE, f"{name} must be {span}, got {value:g}")
    return value


def count(name: str, low: int, high: int, help: str) -> Any:
    return typer.Option(name, parser=whole(name, low, high), help=f"{help} [{low}-{high}]")


def seconds(name: str, low: float, high: float, help: str) -> Any:
    return typer.Option(name, parser=decimal(name, low, high), help=f"{help} [{low:g}-{high:g}]")


JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output (stable field names).")]
Limit = Annotated[int, count("--limit", 1, 10_000, "At most this many entries.")]
Since = Annotated[str | None, typer.Option(help="Only entries since: 30m, 2h, 1d or an ISO time.")]
# A SKU is the first argument or ``--sku``, on every command that takes one.
OneSku = Annotated[
    str | None, typer.Argument(metavar="SKU", help="The SKU (or --sku).", show_default=False)
]
SkuOption = Annotated[
    str | None, typer.Option("--sku", metavar="SKU", help="The SKU, as an option.", show_default=False)
]


def one_sku(argument: str | None, option: str | None) -> str | None:
    """The SKU given as the argument or as ``--sku`` (the same one if both), if any."""
    if argument is not None and option is not None and argument != option:
        fail(EXIT_USAGE, f"two SKUs given: {argument!r} and --sku {option!r}")
    return argument if argument is not None else option


def the_sku(argument: str | None, option: str | None) -> str:
    """As :func:`one_sku`, for a command that needs one."""
    sku = one_sku(argument, option)
    if sku is None:
        fail(EXIT_USAGE, "give a SKU: as the first argument or as --sku")
    return sku

Key = Annotated[str, typer.Option("--key", help="Idempotency key: the same key never applies twice.")]
Wait = Annotated[bool, typer.Option("--wait", help="Wait for the final outcome and print it.")]
Timeout = Annotated[float, seconds("--timeout", 0.1, 3600, "Seconds to wait with --wait.")]
# The range of a quantity is the domain's (validation.quantity), checked with the other fields.
Quantity = Annotated[int, typer.Argument(parser=whole("quantity"))]
