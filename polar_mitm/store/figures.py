"""The figures of a rollout run that come from the calls the proxy recorded: calls and tokens
per session, and how busy the model backend was (`polar-mitm rollout`'s progress line and
summary read them here; the rest comes from the rollout server's own state).

Backend busy share: each call was at the backend from `started_at + queue_ms` for `backend_ms`
(the proxy's clock; the few milliseconds of translation before the queue are not recorded).
The union of those intervals, clipped to a window, over the window's length: the share of
wall time during which at least one call of the run was being generated. Calls in flight
are recorded when they end, so a window that ends now counts them once they are done.
"""

from __future__ import annotations

import os
from typing import Iterable, TypedDict

from .db import reading


class SessionCalls(TypedDict):
    calls: int
    failed_calls: int
    prompt_tokens: int
    completion_tokens: int


class BackendBusy(TypedDict):
    busy_s: float        # the union of the intervals with at least one call at the backend
    window_s: float      # until - since
    share: float | None  # busy_s / window_s
    calls: int           # calls with backend time in the window
    call_s: float        # their backend seconds summed (call_s / busy_s: calls at once while busy)


_SESSIONS = "session_id IN (SELECT unnest($ids::VARCHAR[]))"

_SESSION_CALLS = f"""
    SELECT session_id, count(*), count(error), coalesce(sum(prompt_tokens), 0),
           coalesce(sum(completion_tokens), 0)
    FROM call_records WHERE {_SESSIONS} GROUP BY session_id"""

# Gaps and islands: sorted by start, a call opens a new island when it starts after every
# earlier call has ended; each island's length is max(end) - min(start).
_BUSY = f"""
    WITH raw AS (
        SELECT epoch_us(started_at) / 1e6 + coalesce(queue_ms, 0) / 1e3 AS s,
               epoch_us(started_at) / 1e6 + (coalesce(queue_ms, 0) + backend_ms) / 1e3 AS e
        FROM call_records
        WHERE backend_ms > 0 AND started_at IS NOT NULL AND {_SESSIONS}
    ), iv AS (
        SELECT greatest(s, $since) AS s, least(e, $until) AS e FROM raw WHERE e > $since AND s < $until
    ), marked AS (
        SELECT s, e, CASE WHEN coalesce(s > max(e) OVER (ORDER BY s, e ROWS BETWEEN UNBOUNDED PRECEDING
                                                           AND 1 PRECEDING), true) THEN 1 ELSE 0 END AS opens
        FROM iv
    ), islands AS (
        SELECT s, e, sum(opens) OVER (ORDER BY s, e ROWS UNBOUNDED PRECEDING) AS island FROM marked
    )
    SELECT (SELECT coalesce(sum(e - s), 0) FROM (SELECT min(s) AS s, max(e) AS e FROM islands GROUP BY island)),
           (SELECT count(*) FROM iv), (SELECT coalesce(sum(e - s), 0) FROM iv)"""


def session_calls(path: str | os.PathLike, session_ids: Iterable[str],
                  timeout: float = 60.0) -> dict[str, SessionCalls]:
    """Calls and tokens of each session (those with no call are left out)."""
    ids = list(session_ids)
    if not ids:
        return {}
    with reading(path, timeout) as con:
        return _session_calls(con, ids)


def backend_busy(path: str | os.PathLike, session_ids: Iterable[str], since: float, until: float,
                 timeout: float = 60.0) -> BackendBusy:
    """How busy the backend was with these sessions' calls between since and until (unix s)."""
    ids = list(session_ids)
    with reading(path, timeout) as con:
        return _busy(con, ids, since, until)


def run_figures(path: str | os.PathLike, session_ids: Iterable[str], since: float, until: float,
                timeout: float = 60.0) -> tuple[dict[str, SessionCalls], BackendBusy]:
    """Both, on one read connection."""
    ids = list(session_ids)
    with reading(path, timeout) as con:
        return (_session_calls(con, ids) if ids else {}), _busy(con, ids, since, until)


def _session_calls(con, ids: list[str]) -> dict[str, SessionCalls]:
    return {r[0]: SessionCalls(calls=r[1], failed_calls=r[2], prompt_tokens=int(r[3]), completion_tokens=int(r[4]))
            for r in con.execute(_SESSION_CALLS, {"ids": ids}).fetchall()}


def _busy(con, ids: list[str], since: float, until: float) -> BackendBusy:
    window = max(0.0, until - since)
    if not ids or window <= 0:
        return BackendBusy(busy_s=0.0, window_s=window, share=None if window <= 0 else 0.0, calls=0, call_s=0.0)
    busy, n, call_s = con.execute(_BUSY, {"ids": ids, "since": float(since), "until": float(until)}).fetchone()
    return BackendBusy(busy_s=float(busy), window_s=window, share=float(busy) / window, calls=int(n),
                       call_s=float(call_s))
