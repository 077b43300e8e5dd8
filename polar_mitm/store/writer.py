"""The proxy's writer: calls are acknowledged after a durable append to the call log, and a
loader thread moves the log into DuckDB in bulk, off the request path.

- submit() hands a record to the log thread and returns a future. The thread serializes
  each record on its own (one bad record fails only its own call), appends the batch to
  the log and fsyncs once for all of them (group commit), then resolves the futures with
  each call's sequence number. Records that arrive during an fsync share the next one.
- The loader wakes every few tens of milliseconds. Each load is one transaction that also
  stores how far the log is loaded, so every line lands exactly once. While calls come it
  loads whole row groups of ROW_GROUP_ROWS lines (see CallWriter._load), keeps the file
  open, and lets go of it when calls pause. When a reader of another process asks for the
  file (a request file in `<db>.readers/`), the loader first loads everything pending, so
  the reader sees every acknowledged call, then leaves the file alone until the reader is
  done. Calls never wait on DuckDB, whoever holds it and for however long.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import fcntl
import logging
import os
import queue
import threading
import time
from collections import deque
from datetime import datetime
from pathlib import Path

import duckdb
import orjson

from .calllog import LogAppender, Position, drop_loaded, log_dir, read_lines
from .db import (LOADER_FILE, READY_SUFFIX, StoreBusy, connect, init_db, pending_requests,
                 readers_dir, writing)
from .delta import DeltaCache, count_ids, fingerprint
from .schema import JSON_COLUMNS, RECORD_COLUMNS

log = logging.getLogger("polar")

_SESSION_COLUMNS = ("session_id", "task_id", "source", "client", "user_agent")
_LINE_COLUMNS = [c for c in RECORD_COLUMNS if c != "session_id"]   # a line's "r"
_STOP = object()
LOAD_FILE = ".load.jsonl"   # in <db>.log/: the lines of one bulk load, for DuckDB to read
LINE_MARK = b'{"v":3,'      # log lines of this format: every column's key, null or not
LINE_V2 = b'{"v":2,'        # the same without the keys of null columns; older ones carry
                            # whole requests
POSITION_KEY = "log_position"
WRITER_LOCK = ".writer.lock"   # in <db>.log/
# DuckDB 2.0 writes a transaction's full row groups straight to the file, and rewrites a
# table's part-filled last row group at each checkpoint (needing it in memory to append to
# it). The smallest row group it allows (2048 rows of ~30 KB) bounds what one whole-group
# load holds in memory. One thread: the proxy's own work needs the CPUs.
ROW_GROUP_ROWS = 2048
MAIN, TAIL = "call_records_main", "call_records_tail"   # the tables behind call_records
LOADER_SETTINGS = ("SET threads = 1", "SET checkpoint_threshold = '16MB'")
# DuckDB's memory in the proxy besides the CSV reader's buffer (_loader_memory): room for
# one load of a whole row group, or of LOAD_BYTES into a part-filled one (48 MB was
# measured to be enough, 40 not). More only buys a cache the loader never reads.
LOADER_MEMORY = 60 << 20
CSV_BUFFER = 4 << 20
IDLE_MEMORY = 8 << 20   # DuckDB's memory_limit between loads (see _shrink)
LOAD_BYTES = 8 << 20    # of log lines read at a time, and per load of a part-filled row group
# per whole-row-group load: past it, the group goes in smaller loads (2048 lines of a bench
# window of new sessions, each first call whole, came to ~75 MB)
GROUP_BYTES = 128 << 20
# What a line may be refused for: its data. Anything else (out of memory, I/O) fails the
# whole load, which is retried later with every line intact.
_DATA_ERRORS = (duckdb.ConversionException, duckdb.InvalidInputException,
                duckdb.TypeMismatchException, duckdb.BinderException)


_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Name the calling thread for the OS (/proc/PID/task/TID/comm, top -H), so the CPU
    of the log and the loader can be told from the event loop's (bench_gateway prints it)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass   # not Linux: the names are only a help


class CallWriter:
    def __init__(self, db_path: str | os.PathLike, *, lock_timeout: float = 10.0,
                 load_interval: float = 60.0, poll: float = 0.03):
        self.db_path = str(db_path)
        self.lock_timeout = lock_timeout
        # Calls are loaded a whole row group at a time (see _load), and the rest when a
        # reader asks (readers get every acknowledged call at once) or once the oldest has
        # waited load_interval seconds. The file is let go after idle_release without calls.
        self.load_interval = load_interval
        self.poll = poll
        self.salt = ""
        self._queue: queue.Queue = queue.Queue()
        self._seq: dict[str, int] = {}
        self._log: LogAppender | None = None
        self._position = Position()
        self._durable = Position()         # the log up to here is fsynced
        self._durable_lines = 0            # lines up to there since start, and those loaded
        self._loaded_lines = 0
        self._appends: deque = deque()     # (end, monotonic time) of each append not yet loaded
        self._last_append = time.monotonic()
        self._deltas = DeltaCache()       # the log thread's recent calls per session
        self._con = None                  # the loader's connection, while calls keep coming
        self._memory = 0                  # its memory_limit now, in bytes
        self._memory_boost = 0            # doublings of it after loads that ran out of memory
        self._lock_fd: int | None = None
        self.idle_release = 3.0           # seconds without calls before it lets go
        self._known_sessions: set[str] = set()   # already in the sessions table
        self._ack_ms: dict[str, float] = {}   # call_id -> total_ms at its durable append
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._log_thread = threading.Thread(target=self._run_log, name="polar-log", daemon=True)
        self._load_thread = threading.Thread(target=self._run_loader, name="polar-loader", daemon=True)
        self.batches = 0                   # fsynced log batches
        self.loads = 0                     # bulk loads into DuckDB
        self.load_errors = 0

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> "CallWriter":
        directory = log_dir(self.db_path)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # One writer per database: a second one's loader would delete the first one's live
        # log segments once it had loaded past them. Held until close, or the process dies.
        self._lock_fd = os.open(directory / WRITER_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise StoreBusy(f"another proxy is already writing to {self.db_path}") from None
        self.salt = init_db(self.db_path, timeout=max(self.lock_timeout, 30))
        with writing(self.db_path, timeout=max(self.lock_timeout, 30)) as con:
            row = con.execute("SELECT value FROM meta WHERE key = ?", [POSITION_KEY]).fetchone()
            self._position = Position.decode(row[0] if row else None)
            self._seq = dict(con.execute("SELECT session_id, max(seq) FROM call_records GROUP BY 1").fetchall())
        # Lines a previous run acknowledged but did not load yet count for the numbering.
        pos = self._position
        while True:
            lines, nxt = read_lines(directory, pos, max_bytes=LOAD_BYTES)
            self._durable_lines += len(lines)
            for line in lines:
                entry = _loads(line)
                if entry:
                    sid = entry["s"]["session_id"]
                    self._seq[sid] = max(self._seq.get(sid, 0), entry["r"]["seq"])
            if nxt == pos:
                break
            pos = nxt
        self._durable = pos
        if pos > self._position:
            self._appends.append((pos, time.monotonic()))
        self._log = LogAppender(directory, after=self._position.seg)
        marker = readers_dir(self.db_path) / LOADER_FILE
        marker.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
        self._log_thread.start()
        self._load_thread.start()
        self._wake.set()
        return self

    def submit_async(self, session: dict, record: dict) -> asyncio.Future:
        """submit(), for an event loop: the log thread settles all of a batch's futures of
        one loop with a single wake-up of that loop (one self-pipe write per fsync, not
        one per call)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((session, record, _LoopFuture(loop, fut), time.perf_counter()))
        return fut

    def submit(self, session: dict, record: dict) -> concurrent.futures.Future:
        """session: {session_id, task_id, source, client, user_agent}; record: call columns
        (seq is assigned here; `_t0`, the call's perf_counter start, fills total_ms). The
        future's result is the call's seq, once its record is durable."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((session, record, fut, time.perf_counter()))
        return fut

    @property
    def pending_lines(self) -> int:
        """Acknowledged calls not yet in the database."""
        return self._durable_lines - self._loaded_lines

    def close(self, timeout: float = 30.0) -> None:
        if self._log_thread.is_alive():
            self._queue.put(_STOP)
            self._log_thread.join(timeout)
        if self._load_thread.is_alive():
            self._stopping.set()
            self._wake.set()
            self._load_thread.join(timeout)
        if self._log:
            self._log.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)   # releases the flock
            self._lock_fd = None
        marker = readers_dir(self.db_path) / LOADER_FILE
        try:
            if marker.read_text().strip() == str(os.getpid()):
                marker.unlink()
        except (FileNotFoundError, OSError):
            pass

    # ---- the log thread ------------------------------------------------------------------

    def _run_log(self) -> None:
        name_os_thread("polar-log")
        stopping = False
        while not stopping:
            item = self._queue.get()
            batch = []
            while True:
                if item is _STOP:
                    stopping = True
                else:
                    batch.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                try:
                    self._append(batch)
                except BaseException as e:  # never let the thread die: fail this batch only
                    log.exception("polar: the call log failed")
                    _resolve_all([(fut, None, e) for *_, fut, _ in batch])

    def _append(self, batch: list) -> None:
        lines, done, failed = [], [], []
        now, wall = time.perf_counter(), time.time()
        for session, record, fut, queued in batch:
            if fut.done():            # its waiter went away (cancelled): nothing to record
                continue
            sid = session["session_id"]
            seq = self._seq.get(sid, 0) + 1
            rec = dict(record)
            t0 = rec.pop("_t0", None)
            if t0 is not None:        # until this batch's write; the fsync is added below
                rec["total_ms"] = (now - t0) * 1000
            rec["queue_ms"] = (rec.get("queue_ms") or 0.0) + (now - queued) * 1000
            rec["seq"] = seq
            rec["created_at"] = wall     # recorded: when the call is acknowledged
            # Stored as a delta against an earlier call of its session, from here on: the
            # log line carries only what is new (a few KB where the request is 200 KB).
            row, full = _stored_row(sid, _jsonable(rec), self._deltas)
            try:
                line = _dumps(session, row)
            except Exception as e:
                failed.append((fut, None, e))
                continue
            self._seq[sid] = seq
            lines.append(line)
            done.append((fut, seq, rec.get("call_id"), t0))
            # a later call of this batch may take this one as its base
            self._deltas.add(sid, rec["call_id"], *full)
        _resolve_all(failed)
        if not lines:
            return
        data = b"".join(lines)
        try:
            start, end = self._log.append(data)
        except BaseException:
            # On failure (disk full) the batch's futures fail and the numbers it took leave a
            # gap; calls it named as bases are not in the log, so nothing may refer to them.
            self._deltas = DeltaCache(self._deltas.budget, self._deltas.per_session)
            raise
        self._durable = end                 # before _durable_lines: see _load_pending
        self._durable_lines += len(lines)
        self._last_append = time.monotonic()
        self._appends.append((end, self._last_append))
        self.batches += 1
        acked = time.perf_counter()
        if len(self._ack_ms) > 100_000:   # stamps of lines the loader read before their fsync
            self._ack_ms.clear()
        for fut, seq, call_id, t0 in done:
            if t0 is not None and call_id:   # what the harness waited for, fsync included
                self._ack_ms[call_id] = (acked - t0) * 1000
        _resolve_all([(fut, seq, None) for fut, seq, _, _ in done])

    # ---- the loader thread ---------------------------------------------------------------

    def _run_loader(self) -> None:
        name_os_thread("polar-loader")
        retry_at, backoff, last_load = 0.0, 0.0, 0.0
        while True:
            self._wake.wait(self.poll)
            self._wake.clear()
            if self._stopping.is_set():
                self._final_load()
                return
            pending = self._durable > self._position
            readers = pending_requests(self.db_path)
            if readers:
                # Let the readers see every acknowledged call, tell them, then step aside.
                if not pending or self._load_pending(timeout=1.0):
                    self._release()
                    for r in readers:
                        ready = r.with_name(r.name + READY_SUFFIX)
                        if not ready.exists() and r.exists():
                            ready.touch()
                continue
            now = time.monotonic()
            if pending and now >= retry_at:
                # Whole row groups as soon as there are some; the rest when a reader asks,
                # or once the oldest has waited load_interval (see _load for why).
                if self.pending_lines >= ROW_GROUP_ROWS:
                    ok = self._load_pending(timeout=0.05, whole_groups=True)
                elif now - self._oldest_pending() >= self.load_interval:
                    ok = self._load_pending(timeout=0.05)
                else:
                    ok = None
                if ok is not None:
                    # a failing load (DuckDB out of memory, a full disk) is retried less and less often
                    backoff = 0.0 if ok else min(5.0, max(0.2, 2 * backoff))
                    retry_at = time.monotonic() + backoff
                    last_load = time.monotonic()
            if self._con is not None and now - max(self._last_append, last_load) >= self.idle_release:
                self._release()   # calls paused: other tools may open the file directly

    def _oldest_pending(self) -> float:
        """When the oldest line not yet in the database was appended (monotonic)."""
        while self._appends and self._appends[0][0] <= self._position:
            self._appends.popleft()
        return self._appends[0][1] if self._appends else time.monotonic()

    def _final_load(self) -> None:
        deadline = time.monotonic() + self.lock_timeout
        while self._durable > self._position and time.monotonic() < deadline:
            if not self._load_pending(timeout=max(0.05, deadline - time.monotonic())):
                time.sleep(0.05)
        self._release()

    def _release(self) -> None:
        """Close the file (DuckDB checkpoints on close), so another process can open it."""
        self._memory, self._memory_boost = 0, 0   # settings of the connection that goes
        # Whoever opens the file next may change the sessions table (a cleanup that deletes
        # sessions), and a failed load's sessions may not be in: the next load looks again.
        self._known_sessions.clear()
        if self._con is not None:
            con, self._con = self._con, None
            try:
                con.close()
            except Exception:
                log.exception("polar: closing the database failed")

    def _read(self, target: Position, max_lines: int | None, max_bytes: int) -> tuple[_LoadFile, Position]:
        """The log lines of one load, in the scratch file, and the position after them."""
        directory = log_dir(self.db_path)
        batch = _LoadFile(directory / LOAD_FILE)
        pos = self._position
        try:
            while pos < target and batch.lines != max_lines and batch.bytes < max_bytes:
                want = None if max_lines is None else max_lines - batch.lines
                lines, nxt = read_lines(directory, pos, max_bytes=min(LOAD_BYTES, max_bytes - batch.bytes),
                                        end=target, max_lines=want)
                if nxt == pos:
                    break
                batch.add(lines, self._ack_ms)
                pos = nxt
        finally:
            batch.close()
        return batch, pos

    def _shrink(self) -> None:
        """Between loads DuckDB would keep what a load used, cached up to its memory_limit
        (measured: ~75 MB after a whole row group, every load on top of the proxy's own
        memory); a small limit makes it let go at once."""
        try:
            self._con.execute(f"SET memory_limit = '{IDLE_MEMORY}B'")
            self._memory = IDLE_MEMORY
        except duckdb.Error:
            pass   # it could not free that much: the next load sets its own limit anyway

    def _load_pending(self, timeout: float, whole_groups: bool = False) -> bool:
        """Load what is durable up to now (not what keeps coming meanwhile, so a reader
        that asked is answered under any load); True when it all is in the database.
        whole_groups: only while the lines fill whole row groups (see _load)."""
        # _durable_lines is read before _durable: the log thread sets them the other way
        # round, so the target holds at least that many lines.
        lines_now, target = self._durable_lines, self._durable
        try:
            self._open(timeout)
            while self._position < target:
                if lines_now - self._loaded_lines >= ROW_GROUP_ROWS:
                    self._load(target, ROW_GROUP_ROWS, GROUP_BYTES)
                elif whole_groups:
                    break
                else:
                    self._load(target, None, LOAD_BYTES)
            return True
        except StoreBusy:
            return False          # someone else holds the file; the log keeps the calls
        except Exception:
            self.load_errors += 1
            log.exception("polar: loading the call log into DuckDB failed; will retry")
            return False

    def _open(self, timeout: float) -> None:
        # The file stays open while calls keep coming: each close is a checkpoint.
        # Readers ask, and get it at once; see _run_loader.
        if self._con is None:
            self._con = connect(self.db_path, timeout=timeout, row_group_size=ROW_GROUP_ROWS)
            for setting in LOADER_SETTINGS:
                self._con.execute(setting)

    def _load(self, target: Position, max_lines: int | None, max_bytes: int) -> int:
        """One transaction: the lines from the loaded position on, up to `target`, at most
        max_lines and about max_bytes of them; returns how many were read.

        Exactly ROW_GROUP_ROWS lines go to call_records_main: DuckDB writes such a row group
        straight to the file as it fills (no WAL), and never rewrites it. Fewer go to
        call_records_tail, which is checkpointed at once (DuckDB keeps rows not
        checkpointed in memory). Measured on the bench's log lines: 0.3 ms of CPU per call
        in whole groups, 1.0 in loads of 300 into a part-filled row group, which DuckDB
        rewrites at every checkpoint and needs in memory to append to."""
        batch, pos = self._read(target, max_lines, max_bytes)
        if max_lines is not None and not batch.whole and batch.bytes > LOAD_BYTES:
            # A row group's lines past GROUP_BYTES: they go to the tail LOAD_BYTES at a time,
            # the size its memory is made for (64 MB of them in one load ran out of it).
            self._ack_ms.update(batch.acks)
            batch, pos = self._read(target, None, LOAD_BYTES)
        if pos == self._position:
            raise RuntimeError(f"the call log cannot be read past {pos.encode()}")
        # a whole row group is in memory until it is written: measured, 64 MB of lines
        # (2048 of the bench's) load in 64 MB mostly, but not always in the proxy
        memory = (_loader_memory(batch.longest) + (batch.bytes // 2 if batch.whole else 0)) << self._memory_boost
        if memory != self._memory:
            self._con.execute(f"SET memory_limit = '{memory}B'")
            self._memory = memory
        try:
            batch.insert(self._con, pos, self._known_sessions)
            if not batch.whole:
                self._con.execute("CHECKPOINT")
        except BaseException as e:
            self._ack_ms.update(batch.acks)   # the retry stamps them again
            boost = self._memory_boost
            self._release()
            if isinstance(e, duckdb.OutOfMemoryException):
                # e.g. a large tail, or a WAL replayed after a crash: the retry gets twice
                # the memory, and the next load the usual again
                self._memory_boost = min(boost + 1, 6)
            raise
        self._memory_boost = 0
        self._shrink()
        self._position = pos
        self._loaded_lines += batch.lines
        self.loads += 1
        drop_loaded(log_dir(self.db_path), pos, keep_from=self._log.seg if self._log else pos.seg)
        return batch.lines


class _LoadFile:
    """The log lines of one load, written to the scratch file DuckDB reads (see
    _read_log_sql) as they come (the loader holds LOAD_BYTES of them at a time), with
    what the load needs to know about them. Loading takes no Python work per call beyond
    this."""

    def __init__(self, path: Path):
        self.path = path
        self._f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
        self.lines = 0          # log lines read (an unreadable old one is counted, not stored)
        self.stored = 0         # lines in the file
        self.bytes = 0
        self.longest = 0
        self.sessions: set[str | None] = set()
        self.acks: dict[str, float] = {}

    def add(self, lines: list[bytes], ack_ms: dict[str, float] | None = None) -> None:
        """ack_ms: the total_ms of calls this process acknowledged (taken once used)."""
        self.lines += len(lines)
        lines = [line if line.startswith(LINE_MARK) else _upgrade(line) for line in lines]
        lines = [line if line.endswith(b"\n") else line + b"\n" for line in lines if line]
        for line in lines:
            if ack_ms:
                call_id = _call_id(line)
                if call_id in ack_ms:
                    self.acks[call_id] = ack_ms.pop(call_id)
            self.sessions.add(_session_id(line))
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

    def insert(self, con, nxt: Position, known: set[str] | None = None) -> None:
        """One transaction: these calls and the log position after them, so each line is
        loaded once. known: the session ids already stored (added to here). A line DuckDB
        refuses is stored as a failed call that says why, rather than hold up every later
        one."""
        new_sessions = known is None or not self.sessions <= known
        try:
            _insert(con, self, nxt, new_sessions)
        except _DATA_ERRORS as e:
            log.error("polar: DuckDB refused a load of %d log lines (%s); loading them one by one",
                      self.stored, e)
            lines = [line for line in self.path.read_bytes().split(b"\n") if line]
            one = self.path.with_name(self.path.name + ".one")
            lines = [_storable(con, line, one) for line in lines]
            _write_scratch(self.path, lines)
            self.longest = max(map(len, lines), default=0)
            _insert(con, self, nxt, True)
        if known is not None:
            if len(known) > 100_000:
                known.clear()
            known |= self.sessions


def load_lines(con, lines: list[bytes], nxt: Position, scratch: Path,
               ack_ms: dict[str, float] | None = None, known: set[str] | None = None) -> None:
    """Loads these log lines in one transaction (see _LoadFile.insert); `ack_ms` has the
    total_ms of calls this process acknowledged (taken once used)."""
    batch = _LoadFile(scratch)
    try:
        batch.add(lines, ack_ms)
    finally:
        batch.close()
    batch.insert(con, nxt, known)


def _insert(con, batch: _LoadFile, nxt: Position, new_sessions: bool) -> None:
    con.execute("BEGIN")
    try:
        if batch.stored:
            source = _read_log_sql(con, batch.path, batch.longest)
            if new_sessions:   # a scan of its own: skipped when every session is known
                con.execute("INSERT INTO sessions (session_id, task_id, source, client, user_agent) "
                            "SELECT s.session_id, any_value(s.task_id), any_value(s.source), "
                            f"any_value(s.client), any_value(s.user_agent) FROM {source} "
                            "GROUP BY s.session_id ON CONFLICT DO NOTHING")
            acked, params = _acked(batch.acks)
            columns = ", ".join(RECORD_COLUMNS)
            new = f"SELECT {_SELECT} FROM {source} LEFT JOIN ({acked}) a ON a.call_id = r.call_id"
            con.execute(f"INSERT INTO {MAIN if batch.whole else TAIL} ({columns}) {new}", params)
        con.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    [POSITION_KEY, nxt.encode()])
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
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


def _csv_buffer(longest: int) -> int:
    return max(CSV_BUFFER, 2 * (longest + 1024))


def _loader_memory(longest: int) -> int:
    """DuckDB's memory for one load: LOADER_MEMORY, the CSV reader's buffer, and room for
    the longest line's copies (measured: a 40 MB line needs ~275 MB in all)."""
    return LOADER_MEMORY + _csv_buffer(longest) + 5 * longest


