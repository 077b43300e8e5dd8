"""A node's side of shipping its call log to another machine (store/shipping.py): the files
in `<db>.log/` that say which log it is, that shipping is on and how far the driver has it, and
the reads of complete lines. No database here: the local loader's garbage collection asks
gc_floor (loader.py), and that must not depend on the store's connections.

- `.ship_id`: the log's identity, random, made once: the driver keys its position by it. It
  records the database that owns the log (calllog_owner.py): a database made anew under the
  same name starts a log of its own, which gets a new identity (its lines start again at 0).
- `.shipping`: shipping is on. From then on the local loader drops no segment that the driver
  has not acknowledged (gc_floor), whatever it loaded itself.
- `.shipped`: how far the driver has acknowledged (identity and position). Only for garbage
  collection: it may lag the driver's stored position, never lead it.
All 0600, written atomically (a temporary file renamed, both fsynced)."""

from __future__ import annotations

import fcntl
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .calllog import Position, log_end, read_lines
from .calllog_owner import log_owner, write_durably

SHIP_ID = ".ship_id"
SHIPPING = ".shipping"
SHIPPED = ".shipped"
SHIP_LOCK = ".ship.lock"
LOG_ID = re.compile(r"[0-9a-f]{32}")   # an identity: 16 random bytes, hex
_NO_OWNER = "-"


@dataclass(frozen=True)
class Chunk:
    """Lines of one node's call log, from `start` to `end`: whole lines only (never a torn
    one), each ending in a newline, as they are in the log. tail: how far the log was read
    towards (its end, or its writer's durable end) when read; more: whole lines are left
    between end and tail (the read stopped at max_bytes)."""
    log_id: str
    start: Position
    end: Position
    lines: bytes
    count: int
    tail: Position
    more: bool

    def split(self) -> list[bytes]:
        return self.lines.split(b"\n")[:-1] if self.lines else []


def _read(directory: Path, name: str) -> str | None:
    try:
        return (directory / name).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """The shipping files of one log change under one lock (the node's threads and processes)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(directory / SHIP_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _recorded(directory: Path) -> tuple[str, str] | None:
    """The identity file's (identity, owner it was made for)."""
    parts = (_read(directory, SHIP_ID) or "").split()
    if len(parts) != 2 or not LOG_ID.fullmatch(parts[0]):
        return None
    return parts[0], parts[1]


def _current_id(directory: Path) -> str | None:
    """The log's identity if it still names this log, without making one. It does unless
    another database owns the log now than the one it was made for (a log with no owner
    ships nothing, see read_chunk, so an identity made before its owner keeps naming it)."""
    rec = _recorded(directory)
    if rec is None:
        return None
    owner = log_owner(directory)
    return rec[0] if owner is None or rec[1] in (owner, _NO_OWNER) else None


def log_identity(directory: Path) -> str:
    """The call log's stable random identity (made once, kept across restarts of the node on
    the same disk); a new one when another database has taken the log over."""
    with _locked(directory):
        rec = _recorded(directory)
        owner = log_owner(directory)
        current = _current_id(directory)
        if current is not None:
            if rec is not None and rec[1] == _NO_OWNER and owner is not None:
                write_durably(directory, SHIP_ID, f"{current} {owner}\n")   # its owner since
            return current
        new = os.urandom(16).hex()
        write_durably(directory, SHIP_ID, f"{new} {owner or _NO_OWNER}\n")
        return new


def enable_shipping(directory: Path) -> str:
    """Turn shipping on for this log (for good: a restarted node keeps it); returns the log's
    identity. From now on no segment is dropped before the driver has acknowledged it."""
    log_id = log_identity(directory)
    if not shipping_enabled(directory):
        with _locked(directory):
            write_durably(directory, SHIPPING, "1\n")
    return log_id


def shipping_enabled(directory: Path) -> bool:
    return (directory / SHIPPING).exists()


def shipped_mark(directory: Path) -> Position | None:
    """How far the driver has acknowledged this log (None: nothing yet, or for an older
    identity of the directory)."""
    parts = (_read(directory, SHIPPED) or "").split()
    if len(parts) != 2 or parts[0] != _current_id(directory):
        return None
    try:
        return Position.decode(parts[1])
    except ValueError:
        return None


def mark_shipped(directory: Path, end: Position, log_id: str | None = None) -> bool:
    """Record that the driver has everything before `end` (it has committed it). Only moves
    forward; an ack for another identity of the log (log_id) changes nothing. Returns whether
    the mark moved. An end past the log's end is no position of this log: ValueError."""
    end = Position(*end)
    with _locked(directory):
        current = _current_id(directory)
        if current is None or (log_id is not None and log_id != current):
            return False
        if end > log_end(directory):
            raise ValueError(f"{end.encode()} is past the end of the call log {directory}")
        old = shipped_mark(directory)
        if old is not None and end <= old:
            return False
        write_durably(directory, SHIPPED, f"{current} {end.encode()}\n")
        return True


def gc_floor(directory: Path, loaded: Position) -> Position:
    """Where segments may be dropped before: what the local database has, and with shipping
    on, what the driver has acknowledged too."""
    if not shipping_enabled(directory):
        return loaded
    return min(loaded, shipped_mark(directory) or Position())


def read_chunk(directory: Path, start: Position, max_bytes: int = 8 << 20,
               end: Position | None = None) -> Chunk:
    """The whole lines from `start` on, about max_bytes (a longer line whole), up to `end`
    (the writer's durable end, where the caller knows it: then only acknowledged calls) or
    the log's end now (then also a line whose fsync has not returned yet: a call that is
    stored at most once if its node's machine crashes, as a reader's catch-up would). A torn
    line is never in it. A log that no database owns yet ships nothing."""
    start = Position(*start)
    log_id = log_identity(directory)
    tail = Position(*end) if end is not None else log_end(directory)
    if log_owner(directory) is None or start >= tail:
        return Chunk(log_id, start, start, b"", 0, tail, False)
    lines, pos = read_lines(directory, start, max_bytes=max(1, max_bytes), end=tail)
    more = pos < tail and bool(read_lines(directory, pos, max_bytes=1, end=tail, max_lines=1)[0])
    return Chunk(log_id, start, pos, b"".join(line + b"\n" for line in lines), len(lines), tail, more)


def unshipped(directory: Path, upto: Position) -> bool:
    """Whether complete lines before `upto` are not acknowledged by the driver yet (a torn
    line at the end is no line: it never was acknowledged to anyone)."""
    mark = shipped_mark(directory) or Position()
    if mark >= upto or log_owner(directory) is None:
        return False
    return bool(read_lines(directory, mark, max_bytes=1, end=upto, max_lines=1)[0])
