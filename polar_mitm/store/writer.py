"""The proxy's writer: calls are acknowledged after a durable append to the call log, and a
loader thread moves the log into DuckDB in bulk, off the request path.

- submit() hands a record to the log thread and returns a future. The thread serializes
  each record on its own (one bad record fails only its own call), appends the batch to
  the log and fsyncs once for all of them (group commit), then resolves the futures with
  each call's sequence number. Records that arrive during an fsync share the next one.
- The loader wakes every few tens of milliseconds. It opens the database only to load a
  bulk of log lines (one transaction that also stores how far the log is loaded, so
  every line lands exactly once), checkpoints there when DuckDB wants to, and closes the
  file at once. When a reader of another process asks for the file (a request file in
  `<db>.readers/`), the loader first loads what is pending, so the reader sees every
  acknowledged call, then leaves the file alone until the reader is done. Calls never
  wait on DuckDB, whoever holds it and for however long.
"""

from __future__ import annotations

import collections
import concurrent.futures
import fcntl
import logging
import os
import queue
import threading
import time
from datetime import datetime, timezone

import orjson
import pyarrow as pa

from .calllog import LogAppender, Position, drop_loaded, log_dir, read_lines
from .db import (LOADER_FILE, READY_SUFFIX, StoreBusy, connect, init_db, pending_requests,
                 readers_dir, writing)
from .delta import DeltaCache, count_ids, ids_json
from .schema import JSON_COLUMNS, RECORD_COLUMNS

log = logging.getLogger("polar")

_ARROW_TYPES = {
    "seq": pa.int32(), "stream": pa.bool_(), "status_code": pa.int32(),
    "request_prefix": pa.int32(), "request_suffix": pa.int32(), "request_chars": pa.int32(),
    "prompt_shared": pa.int32(), "prompt_len": pa.int32(),
    "prompt_suffix": pa.string(), "token_ids": pa.list_(pa.int32()),
    "logprobs": pa.list_(pa.float32()), "prompt_tokens": pa.int32(),
    "completion_tokens": pa.int32(), "queue_ms": pa.float64(), "backend_ms": pa.float64(),
    "total_ms": pa.float64(), "dropped": pa.list_(pa.string()),
    "started_at": pa.timestamp("us", tz="UTC"), "created_at": pa.timestamp("us", tz="UTC"),
}
_SESSION_COLUMNS = ("session_id", "task_id", "source", "client", "user_agent")
_STOP = object()
FRESH_MAX_BYTES = 48 << 20   # log bytes whose records wait for the loader in memory, at most
POSITION_KEY = "log_position"
WRITER_LOCK = ".writer.lock"   # in <db>.log/
# DuckDB 2.0 rewrites a table's last row group at each checkpoint (leaving its old blocks
# free in the file), and each commit's WAL for a list column grows with the rows appended
# to that row group since the last checkpoint. Small row groups bound both. Data not yet
# checkpointed stays in DuckDB's memory (and a reopened file replays its WAL there), so the
# memory limit stays well above the checkpoint threshold: at 64 MB against a 256 MB WAL,
# every load failed out of memory. One thread: the proxy's own work needs the CPUs.
ROW_GROUP_ROWS = 2048
LOADER_SETTINGS = ("SET threads = 1", "SET memory_limit = '256MB'",
                   "SET checkpoint_threshold = '32MB'")