def _read_log_sql(con, scratch: Path, longest: int) -> str:
    """The scratch file's lines as `s` and `r` structs typed as call_records' columns. It
    is read as one-column CSV (its separator, 0x01, is escaped in any JSON) through a
    buffer sized to the longest line, where read_json reserves 32 MiB at least: measured,
    a 2048-line load peaks ~25 MB lower. json_transform_strict fails a value of the wrong
    type as read_json does."""
    if not _TYPES:
        for name, kind in con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                      f"WHERE table_name = '{MAIN}'").fetchall():
            _TYPES[name] = "DOUBLE" if kind.startswith("TIMESTAMP") else kind
    structure = orjson.dumps({"s": dict.fromkeys(_SESSION_COLUMNS, "VARCHAR"),
                              "r": {c: _TYPES[c] for c in _LINE_COLUMNS}}).decode()
    path = str(scratch).replace("'", "''")
    line_size = longest + 1024
    return (f"(SELECT j.s AS s, j.r AS r FROM (SELECT json_transform_strict(line, '{structure}') AS j "
            f"FROM read_csv('{path}', columns = {{'line': 'VARCHAR'}}, delim = '{chr(1)}', quote = '', "
            f"escape = '', header = false, auto_detect = false, max_line_size = {line_size}, "
            f"buffer_size = {_csv_buffer(longest)})))")


