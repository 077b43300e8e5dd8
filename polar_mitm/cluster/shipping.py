"""Every node's recorded calls into the driver's store, exactly once, over any transport.

A node exposes its call log as a Source (NodeShipper: log_id, read, ack); the driver's
Collector pulls from each source on a thread of its own: the position its database holds for
that log, the lines after it, one compare-and-set load (store/shipping.py), then the ack that
lets the node drop what the driver has. Nothing here knows the transport: a Ray actor's
methods behind ray.get, or the NodeShipper itself in a test.

Exactly once needs no agreement between the two sides: the driver's database alone says how
far it has each log, in the transaction that stores the lines. A source that fails is marked
down and retried with backoff; a source that hangs blocks only its own thread, so give a
remote transport its own timeout. A node reports a session final only after wait_shipped, so
no scored session's calls exist on a node alone."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

from ..store import init_db
from ..store.calllog import Position, log_dir, log_end
from ..store.shipping import (Chunk, Loaded, PositionMoved, enable_shipping, load_chunk, log_identity,
                              mark_shipped, read_chunk, shipped_mark, shipped_position, unshipped)

log = logging.getLogger("polar.cluster")


class Source(Protocol):
    """A node's call log as the collector sees it (the node may be gone: any call may raise)."""

    def log_id(self) -> str: ...

    def read(self, start: Position, max_bytes: int) -> Chunk: ...

    def ack(self, end: Position, log_id: str | None = None) -> None: ...


@dataclass(frozen=True)
class CallableSource:
    """A Source made of three callables, e.g. ray.get around a node actor's methods."""
    log_id: Callable[[], str]
    read: Callable[[Position, int], Chunk]
    ack: Callable[[Position, str | None], None]


class NodeShipper:
    """A node's call log (`<db>.log/`) as a Source, with shipping turned on: from now on the
    node's loader drops no segment the driver has not acknowledged. Thread-safe.
    durable: the node's writer's durable end (CallWriter.durable_end) where it runs in this
    process: reads then stop at acknowledged calls."""

    def __init__(self, db: str | Path, durable: Callable[[], Position] | None = None):
        self.dir = log_dir(db)
        self._durable = durable
        enable_shipping(self.dir)
        self._acked = threading.Condition()

    def log_id(self) -> str:
        return log_identity(self.dir)

    def read(self, start: Position, max_bytes: int = 8 << 20) -> Chunk:
        end = self._durable() if self._durable is not None else None
        return read_chunk(self.dir, Position(*start), max_bytes, end)

    def ack(self, end: Position, log_id: str | None = None) -> None:
        """The driver has committed everything before `end` of the log `log_id` (None: this
        log's current identity)."""
        mark_shipped(self.dir, Position(*end), log_id)
        with self._acked:
            self._acked.notify_all()

    def shipped(self) -> Position | None:
        return shipped_mark(self.dir)

    def wait_shipped(self, timeout: float) -> bool:
        """Block until the driver has acknowledged every line that was in the log when called
        (True), or `timeout` passed (False). Needs ack() to come in on another thread."""
        target = self._durable() if self._durable is not None else log_end(self.dir)
        deadline = time.monotonic() + timeout
        with self._acked:
            while unshipped(self.dir, target):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # woken by ack(); the mark file is looked at again now and then all the same,
                # for an ack that reached another NodeShipper of this log
                self._acked.wait(min(left, 1.0))
        return True


@dataclass(frozen=True)
class SourceStats:
    """One source's shipping so far (a snapshot): what moved, and the time each step took."""
    name: str
    log_id: str | None
    position: Position | None   # how far the driver's database holds the log (None: not read yet)
    acked: Position | None      # the last end the node acknowledged receiving
    chunks: int                 # loads that stored lines
    lines: int
    bytes: int
    read_s: float               # in source.read (transport included)
    load_s: float               # in load_chunk
    ack_s: float                # in source.ack
    down: bool                  # the source raised last time (retried with backoff)
    failures: int               # consecutive failed rounds
    last_error: str | None

    @property
    def seconds(self) -> float:
        return self.read_s + self.load_s + self.ack_s


