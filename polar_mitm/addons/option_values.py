"""Option values the addons parse themselves, each refused with an OptionsError that names
the option. Strings: mitmproxy options take no floats, and a size reads like 64m."""

from __future__ import annotations

from mitmproxy import exceptions
from mitmproxy.utils import human


def seconds(name: str, text: str, most: int = 3600) -> float:
    """Seconds from 0 (off) to `most` (not a number, negative, NaN or longer: refused)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= most:
        raise exceptions.OptionsError(f"{name}: seconds from 0 (off) to {most}, got {text!r}")
    return value


def size(name: str, text: str) -> int:
    """A positive size in bytes, written like 64m."""
    try:
        value = human.parse_size(text)
    except ValueError:
        value = None
    if not value or value <= 0:
        raise exceptions.OptionsError(f"{name}: expected a size like 64m, got {text!r}")
    return value


def integer(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise exceptions.OptionsError(f"{name}: expected an integer, got {text!r}") from None
