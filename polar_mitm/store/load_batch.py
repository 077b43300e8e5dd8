"""One load's lines and its transaction: exactly once by construction.

A load is named by the log positions it goes from and to. Its transaction first checks that
the position stored in the database is where the load starts (compare and set), then
inserts the rows and stores where it ends, and commits. A load that re-reads lines that are
already stored aborts (PositionMoved) instead of storing them twice."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .ack_times import AckTimes
from .calllog import Position, read_lines
from .lines import LINE_MARK, call_id, session_id, upgrade
from .log_rows import DATA_ERRORS, SELECT_ROWS, acked_sql, read_log_sql, storable_line, write_scratch
from .meta import meta_value, set_meta_value
from .schema import RECORD_COLUMNS

log = logging.getLogger("polar")

POSITION_KEY = "log_position"   # in meta: how far the call log is in the database
LOAD_FILE = ".load.jsonl"       # in <db>.log/: the lines of one load, for DuckDB to read
ROW_GROUP_ROWS = 2048           # the smallest row group DuckDB allows


class PositionMoved(RuntimeError):
    """The database's stored log position is not where this load starts (both carried)."""

    def __init__(self, message: str, stored: Position | None = None, start: Position | None = None):
        super().__init__(message)
        self.stored = stored
        self.start = start


def stored_position(con, key: str = POSITION_KEY) -> Position:
    """How far the log is in the database (committed with the rows it covers). key: the
    meta key of a log of another machine (store/shipping.py), else this database's own."""
    return Position.decode(meta_value(con, key))


class LoadBatch:
    """The log lines of one load, written to the scratch file DuckDB reads (see
    log_rows.read_log_sql) as they come (read_bytes of them at a time), with what the load
    needs to know about them. Loading takes no Python work per call beyond this."""

    def __init__(self, path: Path):
        self.path = path
        self._f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
        self.lines = 0          # log lines read (an unreadable old one is counted, not stored)
        self.stored = 0         # lines in the file
        self.bytes = 0
        self.longest = 0
        self.sessions: set[str | None] = set()
        self.acks: dict[str, float] = {}

    def add(self, lines: list[bytes], ack_ms: AckTimes | None = None) -> None:
        """ack_ms: the total_ms of calls this process acknowledged (taken once used)."""
        self.lines += len(lines)
        current = [line if line.startswith(LINE_MARK) else upgrade(line) for line in lines]
        lines = [line if line.endswith(b"\n") else line + b"\n" for line in current if line]
        for line in lines:
            if ack_ms:
                cid = call_id(line)
                ms = ack_ms.take(cid)
                if cid is not None and ms is not None:
                    self.acks[cid] = ms
            self.sessions.add(session_id(line))
            self.longest = max(self.longest, len(line))
            self.bytes += len(line)
        self.stored += len(lines)
        self._f.writelines(lines)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    @property
    def whole(self) -> bool:
        """A whole row group: it goes to call_records_main, anything less to the tail."""
        return self.stored == ROW_GROUP_ROWS

    def insert(self, con, start: Position, end: Position, known: set[str | None] | None, table: str,
               position_key: str = POSITION_KEY) -> None:
        """One transaction: these calls and the log position after them, if the database's
        position is `start`. known: the session ids already stored (added to here). A line
        DuckDB refuses is stored as a failed call that says why, rather than hold up every
        later one. position_key: the meta key of the log's position."""
        new_sessions = known is None or not self.sessions <= known
        try:
            _insert(con, self, start, end, new_sessions, table, position_key)
        except DATA_ERRORS as e:
            log.error("polar: DuckDB refused a load of %d log lines (%s); loading them one by one",
                      self.stored, e)
            lines = [line for line in self.path.read_bytes().split(b"\n") if line]
            one = self.path.with_name(self.path.name + ".one")
            lines = [storable_line(con, line, one) for line in lines]
            write_scratch(self.path, lines)
            self.longest = max(map(len, lines), default=0)
            _insert(con, self, start, end, True, table, position_key)
        if known is not None:
            if len(known) > 100_000:
                known.clear()
            known |= self.sessions


def read_batch(directory: Path, scratch: Path, start: Position, target: Position,
               ack_ms: AckTimes | None, *, chunk: int, max_lines: int | None,
               max_bytes: int) -> tuple[LoadBatch, Position]:
    """The log lines from `start` towards `target` (at most max_lines, about max_bytes) in
    the scratch file, read `chunk` bytes at a time, and the position after them."""
    batch = LoadBatch(scratch)
    pos = start
    try:
        while pos < target and batch.lines != max_lines and batch.bytes < max_bytes:
            want = None if max_lines is None else max_lines - batch.lines
            lines, nxt = read_lines(directory, pos, max_bytes=min(chunk, max_bytes - batch.bytes),
                                    end=target, max_lines=want)
            if nxt == pos:
                break
            batch.add(lines, ack_ms)
            pos = nxt
    finally:
        batch.close()
    return batch, pos


def _insert(con, batch: LoadBatch, start: Position, end: Position, new_sessions: bool, table: str,
            position_key: str) -> None:
    con.execute("BEGIN")
    try:
        stored = stored_position(con, position_key)
        if stored != start:
            raise PositionMoved(f"the database holds the call log up to {stored.encode()}, "
                                f"this load starts at {start.encode()}", stored, start)
        if batch.stored:
            source = read_log_sql(con, batch.path, batch.longest)
            if new_sessions:   # a scan of its own: skipped when every session is known
                # A session stored already stays as it is; one that a reward created first
                # (no calls yet) gets the gateway's source, client and user agent.
                con.execute("INSERT INTO sessions (session_id, task_id, source, client, user_agent) "
                            "SELECT s.session_id, any_value(s.task_id), any_value(s.source), "
                            f"any_value(s.client), any_value(s.user_agent) FROM {source} "
                            "GROUP BY s.session_id ON CONFLICT (session_id) DO UPDATE SET "
                            "source = excluded.source, client = excluded.client, user_agent = excluded.user_agent "
                            "WHERE sessions.source = 'rollout' AND sessions.client IS NULL "
                            "AND sessions.user_agent IS NULL")
            acked, params = acked_sql(batch.acks)
            columns = ", ".join(RECORD_COLUMNS)
            new = f"SELECT {SELECT_ROWS} FROM {source} LEFT JOIN ({acked}) a ON a.call_id = r.call_id"
            con.execute(f"INSERT INTO {table} ({columns}) {new}", params)
        set_meta_value(con, position_key, end.encode())
        con.execute("COMMIT")
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except Exception:
            pass   # a failed COMMIT leaves no transaction; an invalidated database no connection
        raise