class _SourceFailed(Exception):
    """The source (the node or the way to it) failed, not the driver's database."""


class Collector:
    """Pulls every added source's calls into the database `db` (made a polar database at
    start), each source on a thread of its own, one load at a time. Rounds run every
    `interval` seconds per source, at once while a source has more; max_bytes per read.
    Use as a context manager, or start() and close()."""

    def __init__(self, db: str | Path, interval: float = 0.5, max_bytes: int = 8 << 20, *,
                 timeout: float = 30.0, retry_max: float = 5.0):
        self.db = str(db)
        self.interval = interval
        self.max_bytes = max_bytes
        self.timeout = timeout          # for the database file (StoreBusy past it)
        self.retry_max = retry_max      # the longest backoff after failures
        self._state = threading.Condition()   # guards the pumps' stats, the barrier
        self._load = threading.Lock()          # one load into the file at a time
        self._pumps: dict[str, _Pump] = {}
        self._barrier = 0
        self._running = False

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> "Collector":
        init_db(self.db, timeout=self.timeout)
        with self._state:
            self._running = True
            pumps = list(self._pumps.values())
        for pump in pumps:
            pump.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        with self._state:
            self._running = False
            pumps = list(self._pumps.values())
        for pump in pumps:
            pump.stop()
        deadline = time.monotonic() + timeout
        for pump in pumps:
            if pump.is_alive():
                pump.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "Collector":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- sources ---------------------------------------------------------------------------

    def add(self, name: str, source: Source) -> None:
        """Start pulling from `source` (one of this name already: replaced, e.g. by a
        restarted actor's handle)."""
        self.remove(name, wait=0.0)
        pump = _Pump(self, name, source)
        with self._state:
            self._pumps[name] = pump
            running = self._running
            self._state.notify_all()
        if running:
            pump.start()

    def remove(self, name: str, wait: float = 5.0) -> None:
        """Stop pulling from it (a load under way finishes; nothing is lost either way: the
        database keeps the log's position for whoever pulls it later)."""
        with self._state:
            pump = self._pumps.pop(name, None)
            self._state.notify_all()
        if pump is not None:
            pump.stop()
            if pump.is_alive() and wait > 0:
                pump.join(wait)

    def names(self) -> list[str]:
        with self._state:
            return list(self._pumps)

    def down(self) -> list[str]:
        """The sources that failed their last round."""
        with self._state:
            return [name for name, p in self._pumps.items() if p.stats.down]

    def stats(self) -> dict[str, SourceStats]:
        with self._state:
            return {name: p.stats for name, p in self._pumps.items()}

    # ---- the barrier -----------------------------------------------------------------------

    def catch_up(self, timeout: float) -> bool:
        """Block until every source has its log in the database up to where that log ended
        when this was called, or has failed a try begun since (it is down: down() names it,
        and its node reported no session final whose calls the driver lacks, see
        wait_shipped); True then, False when `timeout` passed first. Every source is tried at
        once, not after its interval or backoff."""
        deadline = time.monotonic() + timeout
        with self._state:
            self._barrier += 1
            barrier = self._barrier
            pumps = list(self._pumps.values())
        for pump in pumps:
            pump.wake.set()   # a round now, not after its interval
        with self._state:
            while True:
                waiting = [p for p in self._pumps.values() if p.caught < barrier and p.failed < barrier]
                if not waiting:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._state.wait(left)


