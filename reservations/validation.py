"""What a SKU, a quantity, an idempotency key and a hold look like, checked before any I/O.

SKUs are deliberately plain (ASCII letters, digits, ``._-``): they appear in lease scopes, Redis keys,
log lines and URLs, and a grammar is easier to audit than an escaping scheme in each of those places.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from fencing import Lease
from fencing.lease import MAX_TOKEN, has_control
from reservations.errors import InvalidRequest

MAX_SKU_CHARS = 64
MAX_QUANTITY = 1_000_000
# The most units one SKU may have on hand. Far above any real count, yet a stock row never nears what a
# BIGINT holds, and every level stays exact as a double (below 2**53), so outcomes stored as JSON keep
# each unit for any JSON reader. Checked in the fenced UPDATE itself, so concurrent restocks cannot pass it.
MAX_ON_HAND = 10**12
MAX_KEY_CHARS = 200
MAX_HOLD_SECONDS = 30 * 24 * 3600
MAX_ORDER_LINES = 100
MAX_LIMIT = 10_000
MAX_REASON_CHARS = 500
MAX_DETAIL_CHARS = 10_000  # an attempt's detail: an exception's message, kept whole for the operator
MAX_DETAIL_JSON_CHARS = 100_000  # a final outcome's detail, as stored JSON
MAX_TASK_ID_CHARS = 64
MAX_WORKER_CHARS = 200
MAX_EPOCHS = 1_000_000
# Retentions beyond a century are a mistake, and their milliseconds must still fit a BIGINT.
MAX_RETENTION_SECONDS = 100 * 365 * 24 * 3600.0
# 9999-12-31T23:59:59Z: a "since" further from the epoch is a unit mistake (milliseconds for seconds) or
# garbage, and its milliseconds would not fit the database's integers.
MAX_TIMESTAMP = 253_402_300_799.0

_SKU = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KEY = re.compile(r"[!-~]{1,200}")  # printable ASCII, no spaces
_RESERVATION_ID = re.compile(r"r_[0-9a-f]{32}")
_OPERATION = re.compile(r"[a-z][a-z_]{0,31}")
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
# What a reservation can be looked up by: its id, its request's key, or an order line's "<key> <sku>".
_RESERVATION_REF = re.compile(rf"[!-~][ -~]{{0,{MAX_KEY_CHARS + MAX_SKU_CHARS}}}")


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


def whole(value: object, field: str, low: int, high: int) -> int:
    """A whole number from ``low`` to ``high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{field} must be a whole number, not {type(value).__name__}", field=field)
    if not low <= value <= high:
        raise InvalidRequest(f"{field} must be between {low} and {high}, got {value}", field=field)
    return value


def number(value: object, field: str, low: float, high: float, *, above: bool = False) -> float:
    """A finite number from ``low`` (past it, when ``above``) to ``high``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{field} must be a finite number, not {value!r}", field=field)
    if not (low < value if above else low <= value) or value > high:
        side = "above" if above else "from"
        raise InvalidRequest(
            f"{field} must be {side} {low:.0f} and at most {high:.0f}, got {value!r}", field=field
        )
    return float(value)


def quantity(value: object) -> int:
    """A positive whole number of units, at most :data:`MAX_QUANTITY`."""
    return whole(value, "quantity", 1, MAX_QUANTITY)


def on_hand(value: object) -> int:
    """A new SKU's units: zero, or a quantity."""
    return whole(value, "on_hand", 0, MAX_QUANTITY)


def delta(value: object) -> int:
    """A non-zero stock correction within +-:data:`MAX_QUANTITY`."""
    checked = whole(value, "delta", -MAX_QUANTITY, MAX_QUANTITY)
    if checked == 0:
        raise InvalidRequest("delta must be non-zero", field="delta")
    return checked


def _shaped(value: object, shape: re.Pattern[str], field: str, says: str) -> str:
    """``value``, a string of ``shape``; else InvalidRequest saying ``says``."""
    if not isinstance(value, str) or not shape.fullmatch(value):
        raise InvalidRequest(says, field=field)
    return value


def idempotency_key(value: object) -> str:
    says = f"idempotency key must be 1-{MAX_KEY_CHARS} printable ASCII characters without spaces"
    return _shaped(value, _KEY, "idempotency_key", says)


def reservation_ref(value: object) -> str:
    """A reservation id, or the key (an order line's ``"<key> <sku>"``) that created it."""
    return _shaped(value, _RESERVATION_REF, "reservation", "give a reservation id or an idempotency key")


def reservation_id(value: object) -> str:
    return _shaped(
        value, _RESERVATION_ID, "reservation_id", "reservation id must look like r_<32 hex digits>"
    )


def hold_seconds(value: object) -> float | None:
    return None if value is None else number(value, "hold_for", 0, MAX_HOLD_SECONDS, above=True)


def hold_ms(value: object) -> int | None:
    """A hold in whole milliseconds, as a reservation stores it (None: no expiry)."""
    return None if value is None else whole(value, "hold_ms", 1, MAX_HOLD_SECONDS * 1000)