class CallWriter:
    def __init__(self, db_path: str | os.PathLike, *, lock_timeout: float = 10.0,
                 load_interval: float = 0.2, poll: float = 0.03):
        self.db_path = str(db_path)
        self.lock_timeout = lock_timeout
        self.load_interval = load_interval
        self.poll = poll
        self.salt = ""
        self._queue: queue.Queue = queue.Queue()
        self._seq: dict[str, int] = {}
        self._log: LogAppender | None = None
        self._position = Position()
        self._appended = 0                 # lines appended but maybe not loaded yet
        self._loaded_upto = 0
        self._deltas = DeltaCache()       # the loader's recent calls per session
        self._fresh: collections.deque = collections.deque()   # (start, end, records, bytes) appended
        self._fresh_count = 0
        self._fresh_lock = threading.Lock()
        self._con = None                  # the loader's connection, while calls keep coming
        self._lock_fd: int | None = None
        self.idle_release = 2.0           # seconds without calls before it lets go
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
            lines, nxt = read_lines(directory, pos)
            for line in lines:
                entry = _loads(line)
                if entry:
                    sid = entry["s"]["session_id"]
                    self._seq[sid] = max(self._seq.get(sid, 0), entry["r"]["seq"])
            self._appended += len(lines)
            if nxt == pos:
                break
            pos = nxt
        self._log = LogAppender(directory, after=self._position.seg)
        marker = readers_dir(self.db_path) / LOADER_FILE
        marker.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
        self._log_thread.start()
        self._load_thread.start()
        self._wake.set()
        return self

    def submit(self, session: dict, record: dict) -> concurrent.futures.Future:
        """session: {session_id, task_id, source, client, user_agent}; record: call columns
        (seq is assigned here; `_t0`, the call's perf_counter start, fills total_ms). The
        future's result is the call's seq, once its record is durable."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((session, record, fut, time.perf_counter()))
        return fut

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
                    for *_, fut, _ in batch:
                        _resolve(fut, exc=e)

    def _append(self, batch: list) -> None:
        lines, entries, done = [], [], []
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
            entry = {"s": session, "r": _jsonable(rec)}
            try:
                line, marked = _dumps({"s": session, "r": _fragments(entry["r"])})
            except Exception as e:
                _resolve(fut, exc=e)
                continue
            if marked:
                entry = orjson.loads(line)   # what the loader stores is what the log says
            self._seq[sid] = seq
            lines.append(line)
            entries.append(entry)
            done.append((fut, seq, rec.get("call_id"), t0))
        if not lines:
            return
        # On failure (disk full) the batch's futures fail; the numbers it took leave a gap.
        data = b"".join(lines)
        start, end = self._log.append(data)
        with self._fresh_lock:
            self._fresh.append((start, end, entries, len(data)))
            self._fresh_count += len(data)
            if self._fresh_count > FRESH_MAX_BYTES:   # the loader is held up: it reads the log
                self._fresh.clear()
                self._fresh_count = 0
        self.batches += 1
        self._appended += len(lines)
        acked = time.perf_counter()
        if len(self._ack_ms) > 100_000:   # stamps of lines the loader read before their fsync
            self._ack_ms.clear()
        for fut, seq, call_id, t0 in done:
            if t0 is not None and call_id:   # what the harness waited for, fsync included
                self._ack_ms[call_id] = (acked - t0) * 1000
            _resolve(fut, result=seq)

    # ---- the loader thread ---------------------------------------------------------------

    def _run_loader(self) -> None:
        last = 0.0
        while True:
            self._wake.wait(self.poll)
            self._wake.clear()
            if self._stopping.is_set():
                self._final_load()
                return
            pending = self._appended - self._loaded_upto
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
            if pending and (time.monotonic() - last >= self.load_interval or pending >= 5000):
                self._load_pending(timeout=0.05)
                last = time.monotonic()
            elif self._con is not None and time.monotonic() - last >= self.idle_release:
                self._release()   # idle: other tools may open the file directly

    def _final_load(self) -> None:
        deadline = time.monotonic() + self.lock_timeout
        while self._appended > self._loaded_upto and time.monotonic() < deadline:
            if not self._load_pending(timeout=max(0.05, deadline - time.monotonic())):
                time.sleep(0.05)
        self._release()

    def _release(self) -> None:
        """Close the file (DuckDB checkpoints on close), so another process can open it."""
        if self._con is not None:
            con, self._con = self._con, None
            try:
                con.close()
            except Exception:
                log.exception("polar: closing the database failed")

    def _load_pending(self, timeout: float) -> bool:
        """Load what was appended up to now (not what keeps coming meanwhile, so a reader
        that asked is answered under any load); True when it all is in the database."""
        target = self._appended
        try:
            while self._loaded_upto < target:
                entries, nxt = self._take_fresh()
                n = len(entries) if entries is not None else 0
                if entries is None:      # not appended by this process, or not handed over
                    lines, nxt = read_lines(log_dir(self.db_path), self._position, max_bytes=16 << 20)
                    if nxt == self._position:
                        self._loaded_upto = target   # unreadable lines, counted but skipped
                        break
                    n = len(lines)
                    entries = [e for e in map(_loads, lines) if e]
                self._load(entries, nxt, timeout)
                self._loaded_upto += n
            return True
        except StoreBusy:
            return False          # someone else holds the file; the log keeps the calls
        except Exception:
            self.load_errors += 1
            log.exception("polar: loading the call log into DuckDB failed; will retry")
            return False

    def _take_fresh(self) -> tuple[list[dict] | None, Position]:
        """Records this process appended right after the loaded position, as the log thread
        handed them over: no need to read and parse them back from the log."""
        with self._fresh_lock:
            while self._fresh and self._fresh[0][1] <= self._position:
                self._fresh_count -= self._fresh.popleft()[3]
            if not self._fresh or self._fresh[0][0] != self._position:
                return None, self._position
            entries, end = [], self._position
            while self._fresh and self._fresh[0][0] == end and len(entries) < 2000:
                start, end, batch, size = self._fresh.popleft()
                self._fresh_count -= size
                entries += batch
            return entries, end

    def _load(self, entries: list[dict], nxt: Position, timeout: float) -> None:
        # The file stays open while calls keep coming: each close is a checkpoint, and a
        # checkpoint rewrites the table's last row group (time, and free blocks in the
        # file). Readers ask, and get it at once; see _run_loader.
        if self._con is None:
            self._con = connect(self.db_path, timeout=timeout, row_group_size=ROW_GROUP_ROWS)
            for setting in LOADER_SETTINGS:
                self._con.execute(setting)
        try:
            load_entries(self._con, entries, nxt, self._deltas, self._ack_ms)
        except BaseException:
            self._deltas = DeltaCache()   # it may name calls that were rolled back
            self._release()
            raise
        self._position = nxt
        self.loads += 1
        drop_loaded(log_dir(self.db_path), nxt, keep_from=self._log.seg if self._log else nxt.seg)


def load_entries(con, entries: list[dict], nxt: Position, deltas: DeltaCache | None = None,
                 ack_ms: dict[str, float] | None = None) -> None:
    """One transaction: the calls of these log records (each once: call_id is the key), each
    stored as a delta against a call of its session in `deltas`, and the log position after
    them. `ack_ms` has the total_ms of calls this process acknowledged (taken once used)."""
    sessions = {}
    for e in entries:
        sessions.setdefault(e["s"]["session_id"], e["s"])
    deltas = deltas if deltas is not None else DeltaCache(budget=0)
    rows = [_stored_row(e, deltas) for e in entries]
    for row in rows:
        if ack_ms and row.get("call_id") in ack_ms:
            row["total_ms"] = ack_ms.pop(row["call_id"])
    cols = ", ".join(RECORD_COLUMNS)
    con.execute("BEGIN")
    try:
        if entries:
            con.register("session_table", pa.table(
                {c: pa.array([s.get(c) for s in sessions.values()], type=pa.string()) for c in _SESSION_COLUMNS}))
            con.register("call_table", _to_arrow(rows))
            con.execute("INSERT INTO sessions (session_id, task_id, source, client, user_agent) "
                        "SELECT * FROM session_table ON CONFLICT DO NOTHING")
            con.execute(f"INSERT INTO call_records ({cols}) SELECT {cols} FROM call_table "
                        "ON CONFLICT DO NOTHING")
        con.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    [POSITION_KEY, nxt.encode()])
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise
    finally:
        for name in ("session_table", "call_table"):
            try:
                con.unregister(name)
            except Exception:
                pass


def _stored_row(entry: dict, deltas: DeltaCache) -> dict:
    """A log record as call_records stores it: request text and prompt ids as deltas."""
    rec, sid = entry["r"], entry["s"]["session_id"]
    text = rec.get("request_text")
    text = text if isinstance(text, str) else ""
    prompt = rec.get("prompt_token_ids")
    prompt = ids_json(prompt) if isinstance(prompt, (list, bytes)) else None
    d = deltas.delta(sid, text, prompt)
    deltas.add(sid, rec["call_id"], text, prompt, rec.get("token_ids"))
    return rec | {"session_id": sid, "created_at": rec.get("created_at") or time.time(),
                  "base_call": d.base_call, "request_prefix": d.request_prefix,
                  "request_suffix": d.request_suffix, "request_middle": d.request_middle,
                  "request_chars": len(text), "prompt_shared": d.prompt_shared,
                  "prompt_suffix": d.prompt_suffix.decode() if d.prompt_suffix is not None else None,
                  "prompt_len": count_ids(prompt) if prompt is not None else None}


def catch_up(db_path: str | os.PathLike, timeout: float = 30.0) -> int:
    """Load what a proxy acknowledged but did not load (it was killed, or its file was
    copied here). Only when no proxy is loading this log; returns the lines loaded."""
    directory = log_dir(db_path)
    if not directory.exists():
        return 0
    loaded = 0
    con = connect(db_path, timeout=timeout)
    try:
        while True:
            row = con.execute("SELECT value FROM meta WHERE key = ?", [POSITION_KEY]).fetchone()
            pos = Position.decode(row[0] if row else None)
            lines, nxt = read_lines(directory, pos)
            if nxt == pos:
                return loaded
            load_entries(con, [e for e in map(_loads, lines) if e], nxt)
            loaded += len(lines)
    finally:
        con.close()


def _resolve(fut: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass   # cancelled by its waiter meanwhile


def _dumps(entry: dict) -> tuple[bytes, bool]:
    """The log line, and whether a column too deep to write was marked in it."""
    try:
        return orjson.dumps(entry) + b"\n", False
    except orjson.JSONEncodeError:
        pass
    # orjson writes at most 254 levels of nesting (it reads 1024). The gateway keeps such a
    # body as its raw text; anything else that deep is marked rather than fail the call.
    rec = dict(entry["r"])
    for col in JSON_COLUMNS:
        value = rec.get(col)
        if value is None:
            continue
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError:
            rec[col] = {"polar_unstored": "nested too deeply to store"}
    return orjson.dumps({"s": entry["s"], "r": rec}) + b"\n", True


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


def _fragments(rec: dict) -> dict:
    """Id lists carried as JSON text go into the log line as they are."""
    if any(isinstance(v, bytes) for v in rec.values()):
        return {k: orjson.Fragment(v) if isinstance(v, bytes) else v for k, v in rec.items()}
    return rec


def _json_text(value) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _to_arrow(rows: list[dict]) -> pa.Table:
    arrays = {}
    for col in RECORD_COLUMNS:
        values = [r.get(col) for r in rows]
        if col in JSON_COLUMNS:
            values = [_json_text(v) for v in values]
        elif col in ("started_at", "created_at"):
            values = [datetime.fromtimestamp(v, timezone.utc) if isinstance(v, (int, float)) else v
                      for v in values]
        arrays[col] = pa.array(values, type=_ARROW_TYPES.get(col, pa.string()))
    return pa.table(arrays)
