"""The loader: moves the call log into DuckDB in bulk, every acknowledged call exactly once.

Exactly once by construction, not by a happy path:
- Each load is one transaction that compares and sets the log position stored in the
  database (load_batch.py).
- After any error (DuckDB's or ours, before, during or after COMMIT: a COMMIT can be durable
  and still raise, when its autocheckpoint fails or the database is invalidated after it)
  the connection is dropped. The next load reopens the file and takes the committed
  position from the database itself.

Sized by bytes: a whole row group (ROW_GROUP_ROWS lines; DuckDB writes it straight to the
file and never rewrites it) loads when its lines fit `group_bytes`, and DuckDB gets memory
for all of them (it pins the whole row group to write it at COMMIT: measured, splitting it
into several INSERTs does not help). Anything less goes to the tail table in one load. A
failed load is retried with twice the memory, at most `max_boost` doublings.

Which log a loader may load, and who loads it, is the call log's ownership protocol
(calllog_owner.py).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import duckdb

from .ack_times import AckTimes
from .calllog import Position, drop_loaded, log_dir, log_end, read_lines
from .calllog_owner import is_log_of, writer_lock
from .connection import StoreBusy, connect
from .load_batch import LOAD_FILE, ROW_GROUP_ROWS, LoadBatch, read_batch, stored_position
from .log_rows import CSV_BUFFER, MAIN, TAIL, csv_buffer
from .shipping_log import gc_floor

log = logging.getLogger("polar")

LOADER_SETTINGS = ("SET threads = 1", "SET checkpoint_threshold = '16MB'")


def _default_group_bytes() -> int:
    """Lines of one whole-row-group load: 1 GiB, or an eighth of the machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return max(128 << 20, min(1 << 30, total // 8))


@dataclass
class LoaderConfig:
    # DuckDB's memory besides the lines: its connection, the CSV reader (see log_rows.read_log_sql)
    # and a load's bookkeeping (48 MB was measured to be enough for 8 MB of lines, 40 not).
    base_memory: int = 60 << 20
    csv_buffer: int = CSV_BUFFER
    idle_memory: int = 8 << 20         # between loads: makes DuckDB hand back what it kept
    read_bytes: int = 8 << 20          # of log lines read at a time, and per tail load
    group_bytes: int = field(default_factory=_default_group_bytes)
    # DuckDB's memory per byte of lines it holds (a row group being written, or the tail's
    # part-filled one): 2048 lines of 147 KB ran out of 1.17x their bytes (with the rest).
    line_memory: float = 1.5
    max_boost: int = 3                 # doublings of a failed load's memory, at most

@dataclass
class LoaderHealth:
    state: str                  # ok | retrying | failing
    failures: int               # consecutive failed loads
    last_error: str | None
    failing_since: float | None  # wall time of the first of them


class Loader:
    """One connection to the database, and the log position committed in it. Not
    thread-safe: one thread loads (the proxy's loader thread, or a reader's catch-up)."""

    def __init__(self, db_path: str | os.PathLike, config: LoaderConfig | None = None):
        self.db_path = str(db_path)
        self.config = config or LoaderConfig()
        self.dir = log_dir(db_path)
        self.con: duckdb.DuckDBPyConnection | None = None
        self.position = Position()   # committed in the database (read at each open)
        self.lines_loaded = 0        # lines stored since this loader started (pending counts)
        self.loads = 0
        self.errors = 0
        self.failures = 0            # consecutive
        self.last_error: str | None = None
        self.failing_since: float | None = None
        self._boost = 0
        self._memory = 0
        self._tail_rows = 0          # rows of the tail's part-filled last row group
        self._tail_bytes = 0         # and the bytes of their lines (estimated at open)
        self._known_sessions: set[str | None] = set()
        self._synced = False         # self.position was read from this database once

    # ---- the connection ------------------------------------------------------------------

    def open(self, timeout: float) -> None:
        """Open the file unless open, and take the committed position from it. Lines that a
        load thought failed but that were committed count as loaded now."""
        if self.con is not None:
            return
        try:
            con = connect(self.db_path, timeout=timeout, row_group_size=ROW_GROUP_ROWS)
        except StoreBusy:
            raise   # another process reads or writes the file: not a failure
        except Exception as e:
            self.failed(e)   # e.g. a file DuckDB cannot open now
            raise
        try:
            for setting in LOADER_SETTINGS:
                con.execute(setting)
            committed = stored_position(con)
            (tail,) = con.execute(f"SELECT count(*) FROM {TAIL}").fetchone() or (0,)
        except BaseException as e:
            con.close()
            self.failed(e)
            raise
        if self._synced and committed != self.position:
            moved = self._count_lines(self.position, committed)
            log.warning("polar: the database's call log position is %s, not %s: %+d lines were "
                        "committed by a load that raised", committed.encode(), self.position.encode(), moved)
            self.lines_loaded += moved
        self.con, self.position, self._synced = con, committed, True
        self._tail_rows, self._tail_bytes, self._memory = tail % ROW_GROUP_ROWS, -1, 0

    def close(self) -> None:
        """Drop the connection (DuckDB checkpoints on close): another process may open the
        file, and change the sessions table meanwhile, so the next load looks again."""
        self._known_sessions.clear()
        con, self.con = self.con, None
        if con is not None:
            try:
                con.close()
            except Exception:
                log.exception("polar: closing the database failed")

    def _count_lines(self, a: Position, b: Position) -> int:
        """Lines between two positions (negative when b is before a)."""
        lo, hi, sign = (a, b, 1) if a <= b else (b, a, -1)
        n, pos = 0, lo
        while pos < hi:
            lines, nxt = read_lines(self.dir, pos, max_bytes=self.config.read_bytes, end=hi)
            if nxt == pos:
                break
            n, pos = n + len(lines), nxt
        return sign * n

    # ---- loads -----------------------------------------------------------------------------

    def load(self, target: Position, *, group: bool, ack_ms: AckTimes | None = None) -> int:
        """One transaction from the committed position towards `target`: a whole row group
        (group=True; if its lines are more than group_bytes, a tail load of them instead),
        or the rest (fewer lines, group_bytes at most). Returns the lines read. Raises on failure, with the
        connection dropped; ack_ms (total_ms of calls this process acknowledged, by call_id)
        gets back what the load took of it."""
        cfg = self.config
        start = self.position
        scratch = self.dir / LOAD_FILE
        batch = None
        try:
            # The rest (fewer lines than a row group) goes in one load too: the tail is
            # checkpointed after each, rewriting its part-filled row group.
            batch, end = read_batch(self.dir, scratch, start, target, ack_ms, chunk=cfg.read_bytes,
                                    max_lines=ROW_GROUP_ROWS if group else ROW_GROUP_ROWS - 1,
                                    max_bytes=cfg.group_bytes)
            if group and not batch.whole and batch.bytes >= cfg.group_bytes:
                # A row group of lines past group_bytes: the tail takes them a quarter of
                # that at a time (far fewer checkpoints of its growing row group than
                # read_bytes would make), with memory for that row group.
                _give_back(ack_ms, batch.acks)
                batch, end = read_batch(self.dir, scratch, start, target, ack_ms, chunk=cfg.read_bytes,
                                        max_lines=None, max_bytes=max(cfg.read_bytes, cfg.group_bytes // 4))
            if end == start:
                return 0   # nothing readable before target (a torn last line at most)
            table = MAIN if batch.whole else TAIL
            self._set_memory(batch, table)
            batch.insert(self._connection(), start, end, self._known_sessions, table)
            self.position = end   # committed, whatever fails after this
            self.lines_loaded += batch.lines
            self.loads += 1       # counted with its lines: a reader never sees one without the other
            if table == TAIL:
                # DuckDB keeps rows not checkpointed in memory: the tail goes to the file now.
                self._tail_rows += batch.stored
                self._tail_bytes += batch.bytes
                if self._tail_rows >= ROW_GROUP_ROWS:
                    self._tail_rows, self._tail_bytes = self._tail_rows % ROW_GROUP_ROWS, -1
                self._connection().execute("CHECKPOINT")
        except BaseException as e:
            _give_back(ack_ms, batch.acks if batch is not None else None)
            self.failed(e)
            raise
        self.succeeded()
        self._shrink()
        return batch.lines

    def succeeded(self) -> None:
        """Everything asked for is in the database: no failure is pending any more."""
        self.failures, self.failing_since, self._boost = 0, None, 0

    def drop_loaded(self, keep_from: int) -> None:
        # With shipping on, a segment also waits until the driver has it (store/shipping.py).
        drop_loaded(self.dir, gc_floor(self.dir, self.position), keep_from=keep_from)

    def failed(self, e: BaseException) -> None:
        self.errors += 1
        self.failures += 1
        self.failing_since = self.failing_since or time.time()
        self.last_error = f"{type(e).__name__}: {e}"[:500]
        # Whatever the error, the next try gets more memory (DuckDB reports running out of
        # it as OutOfMemory, IO or Transaction errors), and a fresh connection that takes the
        # committed position from the database.
        self._boost = min(self._boost + 1, self.config.max_boost)
        self.close()

    def _connection(self) -> duckdb.DuckDBPyConnection:
        if self.con is None:
            raise RuntimeError("the loader has no connection (open() first)")
        return self.con

    def _set_memory(self, batch: "LoadBatch", table: str) -> None:
        cfg = self.config
        held = batch.bytes
        if table == TAIL:   # DuckDB appends to the tail's part-filled row group in memory
            tail_bytes = self._tail_bytes
            if tail_bytes < 0:   # unknown since open: as large as this load's lines
                tail_bytes = self._tail_rows * batch.bytes // max(batch.stored, 1)
            held += tail_bytes
        memory = (cfg.base_memory + csv_buffer(batch.longest, cfg.csv_buffer) + 5 * batch.longest
                  + int(cfg.line_memory * held)) << self._boost
        if memory != self._memory:
            self._connection().execute(f"SET memory_limit = '{memory}B'")
            self._memory = memory

    def _shrink(self) -> None:
        """Between loads DuckDB would keep what a load used, cached up to its memory_limit
        (measured: ~75 MB after a whole row group); a small limit makes it let go at once."""
        try:
            self._connection().execute(f"SET memory_limit = '{self.config.idle_memory}B'")
            self._memory = self.config.idle_memory
        except duckdb.Error:
            pass   # it could not free that much: the next load sets its own limit anyway

    def health(self) -> LoaderHealth:
        state = "ok" if not self.failures else "retrying" if self.failures < 3 else "failing"
        return LoaderHealth(state, self.failures, self.last_error, self.failing_since)


def _give_back(ack_ms: AckTimes | None, taken: dict[str, float] | None) -> None:
    if ack_ms is not None:
        ack_ms.give_back(taken)


def catch_up(db_path: str | os.PathLike, timeout: float = 30.0, config: LoaderConfig | None = None) -> int:
    """Load what a proxy acknowledged but did not load (it was killed, or its file was
    copied here), as its own loader would have. Only when no proxy is loading this log, and
    only a log of this database; returns the lines loaded."""
    directory = log_dir(db_path)
    if not directory.exists():
        return 0
    with writer_lock(directory) as held:
        if held is None:
            return 0   # a live proxy loads it
        loader = Loader(db_path, config)
        loaded = 0
        try:
            loader.open(timeout)
            if not is_log_of(loader.con, directory):
                log.warning("polar: not loading the call log %s: it belongs to another database", directory)
                return 0
            target = log_end(directory)
            while loader.position < target:
                n = loader.load(target, group=True)
                if n == 0:
                    break
                loaded += n
                loader.drop_loaded(keep_from=target.seg)
            return loaded
        finally:
            loader.close()
