"""The proxy's writer: calls are acknowledged after a durable append to the call log, and a
loader thread moves the log into DuckDB in bulk, off the request path.

- submit() hands a record (records.py) to the log thread and returns a future. The thread
  serializes each record on its own (one bad record fails only its own call), appends the batch to
  the log and fsyncs once for all of them (group commit), then resolves the futures with
  each call's sequence number. Records that arrive during an fsync share the next one.
- The loader thread wakes every few tens of milliseconds and loads (loader.py: exactly
  once, whatever fails when). While calls come it loads whole row groups, keeps the file
  open, and lets go of it when calls pause. When a reader of another process asks for the
  file (a request file in `<db>.readers/`), the loader first loads everything pending, so
  the reader sees every acknowledged call, then leaves the file alone until the reader is
  done. Calls never wait on DuckDB, whoever holds it, for however long, or however often
  loading fails: the log keeps them, and the loader retries with backoff.

Threads: the log thread owns the numbering and the delta cache; the loader thread owns the
Loader (its counters are only read elsewhere). What the log thread has made durable (how
far, how many lines, when) and the acknowledgement times are shared by the two, always
under a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import asdict
from typing import Any, NamedTuple

from .calllog import LogAppender, Position, log_dir, read_lines
from .db import (LOADER_FILE, READY_SUFFIX, StoreBusy, init_db, loader_running, pending_requests,
                 readers_dir, writing)
from .delta import DeltaCache
from .lines import dumps, jsonable, loads, stored_row
from .ack_times import AckTimes
from .calllog_owner import adopt_log, hold_writer_lock
from .load_batch import ROW_GROUP_ROWS, stored_position
from .loader import Loader, LoaderConfig
from .records import CallRecord, SessionInfo

log = logging.getLogger("polar")

_STOP = object()
# Consecutive failed loads after which the proxy says so loudly (and health says degraded).
LOUD_FAILURES = 3


_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Name the calling thread for the OS (/proc/PID/task/TID/comm, top -H), so the CPU
    of the log and the loader can be told from the event loop's (bench_gateway prints it)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass   # not Linux: the names are only a help


class _Submitted(NamedTuple):
    """A call on its way to the log thread."""
    session: SessionInfo
    record: CallRecord
    fut: concurrent.futures.Future | _LoopFuture
    queued: float            # perf_counter at submit: the wait for the log counts in queue_ms
    t0: float | None         # the call's perf_counter start: total_ms runs from it


class CallWriter:
    def __init__(self, db_path: str | os.PathLike, *, lock_timeout: float = 10.0,
                 load_interval: float = 60.0, poll: float = 0.03, loader: LoaderConfig | None = None):
        self.db_path = str(db_path)
        self.lock_timeout = lock_timeout
        # Calls are loaded a whole row group at a time (see loader.py), and the rest when a
        # reader asks (readers get every acknowledged call at once) or once the oldest has
        # waited load_interval seconds. The file is let go after idle_release without calls.
        self.load_interval = load_interval
        self.poll = poll
        self.salt = ""
        self.loader = Loader(db_path, loader)   # the loader thread's (others only read its counters)
        self._queue: queue.Queue[_Submitted | object] = queue.Queue()
        # The log thread's own:
        self._seq: dict[str, int] = {}
        self._log: LogAppender | None = None
        self._deltas = DeltaCache()       # recent calls per session
        # Written by the log thread, read by the loader thread (and health): under _shared.
        self._shared = threading.Lock()
        self._durable = Position()         # the log up to here is fsynced
        self._durable_lines = 0            # lines up to there since start (loaded: the loader's count)
        self._appends: deque[tuple[Position, float]] = deque()  # (end, monotonic time) of appends not loaded
        self._last_append = time.monotonic()
        self._log_seg = 0                  # the segment the log thread appends to
        self._ack_ms = AckTimes()          # call_id -> total_ms at its durable append (locks itself)
        self._lock_fd: int | None = None
        self.idle_release = 3.0           # seconds without calls before it lets go
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._log_thread = threading.Thread(target=self._run_log, name="polar-log", daemon=True)
        self._load_thread = threading.Thread(target=self._run_loader, name="polar-loader", daemon=True)
        self.batches = 0                   # fsynced log batches

    @property
    def loads(self) -> int:
        """Bulk loads into DuckDB."""
        return self.loader.loads

    @property
    def load_errors(self) -> int:
        """Loads that failed (each retried)."""
        return self.loader.errors

    def health(self) -> dict:
        """The loader's state for /_polar/health: ok, retrying, or failing (with why)."""
        return asdict(self.loader.health())

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> "CallWriter":
        directory = log_dir(self.db_path)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # One writer per database, held until close: a live proxy (its loader marker names
        # a live process) is refused at once.
        if self._lock_fd is None:
            self._lock_fd = hold_writer_lock(directory, max(self.lock_timeout, 30),
                                             live_writer=lambda: loader_running(self.db_path))
            if self._lock_fd is None:
                raise StoreBusy(f"another proxy is already writing to {self.db_path}")
        self.salt = init_db(self.db_path, timeout=max(self.lock_timeout, 30))
        with writing(self.db_path, timeout=max(self.lock_timeout, 30)) as con:
            adopt_log(con, directory)
            position = stored_position(con)
            self._seq = dict(con.execute("SELECT session_id, max(seq) FROM call_records GROUP BY 1").fetchall())
        # Lines a previous run acknowledged but did not load yet count for the numbering.
        pos = position
        while True:
            lines, nxt = read_lines(directory, pos, max_bytes=self.loader.config.read_bytes)
            self._durable_lines += len(lines)
            for line in lines:
                entry = loads(line)
                if entry:
                    sid = entry["s"]["session_id"]
                    self._seq[sid] = max(self._seq.get(sid, 0), entry["r"]["seq"])
            if nxt == pos:
                break
            pos = nxt
        self.loader.position = position
        self._log = LogAppender(directory, after=position.seg)
        with self._shared:
            self._durable = pos
            if pos > position:
                self._appends.append((pos, time.monotonic()))
            self._log_seg = self._log.seg
        marker = readers_dir(self.db_path) / LOADER_FILE
        marker.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
        self._log_thread.start()
        self._load_thread.start()
        self._wake.set()
        return self

    def submit_async(self, session: SessionInfo, record: CallRecord, *,
                     t0: float | None = None) -> asyncio.Future[int]:
        """submit(), for an event loop: the log thread settles all of a batch's futures of
        one loop with a single wake-up of that loop (one self-pipe write per fsync, not
        one per call)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        self._queue.put(_Submitted(session, record, _LoopFuture(loop, fut), time.perf_counter(), t0))
        return fut

    def submit(self, session: SessionInfo, record: CallRecord, *,
               t0: float | None = None) -> concurrent.futures.Future[int]:
        """The future's result is the call's seq in its session (assigned here), once its
        record is durable. t0: the call's time.perf_counter() start, from which total_ms
        runs to the durable append."""
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._queue.put(_Submitted(session, record, fut, time.perf_counter(), t0))
        return fut

    @property
    def pending_lines(self) -> int:
        """Acknowledged calls not yet in the database."""
        with self._shared:
            durable_lines = self._durable_lines
        return durable_lines - self.loader.lines_loaded

    def _durable_end(self) -> Position:
        with self._shared:
            return self._durable

    def durable_end(self) -> Position:
        """How far the call log is fsynced: every acknowledged call is before it (shipping
        reads stop here, cluster/shipping.NodeShipper)."""
        return self._durable_end()

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
            batch: list[_Submitted] = []
            while True:
                if isinstance(item, _Submitted):
                    batch.append(item)
                else:   # _STOP
                    stopping = True
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                try:
                    self._append(batch)
                except BaseException as e:  # never let the thread die: fail this batch only
                    log.exception("polar: the call log failed")
                    _resolve_all([(item.fut, None, e) for item in batch])

    def _append(self, batch: list[_Submitted]) -> None:
        lines: list[bytes] = []
        done: list[tuple[_Submitted, int]] = []
        failed: list[tuple[Any, Any, BaseException | None]] = []
        now, wall = time.perf_counter(), time.time()
        for item in batch:
            if item.fut.done():       # its waiter went away (cancelled): nothing to record
                continue
            sid = item.session.session_id
            seq = self._seq.get(sid, 0) + 1
            rec = item.record.columns()
            if item.t0 is not None:   # until this batch's write; the fsync is added below
                rec["total_ms"] = (now - item.t0) * 1000
            rec["queue_ms"] = (rec["queue_ms"] or 0.0) + (now - item.queued) * 1000
            rec["seq"] = seq
            rec["created_at"] = wall     # recorded: when the call is acknowledged
            # Stored as a delta against an earlier call of its session, from here on: the
            # log line carries only what is new (a few KB where the request is 200 KB).
            row, full = stored_row(sid, jsonable(rec), self._deltas)
            try:
                line = dumps(item.session.columns(), row)
            except Exception as e:
                failed.append((item.fut, None, e))
                continue
            self._seq[sid] = seq
            lines.append(line)
            done.append((item, seq))
            # a later call of this batch may take this one as its base
            self._deltas.add(sid, item.record.call_id, *full)
        _resolve_all(failed)
        if not lines or self._log is None:
            return
        data = b"".join(lines)
        try:
            start, end = self._log.append(data)
        except BaseException:
            # On failure (disk full) the batch's futures fail and the numbers it took leave a
            # gap; calls it named as bases are not in the log, so nothing may refer to them.
            self._deltas = DeltaCache(self._deltas.budget, self._deltas.per_session)
            with self._shared:
                self._log_seg = self._log.seg   # it went on in a fresh segment
            raise
        acked = time.perf_counter()
        # What the harness waited for, fsync included: stamped before the lines are durable
        # for the loader, so it never loads one without its stamp.
        self._ack_ms.stamp([(item.record.call_id, (acked - item.t0) * 1000)
                            for item, _ in done if item.t0 is not None and item.record.call_id])
        appended = time.monotonic()
        with self._shared:
            self._durable = end
            self._durable_lines += len(lines)
            self._last_append = appended
            self._appends.append((end, appended))
            self._log_seg = self._log.seg
        self.batches += 1
        _resolve_all([(item.fut, seq, None) for item, seq in done])

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
            pending = self._durable_end() > self.loader.position
            readers = pending_requests(self.db_path)
            if readers:
                # Let the readers see every acknowledged call, tell them, then step aside.
                # A loader that keeps failing still lets them read what is in the file.
                if not pending or self._load_pending(timeout=1.0) or self.loader.failures:
                    self.loader.close()
                    for r in readers:
                        ready = r.with_name(r.name + READY_SUFFIX)
                        if not ready.exists() and r.exists():
                            ready.touch()
                continue
            now = time.monotonic()
            if pending and now >= retry_at:
                # Whole row groups as soon as there are some; the rest when a reader asks,
                # or once the oldest has waited load_interval (see loader.py for why).
                if self.pending_lines >= ROW_GROUP_ROWS:
                    ok = self._load_pending(timeout=0.05, whole_groups=True)
                elif now - self._oldest_pending() >= self.load_interval:
                    ok = self._load_pending(timeout=0.05)
                else:
                    ok = None
                if ok is not None:
                    # a failing load (a database that is unusable for now, a full disk) is
                    # retried less and less often; the log keeps every call meanwhile
                    backoff = 0.0 if ok else min(5.0, max(0.2, 2 * backoff))
                    retry_at = time.monotonic() + backoff
                    last_load = time.monotonic()
            with self._shared:
                last_append = self._last_append
            if self.loader.con is not None and now - max(last_append, last_load) >= self.idle_release:
                self.loader.close()   # calls paused: other tools may open the file directly

    def _oldest_pending(self) -> float:
        """When the oldest line not yet in the database was appended (monotonic)."""
        loaded = self.loader.position
        with self._shared:
            while self._appends and self._appends[0][0] <= loaded:
                self._appends.popleft()
            return self._appends[0][1] if self._appends else time.monotonic()

    def _final_load(self) -> None:
        deadline = time.monotonic() + self.lock_timeout
        while self._durable_end() > self.loader.position and time.monotonic() < deadline:
            if not self._load_pending(timeout=max(0.05, deadline - time.monotonic())):
                time.sleep(0.05)
        self.loader.close()

    def _load_pending(self, timeout: float, whole_groups: bool = False) -> bool:
        """Load what is durable up to now (not what keeps coming meanwhile, so a reader
        that asked is answered under any load); True when it all is in the database.
        whole_groups: only while the lines fill whole row groups."""
        with self._shared:
            lines_now, target = self._durable_lines, self._durable
        loader = self.loader
        try:
            loader.open(timeout)
            while loader.position < target:
                group = lines_now - loader.lines_loaded >= ROW_GROUP_ROWS
                if not group and whole_groups:
                    break
                if not loader.load(target, group=group, ack_ms=self._ack_ms):
                    stuck = RuntimeError(f"the call log cannot be read past {loader.position.encode()}")
                    loader.failed(stuck)
                    raise stuck
                with self._shared:
                    appending = self._log_seg
                loader.drop_loaded(keep_from=appending)
            loader.succeeded()
            return True
        except StoreBusy:
            return False          # someone else holds the file; the log keeps the calls
        except Exception:
            pass                  # the loader counted it, and dropped its connection
        if loader.failures >= LOUD_FAILURES:
            log.error("polar: loading the call log into DuckDB has failed %d times in a row (%s). "
                      "Calls are still acknowledged: they are durable in %s and load once the "
                      "database is usable again", loader.failures, loader.last_error, log_dir(self.db_path))
        else:
            log.warning("polar: loading the call log into DuckDB failed; will retry: %s", loader.last_error)
        return False


class _LoopFuture(NamedTuple):
    """An asyncio future and its loop, as the log thread holds it."""
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future[int]

    def done(self) -> bool:
        return self.fut.done()


def _resolve_all(items: list) -> None:
    """Settle (future, result, exception) triples: concurrent futures at once, asyncio
    futures with one call into each of their loops."""
    by_loop: dict = {}
    for fut, result, exc in items:
        if isinstance(fut, _LoopFuture):
            by_loop.setdefault(fut.loop, []).append((fut.fut, result, exc))
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
