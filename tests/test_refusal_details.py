"""A refused message's detail can always be recorded, whatever the message held: within the limit of an
outcome's detail (reservations.validation.detail), plain JSON (no NaN or Infinity), the request carried
for a re-drive only when it fits, and the refusal's text bounded. Pure: no services (the workers'
end of it is in tests/test_message_formats.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from reservations import validation as valid
from reservations.statuses import RequestStatus
from tasks.messages import (
    CARRIED_PREFIX_CHARS,
    MAX_CARRIED_CHARS,
    MAX_MESSAGE_CHARS,
    InvalidMessage,
    UnknownFormat,
    parse,
    quoted,
    storable,
)

HUGE = 5_000_000
# Comfortably under the limit of an outcome's detail, whatever the message held.
BOUND = MAX_CARRIED_CHARS + 5 * MAX_MESSAGE_CHARS


def refused(message_format: object, kwargs: dict[str, Any], args: tuple[Any, ...] = ()) -> InvalidMessage:
    with pytest.raises(InvalidMessage) as caught:
        parse("reserve", list(args), {"idempotency_key": "k-1", **kwargs}, message_format=message_format)
    return caught.value


def recorded(exc: InvalidMessage) -> dict[str, Any]:
    """The detail as the database is given it: checked as record_outcome checks it, and bounded."""
    detail = exc.detail()
    assert valid.detail(detail) is detail
    assert len(json.dumps(detail, allow_nan=False)) < BOUND < valid.MAX_DETAIL_JSON_CHARS
    return detail


@pytest.mark.parametrize(
    ("message_format", "shown"),
    [
        (float("nan"), "NaN"),
        (float("inf"), "Infinity"),
        (float("-inf"), "-Infinity"),
        (2.5, 2.5),
        (3, 3),
        (True, True),
        (2**60, str(2**60)),  # not exact as a double
        ([2], "[2]"),
    ],
)
def test_an_unknown_format_is_named_in_a_form_json_can_hold(message_format: object, shown: object) -> None:
    exc = refused(message_format, {"sku": "W", "quantity": 1})
    assert isinstance(exc, UnknownFormat) and exc.status == RequestStatus.DEAD_LETTERED
    detail = recorded(exc)
    assert detail["format"] == shown
    assert detail["request"] == {"type": "reserve", "arguments": {"sku": "W", "quantity": 1}}


def test_a_huge_format_is_named_by_its_start_and_size() -> None:
    detail = recorded(refused("7" * HUGE, {"sku": "W"}))
    assert detail["format"].startswith("7777") and f"({HUGE} characters)" in detail["format"]
    assert f"({HUGE + 2} characters)" in detail["error"]  # its repr, quoted in the text
    assert detail["request"] == {"type": "reserve", "arguments": {"sku": "W"}}


@pytest.mark.parametrize(
    "kwargs",
    [{"sku": "W" * HUGE}, {"note": ["x" * 1000] * 5000}, {"n" * HUGE: 1}],
    ids=["huge value", "many values", "huge argument name"],
)
def test_arguments_too_large_to_carry_are_described_instead(kwargs: dict[str, Any]) -> None:
    exc = refused(3, kwargs)
    detail = recorded(exc)
    assert "request" not in detail and exc.request is None  # nothing to drive again from
    described = detail["request_too_large"]
    assert described["type"] == "reserve"
    size = len(json.dumps(kwargs, sort_keys=True))
    assert described["arguments_chars"] == size > MAX_CARRIED_CHARS
    assert described["arguments_start"] == json.dumps(kwargs, sort_keys=True)[:CARRIED_PREFIX_CHARS]
    assert str(MAX_CARRIED_CHARS) in described["why"]


def test_arguments_that_fit_are_carried_with_numbers_that_are_not_finite_as_text() -> None:
    sent = {"sku": "W", "quantity": float("nan"), "hold_for": float("inf"), "lines": [float("-inf"), 1.5]}
    detail = recorded(refused(3, sent))
    assert detail["request"]["arguments"] == {
        "sku": "W",
        "quantity": "NaN",
        "hold_for": "Infinity",
        "lines": ["-Infinity", 1.5],
    }
    # Just under the limit is carried as it is.
    fits = {"note": "x" * (MAX_CARRIED_CHARS - 100)}
    assert recorded(refused(3, fits))["request"]["arguments"] == fits


def test_an_invalid_messages_text_is_bounded() -> None:
    # A malformed message of a known format quotes what it got: an argument's name, here 5 MB of it.
    exc = refused(2, {"sku": "W", "quantity": 1, "x" * HUGE: 1})
    assert exc.status == RequestStatus.INVALID
    detail = recorded(exc)
    assert detail["message"].startswith("reserve does not take 'xxx")
    assert detail["message"].endswith(f"... ({HUGE + len('reserve does not take ') + 2} characters)")
    assert len(str(exc)) < MAX_MESSAGE_CHARS + 50


def test_storable_json_and_quoted_values() -> None:
    assert storable({"a": float("nan"), "b": [1, float("inf")]}) == (
        {"a": "NaN", "b": [1, "Infinity"]},
        '{"a": "NaN", "b": [1, "Infinity"]}',
    )
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    assert storable(deep) is None  # deeper than JSON can be written: described, not carried
    assert quoted("short") == "short" and quoted(None) == "None"