def _selected(column: str) -> str:
    """A call_records column as read from a log line (r: the record, s: the session)."""
    return {"session_id": "s.session_id", "total_ms": "coalesce(a.ms, r.total_ms)",
            "created_at": "coalesce(to_timestamp(r.created_at), now())",
            "started_at": "to_timestamp(r.started_at)"}.get(column, f"r.{column}")


_SELECT = ", ".join(map(_selected, RECORD_COLUMNS))


def _storable(con, line: bytes, scratch: Path) -> bytes:
    """The line, if DuckDB reads it alone; else a failed call in its place, saying why."""
    _write_scratch(scratch, [line])
    try:
        con.execute(f"SELECT {_SELECT} FROM "
                    f"{_read_log_sql(con, scratch, len(line))} "
                    f"LEFT JOIN ({_acked({})[0]}) a ON a.call_id = r.call_id").fetchall()
        return line
    except _DATA_ERRORS as e:
        entry = _loads(line) or {"s": {}, "r": {}}
        r = entry["r"]
        keep = {k: r.get(k) for k in ("call_id", "seq", "style", "method", "path", "started_at",
                                      "created_at") if isinstance(r.get(k), (str, int, float))}
        keep.update(status_code=r.get("status_code") if isinstance(r.get("status_code"), int) else None,
                    error=f"polar: this call could not be stored: {e}"[:2000], error_kind="unstored")
        return _dumps({k: v for k, v in entry["s"].items() if isinstance(v, str)}, keep)


