"""Who loads a call log, and which database it belongs to.

- One loader per log, held by a lock file (flock) in `<db>.log/`: a second loader would
  delete a live writer's segments once it had loaded past them. The proxy's writer holds it
  while it runs; a reader catches up a killed proxy's log only while nobody holds it.
- A log records the id of its database (`<db>.log/.owner`, written durably before any
  line). A database deleted and made anew under the same name has a new id, so the old
  log's calls are set aside rather than loaded into it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .meta import meta_value

log = logging.getLogger("polar")

DB_ID_KEY = "db_id"            # in meta: the id of the database, made once
WRITER_LOCK = ".writer.lock"   # in <db>.log/: held by whoever loads this log
OWNER_FILE = ".owner"          # in <db>.log/: the db_id of the database the log belongs to


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


def hold_writer_lock(directory: Path, timeout: float, live_writer: Callable[[], bool]) -> int | None:
    """The log's writer lock, held through the fd returned until it is closed (or the
    process dies); None when a live writer holds it (live_writer() says whether one runs),
    or someone held it for all of `timeout`. A reader catching up a killed proxy's log holds
    the lock for a while: it is waited for."""
    deadline = time.monotonic() + timeout
    while True:
        with writer_lock(directory) as fd:
            if fd is not None:
                return os.dup(fd)   # the dup shares the lock; it outlives the with
        if live_writer() or time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def log_owner(directory: Path) -> str | None:
    try:
        return (directory / OWNER_FILE).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def claim_log(directory: Path, db_id: str) -> None:
    """Record that this log belongs to the database `db_id` (durably: before any line)."""
    write_durably(directory, OWNER_FILE, db_id)


def write_durably(directory: Path, name: str, text: str) -> None:
    """directory/name holds text, whole or not at all, after a crash too (0600): written to a
    temporary file of this writer's own, fsynced, renamed over, the directory fsynced."""
    tmp = directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / name)
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


def is_log_of(con, directory: Path) -> bool:
    """Whether the log belongs to the database open on `con` (one with no id yet takes a
    log that has no owner either)."""
    db_id = meta_value(con, DB_ID_KEY)
    return owns_log(directory, db_id, legacy_ok=db_id is None)


def adopt_log(con, directory: Path) -> None:
    """Make the log the database's, before its writer appends to it. A database older than
    log owners gets its id now; a log left by another database of this name (deleted, then
    made anew) is set aside: it would add its calls here."""
    db_id = meta_value(con, DB_ID_KEY)
    had_id = db_id is not None
    if db_id is None:
        db_id = os.urandom(16).hex()
        con.execute("INSERT INTO meta VALUES (?, ?)", [DB_ID_KEY, db_id])
    if not owns_log(directory, db_id, legacy_ok=not had_id):
        set_aside(directory, "belongs to another database of this name")
    claim_log(directory, db_id)


def set_aside(directory: Path, why: str) -> Path:
    """Move a log that is not this database's out of the way (kept, never loaded here)."""
    aside = directory.with_name(f"{directory.name}.stray-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    aside.mkdir(mode=0o700)
    for p in [*log_segments(directory), directory / OWNER_FILE]:
        if p.exists():
            os.replace(p, aside / p.name)
    log.warning("polar: the call log %s %s; moved to %s, not loaded", directory, why, aside)
    return aside