def deadline(value: object) -> float | None:
    """When a request stops being worth doing, in seconds since the epoch (None: never). A figure past
    :data:`MAX_TIMESTAMP` is refused: milliseconds given for seconds would make a deadline that never
    comes."""
    return None if value is None else number(value, "deadline", 0, MAX_TIMESTAMP, above=True)


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


def text(value: object, *, field: str, max_chars: int) -> str | None:
    """Optional free text (a reason, an attempt's detail): stored and printed, so no control characters
    (PostgreSQL refuses NUL outright) and no lone surrogates."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{field} must be a string, not {type(value).__name__}", field=field)
    if len(value) > max_chars:
        raise InvalidRequest(f"{field} is {len(value)} characters, the limit is {max_chars}", field=field)
    if has_control(value):
        raise InvalidRequest(f"{field} contains control characters or lone surrogates", field=field)
    return value


def name(value: object, *, field: str, max_chars: int) -> str | None:
    """An optional identifier (a task id, a worker): like :func:`text`, and never empty."""
    if value == "":
        raise InvalidRequest(f"{field} must not be empty", field=field)
    return text(value, field=field, max_chars=max_chars)


def operation(value: object) -> str:
    """An operation name as requests record it: ``reserve``, ``reserve_many``, ``confirm``, ..."""
    return _shaped(value, _OPERATION, "operation", "operation must be 1-32 characters of a-z and _")


def lease(value: object) -> Lease:
    if not isinstance(value, Lease):
        raise InvalidRequest(f"expected a fencing Lease, got {type(value).__name__}", field="lease")
    return value


def leases(value: object) -> Mapping[str, Lease]:
    """An order's leases by SKU."""
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"leases must map SKUs to leases, not {type(value).__name__}", field="leases")
    for key, held in value.items():
        if not isinstance(key, str) or not isinstance(held, Lease):
            raise InvalidRequest(
                f"leases must map SKUs to leases, found {type(key).__name__} -> {type(held).__name__}",
                field="leases",
            )
    return value


def skus(value: object) -> list[str]:
    """Several SKUs (a string is one SKU, never a sequence of one-letter SKUs)."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequest("give the SKUs as a list", field="skus")
    return [sku(s) for s in value]


def limit(value: object, *, maximum: int = MAX_LIMIT) -> int:
    return whole(value, "limit", 1, maximum)


def since(value: object) -> float | None:
    """A point in time in seconds since the epoch, or None for all time. Before the epoch is allowed:
    "--since 60000d" means everything, not a mistake."""
    return None if value is None else number(value, "since", -MAX_TIMESTAMP, MAX_TIMESTAMP)


_RELATIVE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")


def since_text(text: str | None, *, field: str = "since") -> float | None:
    """``30m``, ``2h``, ``1d`` ago, or an ISO 8601 time (UTC when it has no zone) -> epoch seconds, within
    the range :func:`since` takes: what filters in memory must refuse what a query refuses."""
    if text is None:
        return None
    match = _RELATIVE.fullmatch(text)
    if match:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        moment = time.time() - float(match.group(1)) * unit
    else:
        try:
            at = dt.datetime.fromisoformat(text)
        except ValueError:
            raise InvalidRequest(f"{field} {text!r}: use 30m, 2h, 1d or an ISO time", field="since") from None
        moment = (at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)).timestamp()
    try:
        return since(moment)
    except InvalidRequest:
        raise InvalidRequest(
            f"{field} {text!r} is out of range: times run from about 6000 BC to 9999-12-31"
            " (use 30m, 2h, 1d or an ISO time)",
            field="since",
        ) from None


def retention(value: object) -> float:
    """How long records are kept, in seconds: at least a minute, at most a century."""
    return number(value, "older_than", 60, MAX_RETENTION_SECONDS)


def epochs(value: object) -> int:
    """How many leases a request has outlived."""
    return whole(value, "epochs", 0, MAX_EPOCHS)


def token(value: object) -> int | None:
    """An optional fencing token, as an attempt records it."""
    return None if value is None else whole(value, "token", 1, MAX_TOKEN)


def fingerprint(value: object) -> str | None:
    """A request fingerprint: a SHA-256 in hex."""
    says = "fingerprint must be 64 lowercase hex digits"
    return None if value is None else _shaped(value, _FINGERPRINT, "fingerprint", says)


def detail(value: object) -> dict[str, Any]:
    """A final outcome's detail: a JSON object, finite numbers only, of bounded size."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"detail must be a dict, not {type(value).__name__}", field="detail")
    stored_json(value, "detail")
    return value


def stored_json(value: Mapping[str, Any], field: str) -> str:
    """``value`` as the JSON stored for it: plain JSON (finite numbers), of bounded size."""
    try:
        stored = json.dumps(dict(value), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{field} must be plain JSON: {exc}", field=field) from None
    if len(stored) > MAX_DETAIL_JSON_CHARS:
        raise InvalidRequest(f"{field} is over {MAX_DETAIL_JSON_CHARS} characters as JSON", field=field)
    return stored


def task_and_worker(task_id: object = None, worker: object = None) -> None:
    """The task and worker a request's record names."""
    name(task_id, field="task_id", max_chars=MAX_TASK_ID_CHARS)
    name(worker, field="worker", max_chars=MAX_WORKER_CHARS)