def _session_id(line: bytes) -> str | None:
    """The session_id of a log line of this format (the first key of its "s")."""
    head = LINE_MARK + b'"s":{"session_id":"'
    if line.startswith(head):
        raw = line[len(head):line.find(b'"', len(head))]
        if b"\\" not in raw:   # no escapes: the id as it is
            return raw.decode()
    entry = _loads(line)
    return entry["s"].get("session_id") if entry else None


def _call_id(line: bytes) -> str | None:
    """The call_id of a log line of this format."""
    at = line.find(b'"call_id":"')
    if at < 0:
        return None
    start = at + len(b'"call_id":"')
    return line[start:line.find(b'"', start)].decode()


def _upgrade(line: bytes) -> bytes | None:
    """A line of an older version in this format."""
    entry = _loads(line)
    if not entry:
        return None
    if line.startswith(LINE_V2):
        return _dumps(entry["s"], entry["r"])
    row = _stored_row(entry["s"].get("session_id"), dict(entry["r"]), DeltaCache(budget=0))[0]
    return _dumps(entry["s"], row)


def _stored_row(sid: str, rec: dict, deltas: DeltaCache) -> tuple[dict, tuple]:
    """The call as stored, its request text and prompt ids a delta against a call of its
    session in `deltas`; and (text, prompt ids, token ids, fingerprints) to remember it by."""
    text = rec.pop("request_text", None)
    if isinstance(text, bytes):   # the harness's bytes as sent, decoded here off the event loop
        text = text.decode("utf-8", errors="replace")
    text = text if isinstance(text, str) else ""
    prompt = rec.pop("prompt_token_ids", None)
    fp = fingerprint(text, prompt if isinstance(prompt, (list, bytes)) else None)
    prompt = fp.prompt
    d = deltas.delta(sid, text, prompt, fp)
    suffix = d.prompt_suffix
    if prompt is None:
        prompt_len = None
    elif d.base_call is None:
        prompt_len = count_ids(prompt)
    else:   # counted on the few new ids, not on the whole prompt again
        prompt_len = d.prompt_shared + count_ids(suffix)
    row = rec | {"base_call": d.base_call, "request_prefix": d.request_prefix,
                 "request_suffix": d.request_suffix, "request_middle": d.request_middle,
                 "request_chars": len(text), "prompt_shared": d.prompt_shared,
                 "prompt_suffix": suffix.decode() if suffix is not None else None,
                 "prompt_len": prompt_len}
    return row, (text, prompt, rec.get("token_ids"), fp)


