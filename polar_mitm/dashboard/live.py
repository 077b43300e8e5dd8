"""Change detection for the dashboard: files only, never the database.

One background task stats a few files about once a second and bumps a generation number
when their fingerprint changes:

- each database's journal log (`<db>.journal/`: the rollout server's segment files, names and
  sizes; every state change of a task or session is a line appended there first),
- its call log (`<db>.log/`: the proxy's segment files, where every call lands before the
  loader puts it into DuckDB),
- the database file itself (size, mtime; and its .wal), but only while no proxy's loader
  holds it: every read of ours makes a running loader hand the file over and DuckDB
  checkpoints when the loader lets go, which would count as a change and read again, forever.
  While a loader runs, what it writes comes through the call log anyway,
- the loop's run directory: loop.json, loop.png, the per-iteration folders and the newest
  one's files, the checkpoints' names.

The call log changes with every call a rollout makes, so a change there alone moves the
generation at most once per calls_every_s (15 s): each move makes open pages read again, and
each read makes a running loader hand the database over, costs that a rollout beside the
dashboard paid (-12.5% calls/s with two live pages open when the call log counted at once,
scripts/bench_dashboard.py). A session's state changes (the journal), a loop's iterations
(the run directory) and the database's own changes count at once.

A stat costs the proxy and the rollout server nothing: no lock, no read request, no hand-over
of the database. Pages read the database only when the generation moved (app.py caches each
answer per generation), so an idle dashboard never touches it.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Iterable

from ..store import calllog, journal_log
from ..store.db import loader_running

POLL_S = 1.0
CALLS_EVERY_S = 15.0    # a change of the call log alone moves the generation at most this often


def _listing(directory: Path) -> tuple:
    """(name, size, mtime_ns) of each entry, sorted (nothing when it is not there)."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return ()
    out = []
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue          # gone meanwhile (a folded segment)
        out.append((e.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


def _stat(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    return (st.st_size, st.st_mtime_ns)


def db_fingerprint(db: str | os.PathLike) -> tuple:
    """(what moves the generation at once, the call log's listing)."""
    db = Path(db)
    own = None if loader_running(db) else (_stat(db), _stat(Path(f"{db}.wal")))
    return (str(db), _listing(journal_log.log_dir(db)), own), _listing(calllog.log_dir(db))


def run_fingerprint(run_dir: str | os.PathLike | None) -> tuple:
    if run_dir is None:
        return ()
    run = Path(run_dir)
    iterations = _listing(run / "iterations")
    newest = _listing(run / "iterations" / iterations[-1][0]) if iterations else ()
    return (_stat(run / "loop.json"), _stat(run / "loop.png"), iterations, newest,
            tuple(n for n, _, _ in _listing(run / "checkpoints")))


def fingerprint(dbs: Iterable[str | os.PathLike], run_dir: str | os.PathLike | None) -> tuple[tuple, tuple]:
    """(the state: journals, databases, run directory; the call logs)."""
    parts = [db_fingerprint(db) for db in dbs]
    return (tuple(p[0] for p in parts), run_fingerprint(run_dir)), tuple(p[1] for p in parts)


class Live:
    """The generation: +1 whenever the files' fingerprint changes. poll() is the one check
    (run() calls it every POLL_S in a background task); wait() is what an event stream
    awaits."""

    def __init__(self, dbs: list[str], run_dir: str | None, poll_s: float = POLL_S,
                 calls_every_s: float = CALLS_EVERY_S):
        self.dbs, self.run_dir, self.poll_s, self.calls_every_s = list(dbs), run_dir, poll_s, calls_every_s
        self.generation = 1
        self._state, self._calls = fingerprint(self.dbs, self.run_dir)
        self._moved = time.monotonic()
        self._changed: asyncio.Event | None = None
        self.closed = False

    def poll(self) -> bool:
        """Look at the files once; True (and a new generation) when something changed."""
        state, calls = fingerprint(self.dbs, self.run_dir)
        if state == self._state and (calls == self._calls
                                     or time.monotonic() - self._moved < self.calls_every_s):
            return False     # a call log change alone waits (kept unseen until it counts)
        self._state, self._calls, self._moved = state, calls, time.monotonic()
        self.generation += 1
        return True

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        old, self._changed = self._event(), asyncio.Event()
        old.set()

    async def run(self) -> None:
        """Poll until closed (the app's lifespan runs it as a task)."""
        while not self.closed:
            await asyncio.sleep(self.poll_s)
            if await asyncio.to_thread(self.poll):
                self._notify()

    async def wait(self, seen: int, timeout: float) -> int | None:
        """The generation once it is past `seen` (None: timeout, or closed)."""
        if self.generation != seen:
            return self.generation
        try:
            await asyncio.wait_for(self._event().wait(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return None
        return None if self.closed else self.generation

    def close(self) -> None:
        """Stop polling and end every event stream."""
        self.closed = True
        if self._changed is not None:
            self._changed.set()
