"""What a SKU, a quantity, an idempotency key and a hold look like, checked before any I/O.

SKUs are deliberately plain (ASCII letters, digits, ``._-``): they appear in lease scopes, Redis keys,
log lines and URLs, and a grammar is easier to audit than an escaping scheme in each of those places.
"""

from __future__ import annotations

import math
import re

from reservations.errors import InvalidRequest

MAX_SKU_CHARS = 64
MAX_QUANTITY = 1_000_000
MAX_KEY_CHARS = 200
MAX_HOLD_SECONDS = 30 * 24 * 3600
MAX_ORDER_LINES = 100

_SKU = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KEY = re.compile(r"[!-~]{1,200}")  # printable ASCII, no spaces
_RESERVATION_ID = re.compile(r"r_[0-9a-f]{32}")


def sku(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"SKU must be a string, not {type(value).__name__}", field="sku")
    if not _SKU.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise InvalidRequest(
            f"SKU {shown!r} is not 1-{MAX_SKU_CHARS} characters of A-Z a-z 0-9 . _ - "
            "(starting with a letter or digit)",
            field="sku",
        )
    return value


def quantity(value: object, *, field: str = "quantity") -> int:
    """A positive whole number of units, at most :data:`MAX_QUANTITY`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{field} must be a whole number, not {type(value).__name__}", field=field)
    if not 1 <= value <= MAX_QUANTITY:
        raise InvalidRequest(f"{field} must be between 1 and {MAX_QUANTITY}, got {value}", field=field)
    return value


def delta(value: object) -> int:
    """A non-zero stock correction within +-:data:`MAX_QUANTITY`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"delta must be a whole number, not {type(value).__name__}", field="delta")
    if value == 0 or abs(value) > MAX_QUANTITY:
        raise InvalidRequest(f"delta must be non-zero and within +-{MAX_QUANTITY}", field="delta")
    return value


def idempotency_key(value: object) -> str:
    if not isinstance(value, str) or not _KEY.fullmatch(value):
        raise InvalidRequest(
            f"idempotency key must be 1-{MAX_KEY_CHARS} printable ASCII characters without spaces",
            field="idempotency_key",
        )
    return value


def reservation_id(value: object) -> str:
    if not isinstance(value, str) or not _RESERVATION_ID.fullmatch(value):
        raise InvalidRequest("reservation id must look like r_<32 hex digits>", field="reservation_id")
    return value


def hold_seconds(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest("hold must be a number of seconds", field="hold_for")
    if not 0 < value <= MAX_HOLD_SECONDS:
        raise InvalidRequest(f"hold must be between 0 and {MAX_HOLD_SECONDS} seconds", field="hold_for")
    return float(value)


def order_lines(lines: object) -> list[tuple[str, int]]:
    """Order lines as (sku, quantity) with distinct SKUs, sorted by SKU: the order leases are taken in."""
    if not isinstance(lines, list | tuple) or not 1 <= len(lines) <= MAX_ORDER_LINES:
        raise InvalidRequest(f"an order needs 1-{MAX_ORDER_LINES} lines", field="lines")
    checked: dict[str, int] = {}
    for line in lines:
        if not isinstance(line, list | tuple) or len(line) != 2:
            raise InvalidRequest("each order line is (sku, quantity)", field="lines")
        name, units = sku(line[0]), quantity(line[1])
        if name in checked:
            raise InvalidRequest(f"SKU {name!r} appears twice in the order", field="lines")
        checked[name] = units
    return sorted(checked.items())


def scope_of(name: str) -> str:
    """The lease scope that guards a SKU's stock row."""
    return f"sku:{name}"