def catch_up(db_path: str | os.PathLike, timeout: float = 30.0) -> int:
    """Load what a proxy acknowledged but did not load (it was killed, or its file was
    copied here). Only when no proxy is loading this log; returns the lines loaded."""
    directory = log_dir(db_path)
    if not directory.exists():
        return 0
    loaded = 0
    con = connect(db_path, timeout=timeout, row_group_size=ROW_GROUP_ROWS)
    try:
        while True:
            row = con.execute("SELECT value FROM meta WHERE key = ?", [POSITION_KEY]).fetchone()
            pos = Position.decode(row[0] if row else None)
            lines, nxt = read_lines(directory, pos, max_lines=ROW_GROUP_ROWS)
            if nxt == pos:
                return loaded
            load_lines(con, lines, nxt, directory / LOAD_FILE)
            loaded += len(lines)
    finally:
        con.close()


class _LoopFuture(tuple):
    """An asyncio future and its loop, as the log thread holds it."""
    __slots__ = ()

    def __new__(cls, loop, fut):
        return super().__new__(cls, (loop, fut))

    def done(self) -> bool:
        return self[1].done()


def _resolve_all(items: list) -> None:
    """Settle (future, result, exception) triples: concurrent futures at once, asyncio
    futures with one call into each of their loops."""
    by_loop: dict = {}
    for fut, result, exc in items:
        if isinstance(fut, _LoopFuture):
            by_loop.setdefault(fut[0], []).append((fut[1], result, exc))
        else:
            _resolve(fut, result, exc)
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, group)
        except RuntimeError:   # the loop is closed: nobody waits any more
            pass


