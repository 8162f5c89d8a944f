"""How a number is written to this project, in an environment variable or on the command line: with the
ASCII digits 0-9 only, a whole number for a count, an optional fraction for seconds (``2``, ``0.5``).

Python's ``int()`` and ``float()`` take more: ``" 3"``, ``"1_000"``, other scripts' digits (Arabic-Indic ten),
``"1e3"``, ``"nan"`` and ``"inf"``. None of those is how a person writes a count or a ttl, and a setting
must not mean something the command line would refuse, so the text is matched here first.
"""

from __future__ import annotations

import re

__all__ = ["DECIMAL", "WHOLE", "decimal", "whole"]

WHOLE = re.compile(r"[0-9]+")
DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def whole(text: str) -> int | None:
    """``text`` as a whole number, or None when it is not written as one."""
    # re's [0-9] is ASCII only, so int() never sees another script's digits.
    return int(text) if WHOLE.fullmatch(text) else None


def decimal(text: str) -> float | None:
    """``text`` as a number with an optional fraction, or None when it is not written as one."""
    return float(text) if DECIMAL.fullmatch(text) else None
