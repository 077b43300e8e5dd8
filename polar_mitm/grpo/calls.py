"""The trainer's view of the recorded calls (polar_mitm.trainer_input.Call): grouped by key,
compared by token prefix, and where a later prompt re-renders an earlier call's tokens.
Plain lists: no torch and no duckdb here."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from ..trainer_input import Call


def by_key(calls: Sequence[Call], key: Callable[[Call], str]) -> dict[str, list[int]]:
    """Indices of calls per key (insertion ordered)."""
    out: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(calls):
        out[key(c)].append(i)
    return dict(out)


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by bisection with C-speed slice compares."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


def is_prefix(p: Sequence[int], s: Sequence[int]) -> bool:
    return len(p) <= len(s) and s[:len(p)] == p


@dataclass(frozen=True, slots=True)
class Drift:
    """A later prompt that continues an earlier call but re-renders its sampled tokens
    differently from offset `at` on (`tokens` = size of the differing region)."""
    call: int          # the earlier call
    later: int         # the call whose prompt re-renders it
    at: int
    tokens: int


def drift_events(calls: Sequence[Call]) -> list[Drift]:
    """Per session: for each call, the earlier call whose prompt it strictly extends
    (longest such prompt); drift is where it does not also extend that call's response."""
    events = []
    for idx in by_key(calls, lambda c: c.session_id).values():
        for pos, k in enumerate(idx):
            pk = calls[k].prompt
            best = None
            for e in idx[:pos]:
                pe = calls[e].prompt
                if len(pe) < len(pk) and is_prefix(pe, pk) and (best is None or len(pe) > len(calls[best].prompt)):
                    best = e
            if best is None:
                continue
            pe, re_ = calls[best].prompt, calls[best].tokens
            d = lcp(pk[len(pe):], re_)
            if d == len(re_):
                continue
            # the re-rendered span runs to the first end-of-turn token after the split
            rerender = len(pk) - len(pe) - d
            if re_ and calls[best].finish_reason != "length":
                try:
                    rerender = pk.index(re_[-1], len(pe) + d) - len(pe) - d + 1
                except ValueError:
                    pass
            events.append(Drift(call=best, later=k, at=d, tokens=max(len(re_) - d, rerender)))
    return events


@dataclass(frozen=True)
class Fresh:
    """The calls at most K versions behind the version being trained, token by token."""
    calls: list[Call]        # those with a token left to train; their older tokens context only
    stale_calls: int         # left out: no token left to train
    tokens: int              # sampled tokens of every call given
    trained_tokens: int      # of them: trained
    stale_tokens: int        # context only: sampled more than K versions behind
    unknown_tokens: int      # context only: sampled by a version not known

    @property
    def stale_fraction(self) -> float:
        return self.stale_tokens / self.tokens if self.tokens else 0.0


def at_most_stale(calls: Sequence[Call], version: int, max_staleness: int) -> Fresh:
    """Staleness is per token (a sync in flight splits a call between two versions): a token
    sampled by a version older than version - max_staleness is masked (Call.min_version), a
    call with no token left to train is left out."""
    oldest = version - max_staleness
    kept: list[Call] = []
    tokens = trained = stale = unknown = 0
    for c in calls:
        before = len(c.trained())                  # masked already: an unknown version
        cut = replace(c, min_version=oldest if c.min_version is None else max(oldest, c.min_version))
        now = len(cut.trained())
        tokens += len(c.tokens)
        trained += now
        stale += before - now
        unknown += len(c.tokens) - before
        if now:
            kept.append(cut)
    return Fresh(kept, len(calls) - len(kept), tokens, trained, stale, unknown)
