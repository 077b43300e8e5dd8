"""Reference algorithms for the store's deltas (polar_mitm/store/delta.py), kept for the
tests only: exact, character- and id-level versions of what the proxy finds a fingerprint
block at a time, so the tests can check the blocked ones against them."""

from __future__ import annotations

from dataclasses import dataclass

from polar_mitm.store.delta import common_prefix, count_ids

_CHUNK = 4096


def common_suffix(a, b, limit: int) -> int:
    """Length of the common suffix, at most `limit` (so it never overlaps a prefix)."""
    n = min(len(a), len(b), limit)
    i = 0   # a[len(a)-i:] == b[len(b)-i:]
    la, lb = len(a), len(b)
    while i < n:
        j = min(i + _CHUNK, n)
        if a[la - j:la - i] == b[lb - j:lb - i]:
            i = j
            continue
        lo, hi = i, j - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[la - mid:la - i] == b[lb - mid:lb - i]:
                lo = mid
            else:
                hi = mid - 1
        return lo
    return n


@dataclass(frozen=True)
class TextDelta:
    prefix: int
    suffix: int
    middle: str


def text_delta(base: str, text: str) -> TextDelta:
    """The smallest request-text delta: the exact common prefix and suffix."""
    prefix = common_prefix(base, text)
    suffix = common_suffix(base, text, min(len(base), len(text)) - prefix)
    return TextDelta(prefix, suffix, text[prefix:len(text) - suffix])


def apply_text(base: str, prefix: int, suffix: int, middle: str) -> str:
    """The calls view's request-text rule (schema.py), in Python."""
    return base[:prefix] + middle + (base[len(base) - suffix:] if suffix else "")


def shared_ids(base: bytes, ids: bytes) -> tuple[int, int]:
    """How many leading ids two JSON id lists share (those whose separator, `,` or `]`,
    lies inside their common prefix, or right at its end in both), and the index in `ids`
    of the last shared one's separator (0 when none is shared)."""
    if len(ids) <= 2 or len(base) <= 2:
        return 0, 0
    p = common_prefix(base, ids)
    if p >= len(ids):
        return count_ids(ids), len(ids) - 1
    if ids[p:p + 1] in (b",", b"]") and base[p:p + 1] in (b",", b"]"):
        return ids.count(b",", 0, p) + 1, p
    return ids_before(ids, p)


def ids_before(ids: bytes, p: int) -> tuple[int, int]:
    """How many ids of a JSON id list have their separator before byte p (so, where the
    first p bytes equal another list's, are whole in both), and the index of the last such
    separator (0 when none)."""
    cut = ids.rfind(b",", 0, p)
    return (ids.count(b",", 0, cut) + 1, cut) if cut > 0 else (0, 0)