class _Pump(threading.Thread):
    """One source's rounds: read from the driver's position, load, ack; again at once while
    the source has more, else after the interval (after a failure: backoff)."""

    def __init__(self, collector: Collector, name: str, source: Source):
        super().__init__(name=f"polar-ship-{name}", daemon=True)
        self.c = collector
        self.source = source
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.caught = 0                          # the last barrier this source has met
        self.failed = 0                          # the last barrier a try of it failed after
        self.stats = SourceStats(name, None, None, None, 0, 0, 0, 0.0, 0.0, 0.0, False, 0, None)
        self._position: Position | None = None   # the database's, as this pump last knew it
        self._moved = 0                          # PositionMoved in a row

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()

    def run(self) -> None:
        backoff = 0.0
        while not self.stopped.is_set():
            with self.c._state:
                barrier = self.c._barrier   # before the read: it sees all that was there then
            try:
                more = self._round()
            except Exception as e:
                down = isinstance(e, _SourceFailed)
                cause = e.__cause__ if down and e.__cause__ is not None else e
                self._position = None   # take it from the database again, as the loader does
                backoff = min(self.c.retry_max, max(0.2, 2 * backoff))
                with self.c._state:
                    if down:   # the source failed: catch_up does not wait for it
                        self.failed = max(self.failed, barrier)
                    self.stats = replace(self.stats, down=down, failures=self.stats.failures + 1,
                                         last_error=f"{type(cause).__name__}: {cause}"[:500])
                    self.c._state.notify_all()
                if self.stats.failures in (1, 10) or self.stats.failures % 100 == 0:
                    log.warning("polar: shipping the calls of %s failed (%d in a row; %s): %s",
                                self.stats.name, self.stats.failures, "source down" if down else "retrying",
                                self.stats.last_error)
                self._wait(backoff)
                continue
            backoff = 0.0
            with self.c._state:
                if not more:
                    self.caught = max(self.caught, barrier)
                self.stats = replace(self.stats, down=False, failures=0)
                self.c._state.notify_all()
            if not more:
                self._wait(self.c.interval)

    def _wait(self, seconds: float) -> None:
        self.wake.wait(seconds)
        self.wake.clear()

    def _update(self, **changes) -> None:
        with self.c._state:
            self.stats = replace(self.stats, **changes)
            self.c._state.notify_all()

    def _call(self, what: Callable, *args):
        try:
            return what(*args)
        except Exception as e:
            raise _SourceFailed(f"{self.stats.name}: {e}") from e

    def _round(self) -> bool:
        """One read, load and ack; True when the source has more to read right away."""
        log_id = self.stats.log_id
        if log_id is None:
            log_id = self._call(self.source.log_id)
            self._update(log_id=log_id)
        if self._position is None:
            self._position = shipped_position(self.c.db, log_id, self.c.timeout)
            self._update(position=self._position)
        start = self._position
        t0 = time.perf_counter()
        chunk: Chunk = self._call(self.source.read, start, self.c.max_bytes)
        t1 = time.perf_counter()
        if chunk.log_id != log_id:
            # The node's log has a new identity (its database was made anew): its own position.
            log.warning("polar: the call log of %s is %s now, not %s", self.stats.name, chunk.log_id, log_id)
            self._position = None
            self._update(log_id=chunk.log_id, position=None, acked=None)
            return True
        if Position(*chunk.start) != start:
            raise _SourceFailed(f"{self.stats.name}: asked for {start.encode()}, "
                                f"it sent from {Position(*chunk.start).encode()}")
        if self.stopped.is_set():
            return False
        try:
            with self.c._load:
                loaded: Loaded = load_chunk(self.c.db, chunk, self.c.timeout)
        except PositionMoved as e:
            # Someone else loaded this log meanwhile (another collector, or a pump of the same
            # log under another name): go on from where the database is.
            self._moved += 1
            if self._moved > 3:
                raise
            self._position = e.stored
            return True
        self._moved = 0
        t2 = time.perf_counter()
        end = Position(*chunk.end)
        self._position = end
        s = self.stats
        self._update(position=end, read_s=s.read_s + t1 - t0, load_s=s.load_s + t2 - t1,
                     chunks=s.chunks + (1 if loaded.lines else 0), lines=s.lines + loaded.lines,
                     bytes=s.bytes + loaded.bytes)
        if self.stats.acked != end:
            self._call(self.source.ack, end, log_id)
            s = self.stats
            self._update(acked=end, ack_s=s.ack_s + time.perf_counter() - t2)
        return chunk.more
