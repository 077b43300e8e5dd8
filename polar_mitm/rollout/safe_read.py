"""Reading back what a session left, on the host, as the session could have left it: hostile.

A session's directories (workspace, HOME, TMPDIR, image layer) are the policy's to shape. A
path in them may be a symbolic link to any host file (the CA key, a reference fix), a FIFO
that blocks a reader forever, a device that never ends (/dev/zero), or a directory swapped
for a link between a check and an open. So the node never opens such a path by name:

- every component is opened relative to the previous one's directory fd with O_NOFOLLOW
  (a link anywhere on the way is refused, not followed), starting from a directory the node
  made itself (`base`);
- the last one with O_NONBLOCK (a FIFO does not block the open) and then checked with fstat
  to be a regular file;
- at most `limit` bytes are read (the head, or with tail=True the tail); what was cut is said.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LIMIT = 1 << 20


class UnsafePath(OSError):
    """The path is not a regular file reached without links (a link, a FIFO, a device, a
    directory, missing): the node will not read it."""


@dataclass(frozen=True)
class ReadBack:
    data: bytes
    size: int               # the file's size when it was read
    truncated: bool         # data holds only `limit` bytes of it


def _open_under(base: Path, relative: str) -> int:
    """An O_RDONLY fd on base/relative, every component opened without following links."""
    parts = [p for p in Path(relative).parts if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts) or os.path.isabs(relative):
        raise UnsafePath(f"{relative!r} is not a relative path below its base")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts[:-1]:
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY,
                       dir_fd=fd)
    except OSError as e:
        raise UnsafePath(f"{relative}: {os.strerror(e.errno) if e.errno else e} (links are not followed)") from None
    finally:
        os.close(fd)
    return leaf


def read_regular(base: Path | str, relative: str, limit: int = DEFAULT_LIMIT, tail: bool = False) -> ReadBack:
    """base/relative's bytes (at most limit), where it is a regular file reached without
    links; UnsafePath otherwise. base is a directory the node made (not the session)."""
    fd = _open_under(Path(base), relative)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{relative}: not a regular file")
        size = st.st_size
        if tail and size > limit:
            os.lseek(fd, size - limit, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return ReadBack(data=data, size=size, truncated=size > len(data))
    finally:
        os.close(fd)


def read_text(base: Path | str, relative: str, limit: int = DEFAULT_LIMIT, tail: bool = False) -> str:
    """read_regular, decoded (invalid UTF-8 replaced); "" where it is missing or unsafe."""
    try:
        return read_regular(base, relative, limit, tail).data.decode("utf-8", "replace")
    except UnsafePath:
        return ""
