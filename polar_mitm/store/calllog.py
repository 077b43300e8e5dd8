"""The proxy's durable call log: append-only segments `<db>.log/NNNNNNNNNNNN.jsonl`, one
JSON record per line. A call is acknowledged once its line is fsynced here; the loader
(loader.py) moves lines into DuckDB later, and remembers how far it got inside the same
transaction, so every acknowledged call lands exactly once whatever crashes when.

A process appends only to a segment it created itself: after a crash the last segment may
end in a torn line (never acknowledged, since its fsync never returned), which readers of
the log skip, and nothing is ever appended after it. Who may load a log, and which database
it belongs to: calllog_owner.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

SEGMENT_BYTES = 32 << 20


def log_dir(db_path: str | os.PathLike) -> Path:
    return Path(f"{db_path}.log")


def segment_ids(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(n[:-6]) for n in names if n.endswith(".jsonl") and n[:-6].isdigit())


def segment_path(directory: Path, seg: int) -> Path:
    return directory / f"{seg:012d}.jsonl"


class Position(tuple):
    """(segment, byte offset): everything before it is in the database."""
    __slots__ = ()

    def __new__(cls, seg: int = 0, offset: int = 0):
        return super().__new__(cls, (seg, offset))

    def __getnewargs__(self) -> tuple[int, int]:
        # pickle (Ray) rebuilds a tuple subclass from these: tuple's own would nest it
        return (self.seg, self.offset)

    @property
    def seg(self) -> int:
        return self[0]

    @property
    def offset(self) -> int:
        return self[1]

    def encode(self) -> str:
        return f"{self.seg}:{self.offset}"

    @classmethod
    def decode(cls, text: str | None) -> "Position":
        if not text:
            return cls()
        seg, _, off = text.partition(":")
        return cls(int(seg), int(off))


class LogAppender:
    """Appends batches of lines to a fresh segment of its own, fsync per batch."""

    def __init__(self, directory: Path, after: int = 0):
        self.dir = directory
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.seg = max(segment_ids(directory) + [after]) + 1
        self._f: BinaryIO | None = None
        self._size = 0
        self._open()

    def _open(self) -> BinaryIO:
        if self._f:
            self._f.close()
        path = segment_path(self.dir, self.seg)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._f = f = os.fdopen(fd, "ab", buffering=0)
        self._size = 0
        dfd = os.open(self.dir, os.O_RDONLY)   # make the new file's name durable too
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return f

    def append(self, data: bytes) -> tuple[Position, Position]:
        """Writes and fsyncs; returns where the data starts and ends in the log."""
        # (self._f is None: a failed append could not open the next segment)
        f = self._f if self._f is not None else self._open()
        if self._size and self._size + len(data) > SEGMENT_BYTES:
            self.seg += 1
            f = self._open()
        start = Position(self.seg, self._size)
        try:
            view = memoryview(data)
            while view:
                n = f.write(view)
                view = view[n:]
            os.fsync(f.fileno())
        except BaseException:
            # A partial write (disk full) must not be followed by the next batch, glued to
            # its half line: cut it off, and go on in a fresh segment whatever happens.
            try:
                os.ftruncate(f.fileno(), self._size)
            except OSError:
                pass
            self.seg += 1
            try:
                self._open()
            except OSError:
                self._f = None
            raise
        self._size += len(data)
        return start, Position(self.seg, self._size)

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


def read_lines(directory: Path, start: Position, max_bytes: int = 64 << 20,
               end: Position | None = None, max_lines: int | None = None) -> tuple[list[bytes], Position]:
    """Complete lines from `start` on (up to `end`, when given), about max_bytes at most
    (a longer line whole) and max_lines at most; returns them and the position after the
    last one. A torn last line of a segment that a newer segment follows was never
    acknowledged and is skipped."""
    lines: list[bytes] = []
    pos = start
    taken = 0
    ids = [s for s in segment_ids(directory) if s >= start.seg and (end is None or s <= end.seg)]
    for i, seg in enumerate(ids):
        offset = start.offset if seg == start.seg else 0
        want = max(max_bytes - taken, 1)
        if end is not None and seg == end.seg:
            want = min(want, end.offset - offset)
        try:
            with open(segment_path(directory, seg), "rb") as f:
                f.seek(offset)
                data = f.read(want)
                size = os.fstat(f.fileno()).st_size
                limit = end.offset if end is not None and seg == end.seg else size
                while b"\n" not in data and offset + len(data) < limit:
                    # a line longer than max_bytes: read on to its end, it loads whole
                    more = f.read(min(max(len(data), 1 << 20), limit - offset - len(data)))
                    if not more:
                        break
                    data += more
                at_eof = f.tell() >= size
        except FileNotFoundError:
            continue
        if len(data) > want and b"\n" in data:   # read on for one long line: that line alone
            data = data[:data.find(b"\n") + 1]
            at_eof = False
        cut = data.rfind(b"\n") + 1
        parts = data[:cut].split(b"\n")
        parts.pop()   # what follows the last newline
        if max_lines is not None and len(parts) > max_lines - len(lines):
            # the first lines only: cut after the newline of the last one taken
            cut = 0
            for part in parts[:max_lines - len(lines)]:
                cut += len(part) + 1
            parts = parts[:max_lines - len(lines)]
            at_eof = False
        lines += [line for line in parts if line]
        taken += cut
        pos = Position(seg, offset + cut)
        if (end is not None and seg == end.seg) or not at_eof or taken >= max_bytes \
                or (max_lines is not None and len(lines) >= max_lines):
            break
        if i + 1 < len(ids):
            # Only the newest segment is ever appended to, so an older one is finished: a
            # partial line at its end is torn by a crash, and was never acknowledged.
            pos = Position(ids[i + 1], 0)
    return lines, pos


def drop_loaded(directory: Path, position: Position, keep_from: int) -> None:
    """Delete segments wholly before `position` and older than the appender's `keep_from`."""
    for seg in segment_ids(directory):
        if seg < position.seg and seg < keep_from:
            try:
                os.unlink(segment_path(directory, seg))
            except FileNotFoundError:
                pass


def log_end(directory: Path) -> Position:
    """The end of the log as it is now (a torn last line included: reads stop before it)."""
    ids = segment_ids(directory)
    if not ids:
        return Position()
    try:
        return Position(ids[-1], os.path.getsize(segment_path(directory, ids[-1])))
    except FileNotFoundError:
        return Position(ids[-1], 0)
