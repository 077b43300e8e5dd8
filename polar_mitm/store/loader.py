"""The loader: moves the call log into DuckDB in bulk, every acknowledged call exactly once.

Exactly once by construction, not by a happy path:
- A load is named by the log positions it goes from and to. Its transaction first checks
  that the position stored in the database is where the load starts (compare and set), then
  inserts the rows and stores where it ends, and commits. A load that re-reads lines that
  are already stored aborts instead of storing them twice.
- After any error (DuckDB's or ours, before, during or after COMMIT: a COMMIT can be durable
  and still raise, when its autocheckpoint fails or the database is invalidated after it)
  the connection is dropped. The next load reopens the file and takes the committed
  position from the database itself.

Sized by bytes: a whole row group (ROW_GROUP_ROWS lines; DuckDB writes it straight to the
file and never rewrites it) loads when its lines fit `group_bytes`, and DuckDB gets memory
for all of them (it pins the whole row group to write it at COMMIT: measured, splitting it
into several INSERTs does not help). Anything less goes to the tail table in one load. A
failed load is retried with twice the memory, at most `max_boost` doublings.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import duckdb
import orjson

from .calllog import Position, drop_loaded, log_dir, read_lines, segment_ids, segment_path
from .connection import StoreBusy, connect
from .lines import LINE_COLUMNS, LINE_MARK, SESSION_COLUMNS, call_id, dumps, loads, session_id, upgrade
from .schema import RECORD_COLUMNS

log = logging.getLogger("polar")

POSITION_KEY = "log_position"
DB_ID_KEY = "db_id"
LOAD_FILE = ".load.jsonl"      # in <db>.log/: the lines of one load, for DuckDB to read
WRITER_LOCK = ".writer.lock"   # in <db>.log/: held by whoever loads this log
OWNER_FILE = ".owner"          # in <db>.log/: the db_id of the database the log belongs to
MAIN, TAIL = "call_records_main", "call_records_tail"   # the tables behind call_records
ROW_GROUP_ROWS = 2048          # the smallest row group DuckDB allows
LOADER_SETTINGS = ("SET threads = 1", "SET checkpoint_threshold = '16MB'")
# What a line may be refused for: its data. Anything else (out of memory, I/O) fails the
# whole load, which is retried later with every line intact.
DATA_ERRORS = (duckdb.ConversionException, duckdb.InvalidInputException,
               duckdb.TypeMismatchException, duckdb.BinderException)


def _default_group_bytes() -> int:
    """Lines of one whole-row-group load: 1 GiB, or an eighth of the machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return max(128 << 20, min(1 << 30, total // 8))


@dataclass
class LoaderConfig:
    # DuckDB's memory besides the lines: its connection, the CSV reader (see read_log_sql)
    # and a load's bookkeeping (48 MB was measured to be enough for 8 MB of lines, 40 not).
    base_memory: int = 60 << 20
    csv_buffer: int = 4 << 20
    idle_memory: int = 8 << 20         # between loads: makes DuckDB hand back what it kept
    read_bytes: int = 8 << 20          # of log lines read at a time, and per tail load
    group_bytes: int = field(default_factory=_default_group_bytes)
    # DuckDB's memory per byte of lines it holds (a row group being written, or the tail's
    # part-filled one): 2048 lines of 147 KB ran out of 1.17x their bytes (with the rest).
    line_memory: float = 1.5
    max_boost: int = 3                 # doublings of a failed load's memory, at most


class AckTimes:
    """The total_ms of calls this process acknowledged, by call_id: the proxy's log thread
    stamps them at the durable append, its loader thread takes them as it loads their lines
    (and gives back what a failed load took). Two threads, so every access holds the lock."""

    LIMIT = 100_000   # a bound: stamps never taken (their lines loaded elsewhere) do not pile up

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms: dict[str, float] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._ms)

    def stamp(self, stamps: Iterable[tuple[str, float]]) -> None:
        with self._lock:
            if len(self._ms) > self.LIMIT:
                self._ms.clear()
            self._ms.update(stamps)

    def take(self, call_id: str | None) -> float | None:
        if call_id is None:
            return None
        with self._lock:
            return self._ms.pop(call_id, None)

    def give_back(self, taken: dict[str, float] | None) -> None:
        if taken:
            with self._lock:
                self._ms.update(taken)   # the retry stamps them again


class PositionMoved(RuntimeError):
    """The database's stored log position is not where this load starts."""


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
        drop_loaded(self.dir, self.position, keep_from=keep_from)

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
        memory = (cfg.base_memory + csv_buffer(batch.longest, cfg) + 5 * batch.longest
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


def meta_value(con, key: str) -> str | None:
    row = con.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
    return row[0] if row else None


def stored_position(con) -> Position:
    """How far the log is in the database (committed with the rows it covers)."""
    return Position.decode(meta_value(con, POSITION_KEY))


# ---- one load's lines ------------------------------------------------------------------------


class LoadBatch:
    """The log lines of one load, written to the scratch file DuckDB reads (see
    read_log_sql) as they come (read_bytes of them at a time), with what the load needs to
    know about them. Loading takes no Python work per call beyond this."""

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

    def insert(self, con, start: Position, end: Position, known: set[str | None] | None, table: str) -> None:
        """One transaction: these calls and the log position after them, if the database's
        position is `start`. known: the session ids already stored (added to here). A line
        DuckDB refuses is stored as a failed call that says why, rather than hold up every
        later one."""
        new_sessions = known is None or not self.sessions <= known
        try:
            _insert(con, self, start, end, new_sessions, table)
        except DATA_ERRORS as e:
            log.error("polar: DuckDB refused a load of %d log lines (%s); loading them one by one",
                      self.stored, e)
            lines = [line for line in self.path.read_bytes().split(b"\n") if line]
            one = self.path.with_name(self.path.name + ".one")
            lines = [_storable(con, line, one) for line in lines]
            _write_scratch(self.path, lines)
            self.longest = max(map(len, lines), default=0)
            _insert(con, self, start, end, True, table)
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


def _insert(con, batch: LoadBatch, start: Position, end: Position, new_sessions: bool, table: str) -> None:
    con.execute("BEGIN")
    try:
        stored = stored_position(con)
        if stored != start:
            raise PositionMoved(f"the database holds the call log up to {stored.encode()}, "
                                f"this load starts at {start.encode()}")
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
            acked, params = _acked(batch.acks)
            columns = ", ".join(RECORD_COLUMNS)
            new = f"SELECT {_SELECT} FROM {source} LEFT JOIN ({acked}) a ON a.call_id = r.call_id"
            con.execute(f"INSERT INTO {table} ({columns}) {new}", params)
        con.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    [POSITION_KEY, end.encode()])
        con.execute("COMMIT")
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except Exception:
            pass   # a failed COMMIT leaves no transaction; an invalidated database no connection
        raise


def _acked(acks: dict[str, float]) -> tuple[str, list]:
    if not acks:
        return "SELECT NULL::VARCHAR AS call_id, NULL::DOUBLE AS ms WHERE false", []
    values = ", ".join(["(?, ?)"] * len(acks))
    return f"SELECT * FROM (VALUES {values}) t(call_id, ms)", [v for kv in acks.items() for v in kv]


def _write_scratch(path: Path, lines: list[bytes]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.writelines(line if line.endswith(b"\n") else line + b"\n" for line in lines)


_TYPES: dict[str, str] = {}


def csv_buffer(longest: int, config: LoaderConfig | None = None) -> int:
    return max((config or LoaderConfig()).csv_buffer, 2 * (longest + 1024))


def read_log_sql(con, scratch: Path, longest: int) -> str:
    """The scratch file's lines as `s` and `r` structs typed as call_records' columns. It
    is read as one-column CSV (its separator, 0x01, is escaped in any JSON) through a
    buffer sized to the longest line, where read_json reserves 32 MiB at least: measured,
    a 2048-line load peaks ~25 MB lower. json_transform_strict fails a value of the wrong
    type as read_json does."""
    if not _TYPES:
        for name, kind in con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                      f"WHERE table_name = '{MAIN}'").fetchall():
            _TYPES[name] = "DOUBLE" if kind.startswith("TIMESTAMP") else kind
        # Read as text, made an integer by _selected: lines written before migration 10 carry
        # it as text ("3"), and a value that is no integer is an unknown version (NULL).
        _TYPES["policy_version"] = "VARCHAR"
    structure = orjson.dumps({"s": dict.fromkeys(SESSION_COLUMNS, "VARCHAR"),
                              "r": {c: _TYPES[c] for c in LINE_COLUMNS}}).decode()
    path = str(scratch).replace("'", "''")
    line_size = longest + 1024
    return (f"(SELECT j.s AS s, j.r AS r FROM (SELECT json_transform_strict(line, '{structure}') AS j "
            f"FROM read_csv('{path}', columns = {{'line': 'VARCHAR'}}, delim = '{chr(1)}', quote = '', "
            f"escape = '', header = false, auto_detect = false, max_line_size = {line_size}, "
            f"buffer_size = {csv_buffer(longest)})))")


def _selected(column: str) -> str:
    """A call_records column as read from a log line (r: the record, s: the session)."""
    return {"session_id": "s.session_id", "total_ms": "coalesce(a.ms, r.total_ms)",
            "created_at": "coalesce(to_timestamp(r.created_at), now())",
            "started_at": "to_timestamp(r.started_at)",
            "policy_version": "TRY_CAST(r.policy_version AS INTEGER)"}.get(column, f"r.{column}")


_SELECT = ", ".join(map(_selected, RECORD_COLUMNS))


def _storable(con, line: bytes, scratch: Path) -> bytes:
    """The line, if DuckDB reads it alone; else a failed call in its place, saying why."""
    _write_scratch(scratch, [line])
    try:
        con.execute(f"SELECT {_SELECT} FROM "
                    f"{read_log_sql(con, scratch, len(line))} "
                    f"LEFT JOIN ({_acked({})[0]}) a ON a.call_id = r.call_id").fetchall()
        return line
    except DATA_ERRORS as e:
        entry = loads(line) or {"s": {}, "r": {}}
        r = entry["r"]
        keep = {k: r.get(k) for k in ("call_id", "seq", "style", "method", "path", "started_at",
                                      "created_at") if isinstance(r.get(k), (str, int, float))}
        keep.update(status_code=r.get("status_code") if isinstance(r.get("status_code"), int) else None,
                    error=f"polar: this call could not be stored: {e}"[:2000], error_kind="unstored")
        return dumps({k: v for k, v in entry["s"].items() if isinstance(v, str)}, keep)


# ---- who loads a log, and which database it belongs to ---------------------------------------


@contextmanager
def writer_lock(directory: Path, *, blocking: bool = False) -> Iterator[int | None]:
    """The log's writer lock (flock): its fd while held, None when someone else holds it.
    One writer per log: a second loader would delete a live writer's segments."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(directory / WRITER_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def log_owner(directory: Path) -> str | None:
    try:
        return (directory / OWNER_FILE).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def claim_log(directory: Path, db_id: str) -> None:
    """Record that this log belongs to the database `db_id` (durably: before any line)."""
    tmp = directory / (OWNER_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, db_id.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / OWNER_FILE)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def log_segments(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.jsonl") if p.name[:-6].isdigit())


def owns_log(directory: Path, db_id: str | None, *, legacy_ok: bool) -> bool:
    """Whether the log's lines belong to the database `db_id`. A log with no owner file was
    written before logs recorded one: it belongs to a database that had no id yet either
    (legacy_ok), never to a new one. An empty log belongs to anyone."""
    owner = log_owner(directory)
    if owner is not None:
        return owner == db_id
    return legacy_ok or not log_segments(directory)


def set_aside(directory: Path, why: str) -> Path:
    """Move a log that is not this database's out of the way (kept, never loaded here)."""
    aside = directory.with_name(f"{directory.name}.stray-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    aside.mkdir(mode=0o700)
    for p in [*log_segments(directory), directory / OWNER_FILE]:
        if p.exists():
            os.replace(p, aside / p.name)
    log.warning("polar: the call log %s %s; moved to %s, not loaded", directory, why, aside)
    return aside


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
            db_id = meta_value(loader.con, DB_ID_KEY)
            if not owns_log(directory, db_id, legacy_ok=db_id is None):
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


def log_end(directory: Path) -> Position:
    """The end of the log as it is now (a torn last line included: reads stop before it)."""
    ids = segment_ids(directory)
    if not ids:
        return Position()
    try:
        return Position(ids[-1], os.path.getsize(segment_path(directory, ids[-1])))
    except FileNotFoundError:
        return Position(ids[-1], 0)
