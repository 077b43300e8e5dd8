"""The rollout server's journal on disk: an append-only log first, DuckDB's rollout tables after.

A state change is durable once its batch is a line of a segment file in `<db>.journal/` and
fdatasync returned: a few milliseconds, whatever the history. Only then does the server
answer (a heartbeat, a submission), as it did when each batch was a DuckDB transaction.
Opening the database for every batch cost 0.1-3 s, and more as the file grew (the call
log's loader hands the file over, DuckDB checkpoints on close), on every heartbeat's path.

The server folds closed segments into the rollout tables every fold_s seconds or when asked
(rollout_journal.fold; no SQL here), in one
transaction that also records the last segment folded (meta 'journal_folded'); a segment is
deleted after its fold commits, and one that is still there but already folded is skipped,
so each batch lands exactly once. A crash mid-append leaves a last line without its newline:
it was never acknowledged, and is ignored. What a server killed -9 left unfolded is folded by
the next server at its start (or `polar-mitm sql` once no live server owns the log), and read
as an overlay by the journal's readers (rollout_journal.load) meanwhile.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TypedDict

import orjson

from .db import _pid_alive

log = logging.getLogger("polar.journal")

OWNER_FILE = ".owner"          # the pid of the server appending to the log
FOLDED_KEY = "journal_folded"  # meta: the last segment whose batches are in the tables
ROTATE_BYTES = 8 << 20         # a segment this big is closed even between folds


class TaskRow(TypedDict):
    task_id: str
    order: int | None            # submitted as the server's n-th task (None: saved before schema 9)
    spec: dict
    state: str
    priority: int
    callback_state: str | None
    callback_tries: int
    cancel_reason: str | None    # saved as its STOPPING event's detail (not a column)


class SessionStanding(TypedDict):
    """Where a rollout session stands: the task's sample it is an attempt at, its state, the
    node running it, its reward and why it ended (the columns every reader of it shares)."""
    task_id: str
    sample: int
    attempt: int
    state: str
    node_id: str | None
    reward: float | None
    reason: str | None


class SessionRow(SessionStanding):
    session_id: str
    stats: dict | None


class Event(TypedDict):
    at_us: int                   # unix microseconds: exact, so events keep their order in SQL
    task_id: str
    session_id: str | None
    state: str
    node_id: str | None
    detail: str | None


class Batch(TypedDict):
    tasks: list[TaskRow]         # latest row of each task changed since the last batch
    sessions: list[SessionRow]
    events: list[Event]


def log_dir(db_path: str | os.PathLike) -> Path:
    return Path(f"{db_path}.journal")


def seq(path: Path) -> int:
    return int(path.name.split(".", 1)[0])


def segments(directory: Path) -> list[Path]:
    """The segment files, oldest first."""
    try:
        return sorted((p for p in directory.iterdir() if p.name.endswith(".jsonl") and p.name[0].isdigit()),
                      key=seq)
    except FileNotFoundError:
        return []


def owner_alive(db_path: str | os.PathLike) -> bool:
    """Whether a live process appends to this database's journal log."""
    try:
        pid = (log_dir(db_path) / OWNER_FILE).read_text().strip()
    except OSError:
        return False
    return pid.isdigit() and _pid_alive(f"{pid}-")   # as the loader's pid file is read


def read_segment(path: Path) -> list[Batch]:
    """Its batches; a last line without its newline (a crash mid-append: never acknowledged)
    is left out, and so is a line that is not JSON (logged: it cannot be replayed)."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    out = []
    for n, line in enumerate(lines[:-1], 1):    # the part after the last newline: torn or empty
        if not line:
            continue
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            log.error("journal segment %s: line %d is not JSON; skipped", path, n)
    return out


def merge(batches: list[Batch]) -> Batch:
    """Batches in order as one: the latest row of each task and session, every event."""
    tasks: dict[str, TaskRow] = {}
    sessions: dict[str, SessionRow] = {}
    events: list[Event] = []
    for b in batches:
        for t in b["tasks"]:
            tasks.pop(t["task_id"], None)
            tasks[t["task_id"]] = t
        for s in b["sessions"]:
            sessions.pop(s["session_id"], None)
            sessions[s["session_id"]] = s
        events.extend(b["events"])
    return Batch(tasks=list(tasks.values()), sessions=list(sessions.values()), events=events)


def unfolded(db_path: str | os.PathLike, folded: int) -> tuple[list[int], list[Batch]]:
    """The segments after `folded` and their batches. A segment deleted while being read was
    folded meanwhile: FileNotFoundError, and the caller reads the database again."""
    seqs, batches = [], []
    for p in segments(log_dir(db_path)):
        if seq(p) > folded:
            batches += read_segment(p)
            seqs.append(seq(p))
    return seqs, batches


class JournalLog:
    """The server's side: append (durable on return), rotate (for a fold), close."""

    def __init__(self, db_path: str | os.PathLike, folded: int):
        """folded: the last segment folded into the database (rollout_journal.folded_through)."""
        self.db_path = str(db_path)
        self.dir = log_dir(db_path)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.dir / OWNER_FILE).write_text(str(os.getpid()))
        self._lock = threading.Lock()        # the active segment
        # numbered after every segment there and every one folded (those are deleted)
        last = segments(self.dir)
        self._next = max(seq(last[-1]) if last else 0, folded) + 1
        self._fd: int | None = None
        self._seq = 0
        self._bytes = 0
        self.closed = False

    def _open_segment(self) -> None:
        self._seq, self._next = self._next, self._next + 1
        path = self.dir / f"{self._seq:012d}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._bytes = 0
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)     # the new name survives a crash too
        finally:
            os.close(dfd)

    def _close_segment(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def append(self, batch: Batch) -> None:
        """One line, durable when this returns."""
        line = orjson.dumps(batch) + b"\n"
        with self._lock:
            if self.closed:
                raise RuntimeError("the journal log is closed")
            if self._fd is None or self._bytes >= ROTATE_BYTES:
                self._close_segment()
                self._open_segment()
            assert self._fd is not None
            try:
                view = memoryview(line)
                while view:
                    n = os.write(self._fd, view)
                    view = view[n:]
                os.fdatasync(self._fd)
            except BaseException:
                # A part-written line stays this segment's last, unterminated, so it is never
                # read; the next append goes to a new segment, not after it.
                self._close_segment()
                raise
            self._bytes += len(line)

    def rotate(self) -> int | None:
        """Close the active segment if it holds anything (the next append opens another);
        returns the number of the one still open (None: none), which a fold leaves alone."""
        with self._lock:
            if self._fd is not None and self._bytes:
                self._close_segment()
            return self._seq if self._fd is not None else None

    def close(self) -> None:
        """Stop appending (the owner file goes: nobody appends now)."""
        with self._lock:
            self._close_segment()
            self.closed = True
        try:
            if (self.dir / OWNER_FILE).read_text().strip() == str(os.getpid()):
                (self.dir / OWNER_FILE).unlink()
        except OSError:
            pass