def _settle(group: list) -> None:
    for fut, result, exc in group:
        if not fut.done():   # cancelled by its waiter meanwhile
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)


def _resolve(fut: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass   # cancelled by its waiter meanwhile


def _dumps(session: dict, rec: dict) -> bytes:
    """The log line of a call (LINE_MARK first), with the key of every column (the loader
    reads the lines strictly: a value of the wrong type fails, a key missing too). A JSON
    column nested too deeply to write is marked in it rather than fail the call: orjson
    writes at most 254 levels (it reads 1024), and the gateway keeps such a request as its
    raw text anyway."""
    session, rec = dict.fromkeys(_SESSION_COLUMNS) | session, dict.fromkeys(_LINE_COLUMNS) | rec
    try:
        return orjson.dumps({"v": 3, "s": session, "r": rec}) + b"\n"
    except orjson.JSONEncodeError:
        pass
    rec = dict(rec)
    for col in JSON_COLUMNS:
        value = rec.get(col)
        if value is None:
            continue
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError:
            rec[col] = {"polar_unstored": "nested too deeply to store"}
    return orjson.dumps({"v": 3, "s": session, "r": rec}) + b"\n"


def _loads(line: bytes) -> dict | None:
    try:
        entry = orjson.loads(line)
    except orjson.JSONDecodeError:
        log.error("polar: skipping an unreadable call log line (%d bytes)", len(line))
        return None
    return entry if isinstance(entry, dict) and "s" in entry and "r" in entry else None


def _jsonable(record: dict) -> dict:
    out = dict(record)
    for col in ("started_at", "created_at"):
        if isinstance(out.get(col), datetime):
            out[col] = out[col].timestamp()
    return out
