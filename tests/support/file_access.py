"""Who opened which file under a folder, seen by the kernel (fanotify, as root): each open's
path and the opening process's POLAR_TEST_NODE (the Ray node it belongs to, from its
environment, which every process of a test node inherits from its raylet)."""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from collections import defaultdict
from pathlib import Path

FAN_CLASS_NOTIF, FAN_CLOEXEC, FAN_NONBLOCK = 0, 1, 2
FAN_MARK_ADD, FAN_MARK_MOUNT = 1, 0x10
FAN_OPEN = 0x20
_EVENT = struct.Struct("IBBHQii")


def available() -> str | None:
    """None where fanotify works here, else why not."""
    try:
        fd = _init()
    except OSError as e:
        return str(e)
    os.close(fd)
    return None


def _init() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY | os.O_LARGEFILE)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fanotify_init: {os.strerror(e)}")
    return fd


class OpenWatch:
    """Every open under root (on its mount) while it runs: {node: {paths}}; node is the
    opener's POLAR_TEST_NODE ("" for processes of no test node, "?" when it exited first)."""

    def __init__(self, root: Path):
        self.root = str(Path(root).resolve())
        self.opens: dict[str, set[str]] = defaultdict(set)
        self._fd = _init()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
        if libc.fanotify_mark(self._fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN, -100, self.root.encode()) != 0:
            e = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(e, f"fanotify_mark: {os.strerror(e)}")
        self._nodes: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="open-watch")
        self._thread.start()

    def _node_of(self, pid: int) -> str:
        """The opener's test node: its own POLAR_TEST_NODE, else its nearest ancestor's (a
        session's processes have the sandbox's environment, their node's Python above them)."""
        if pid in self._nodes:
            return self._nodes[pid]
        chain, tag = [], None
        p = pid
        for _ in range(32):
            if p in self._nodes:
                tag = self._nodes[p]
                break
            try:
                env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
                ppid = int(Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                tag = "?" if p == pid else ""
                break
            chain.append(p)
            found = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"POLAR_TEST_NODE=")), None)
            if found is not None:
                tag = found
                break
            if ppid <= 1:
                tag = ""
                break
            p = ppid
        for q in chain:
            self._nodes[q] = tag or ""
        return tag or ""

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.2)
            if not ready:
                continue
            try:
                buf = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                continue
            off = 0
            while off + _EVENT.size <= len(buf):
                length, _, _, _, _, efd, pid = _EVENT.unpack_from(buf, off)
                off += length
                if efd < 0:
                    continue
                try:
                    path = os.readlink(f"/proc/self/fd/{efd}")
                finally:
                    os.close(efd)
                if path.startswith(self.root) and pid != os.getpid():
                    self.opens[self._node_of(pid)].add(path)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        os.close(self._fd)
