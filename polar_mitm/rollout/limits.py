"""What one session may use of its node: memory, processes, CPU, open files, disk, its log.

`Limits` holds the values. A node has defaults (DEFAULTS, or its own: `--session-limit NAME=VALUE`,
LocalRuntime(limits=...)); a task may set any of them (`limits: {...}`), field by field over the
node's. They are enforced per sandbox:

- memory, processes, CPU: a cgroup (cgroups.py), memory with no swap and with the sandbox's
  tmpfs mounts (/tmp, /var/tmp, /dev/shm: sized to the memory limit too) charged to it;
- open files (RLIMIT_NOFILE) and the largest file (RLIMIT_FSIZE, at the disk limit): rlimits
  set by `launch_prefix`, the shell that also puts the command in its cgroup;
- disk (workspace, image layer, HOME, TMPDIR): `DiskWatch`, du in the session's own cgroup
  every second or so, the sandbox ended past the limit;
- the log of each run: `CappedLog`, its output through a pipe, kept under a size with its tail.

A sandbox that goes past its memory, processes or disk is ended at once, and its run says
which limit (`LimitHit`); one that prints past its log limit runs on (its log keeps the tail)
and its run says so as well. The node scores either as the policy's failure. CPU is
throttled, never ended; a process past its open files gets EMFILE, which no counter keeps: the
outcome is what the harness makes of it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import resource
import select
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class Limits:
    """Per session. The defaults fit a 2-core node running 8 sessions (4 RUN slots and the
    READY/INIT ones set up): each a ceiling, not a reservation."""
    # RAM of all its processes plus its tmpfs mounts, no swap. A Node.js harness takes
    # 200-400 MiB and the code under test (pytest of a mid-size project, a TypeScript build)
    # up to a GiB; 8 sessions at 2 GiB overcommit a small node, so the sandboxes' processes
    # are also the host OOM killer's first choice (oom_score_adj 1000), never the node.
    memory: int = 2 * GIB
    # processes and threads at once: a harness, a shell, a test runner and its workers use
    # tens; a fork loop stops here
    pids: int = 512
    # CPU: at most this many cores (a quota), and an equal share with the other sessions
    # when they compete (all together weigh as much as the node's own busy threads)
    cpus: float = 1.0
    # open files per process (soft and hard): Node.js with a language server uses hundreds
    nofile: int = 4096
    # its workspace, image layer, HOME and TMPDIR on the node's disk (and its largest file):
    # a cloned repository with a virtualenv fits in 1-2 GiB; 8 of them stay under 32 GiB
    disk: int = 4 * GIB
    # each run's output log (the harness's, the evaluator's): the tail is kept; 8 MiB is far
    # more than any harness prints, and what the node reads back of it is less
    log: int = 8 * MIB

    def merged(self, overrides: Mapping[str, Any] | None) -> "Limits":
        """These, with a task's own values (parse_limits' output) over them."""
        return dataclasses.replace(self, **dict(overrides or {}))

    def describe(self, name: str) -> str:
        value = getattr(self, name)
        return f"{value:g} CPUs" if name == "cpus" else size_text(value) if name in SIZES else str(value)


DEFAULTS = Limits()
SIZES = ("memory", "disk", "log")          # bytes ("512MiB", "2G", or an integer)
COUNTS = ("pids", "nofile")
NAMES = tuple(f.name for f in dataclasses.fields(Limits))
# The least each may be: a sandbox (bwrap, the bridge on the node's Python) needs some of each.
MINIMUM: dict[str, int | float] = {"memory": 32 * MIB, "pids": 16, "cpus": 0.01, "nofile": 64,
                                   "disk": 1 * MIB, "log": 64 * KIB}
_UNITS = {"": 1, "b": 1, "k": KIB, "m": MIB, "g": GIB, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def size_text(n: int) -> str:
    return f"{n / GIB:g} GiB" if n >= GIB and n % (GIB // 4) == 0 else f"{round(n / MIB, 1):g} MiB" \
        if n >= MIB else f"{round(n / KIB, 1):g} KiB"


def parse_size(value: Any, what: str) -> int:
    """Bytes: an integer, or a number with a binary unit (K, M, G, T, with or without "iB")."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a size (bytes, or like \"512MiB\", \"2G\"), not {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{what} must be a size (bytes, or like \"512MiB\", \"2G\"), not {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_limits(value: Any, where: str = "limits") -> dict[str, int | float]:
    """A limits object (a task's `limits`, a node's options) as its canonical values: sizes
    in bytes, counts as integers, cpus a number. Only the fields given; ValueError naming
    the field (`where.NAME`)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object with any of {', '.join(NAMES)}, not {value!r}"[:300])
    unknown = sorted(set(value) - set(NAMES))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(str, unknown))} (known: {', '.join(NAMES)})")
    out: dict[str, int | float] = {}
    for name in NAMES:
        if name not in value:
            continue
        v, what = value[name], f"{where}.{name}"
        if name in SIZES:
            n: int | float = parse_size(v, what)
        elif name in COUNTS:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{what} must be an integer, not {v!r}")
            n = v
        else:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{what} must be a number of CPUs (like 0.5 or 2), not {v!r}")
            n = float(v)
        if n < MINIMUM[name]:
            least = size_text(int(MINIMUM[name])) if name in SIZES else f"{MINIMUM[name]:g}"
            raise ValueError(f"{what} must be at least {least}, not {v!r}")
        out[name] = n
    return out


def parse_options(items: Sequence[str], where: str = "--session-limit") -> dict[str, int | float]:
    """NAME=VALUE items (a CLI's repeated option) as parse_limits' values."""
    raw: dict[str, Any] = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"{where} takes NAME=VALUE (NAME one of {', '.join(NAMES)}), not {item!r}")
        name, text = name.strip(), text.strip()
        if name in COUNTS:
            raw[name] = int(text) if re.fullmatch(r"\d+", text) else text
        elif name == "cpus":
            try:
                raw[name] = float(text)
            except ValueError:
                raw[name] = text
        else:
            raw[name] = text
    return parse_limits(raw, where)


@dataclass(frozen=True)
class LimitHit:
    """A limit a run went past: it was ended for it (or the OOM killer ended part of it)."""
    name: str          # memory | pids | disk
    reason: str        # what the session's outcome says


# -- starting a command inside its limits --------------------------------------------------

SH = "/bin/sh"


def launch_prefix(limits: Limits, cgroup_procs: Sequence[Path] = (), data_limit: bool = False) -> list[str]:
    """The command line's head that starts a sandbox inside its limits without a preexec_fn
    (Popen keeps using vfork): a shell, by its absolute path, that puts itself in the
    session's cgroups (their cgroup.procs files), makes itself the host OOM killer's first
    choice, sets the rlimits, and execs the rest. data_limit: no cgroup bounds its memory,
    so each process's data segment does (RLIMIT_DATA: heap and anonymous maps; address
    space reserved and never written, as V8's and Go's, is not counted)."""
    steps = [f"echo $$ > {shlex.quote(str(p))}" for p in cgroup_procs]
    steps += ["echo 1000 > /proc/self/oom_score_adj",
              f"ulimit -n {_within(resource.RLIMIT_NOFILE, limits.nofile)}",
              f"ulimit -f {_within(resource.RLIMIT_FSIZE, limits.disk) // 512}"]     # 512-byte blocks (POSIX)
    if data_limit:
        steps.append(f"ulimit -d {_within(resource.RLIMIT_DATA, limits.memory) // KIB}")
    return [SH, "-c", " && ".join(steps) + ' && exec "$@"', "sh"]


def _within(which: int, value: int) -> int:
    """value, or the node's own hard limit where that is lower and the node may not raise it
    (not root): the shell's ulimit would fail, and with it the run."""
    hard = resource.getrlimit(which)[1]
    if os.geteuid() != 0 and hard != resource.RLIM_INFINITY and hard < value:
        return hard
    return value


# -- disk --------------------------------------------------------------------------------------

DU = shutil.which("du", path="/usr/bin:/bin")


class DiskWatch:
    """The session's directory on the node (workspace, image layer, HOME, TMPDIR; its logs,
    which the node caps), measured by du (allocated blocks, each inode once, no link
    followed, this filesystem only). du runs as the node's, not in the session's cgroup: a
    session that keeps its own CPU busy must not slow its watcher down. One measurement at
    a time, every `interval` seconds, less often where one takes long (a tree of very many
    files: about a tenth of a core for du), and at least every MAX_INTERVAL seconds; at once
    where the filesystem's used space grew by more than the session had left (statvfs, at
    each look: a fast writer is caught within a look, not a measurement's interval)."""

    MAX_INTERVAL = 10.0

    def __init__(self, root: Path, limit: int, interval: float = 1.0):
        self.root, self.limit, self.interval = root, limit, interval
        self.used: int | None = None       # the last measurement, bytes
        self._proc: subprocess.Popen | None = None
        self._started = 0.0
        self._next = time.monotonic() + interval
        self._fs_used: int | None = None    # the filesystem's used bytes at the last measurement

    def due(self) -> float:
        """Seconds until the next measurement (0: now)."""
        if self._proc is None and self._grew():
            self._next = time.monotonic()
        return max(0.0, self._next - time.monotonic())

    def _fs(self) -> int | None:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _grew(self) -> bool:
        now = self._fs()
        if now is None or self._fs_used is None:
            self._fs_used = now
            return False
        return now - self._fs_used > self.limit - (self.used or 0)

    def poll(self) -> int | None:
        """Starts a measurement when one is due and none runs; the bytes used when one has
        finished (None meanwhile)."""
        now = time.monotonic()
        if self._proc is None:
            if self.due() == 0 and DU:
                self._start()
            return None
        if self._proc.poll() is None:
            if now - self._started > 60.0:         # a tree du cannot finish: look again later
                self._proc.kill()
                self._proc.wait()
                self._proc = None
                self._next = now + 10 * self.interval
            return None
        return self._collect(now)

    def measure(self, timeout: float = 30.0) -> int | None:
        """A measurement now (the one running, or a new one), waited for."""
        if not DU:
            return None
        if self._proc is None:
            self._start()
        assert self._proc is not None
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            return None
        return self._collect(time.monotonic())

    def over(self) -> bool:
        return self.used is not None and self.used > self.limit

    def hit(self) -> LimitHit:
        return LimitHit("disk", f"session exceeded its disk limit ({size_text(self.limit)}: workspace, image "
                                f"layer, HOME and TMPDIR): it held {size_text(self.used or 0)} when it was ended")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _start(self) -> None:
        assert DU is not None
        self._started = time.monotonic()
        self._fs_used = self._fs()
        # stdout to a pipe read once it exits: du prints one line
        self._proc = subprocess.Popen([DU, "-s", "-x", "-P", "-B1", str(self.root)],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}, cwd="/")

    def _collect(self, now: float) -> int | None:
        proc, self._proc = self._proc, None
        assert proc is not None
        out = proc.stdout.read() if proc.stdout else b""
        if proc.stdout:
            proc.stdout.close()
        took = now - self._started
        self._next = now + min(max(self.interval, 10 * took), self.MAX_INTERVAL)
        try:
            # du exits 1 where it could not read part of the tree; its total counts the rest
            self.used = int(out.split()[0])
        except (IndexError, ValueError):
            return None
        return self.used


# -- the log ---------------------------------------------------------------------------------

class CappedLog:
    """A run's output (stdout and stderr: `fd`, the write end of a pipe, for Popen) written to
    `path` by a thread of the node, the file kept under `cap` bytes: past it the file keeps
    its last half, after a line that says how much was dropped, and goes on. The thread reads
    at most `rate` bytes a second, so a flood costs the node little: the flooding process
    waits on its full pipe."""

    CHUNK = 64 * KIB

    def __init__(self, path: Path, cap: int, rate: int = 16 * MIB):
        self.path, self.cap, self.rate = path, cap, rate
        self.dropped = 0
        self._r, self.fd = os.pipe()
        # read too: the tail is read back to keep it. Unbuffered: what the thread read is in the
        # file at once, so the run's tail (an evaluator's reward line) is there even where the
        # thread is still draining a stray writer when the run's result is made
        self._file = open(path, "w+b", buffering=0)
        self._size = 0
        self._ending = threading.Event()
        self._thread = threading.Thread(target=self._pump, name=f"log-{path.name}", daemon=True)

    def started(self) -> None:
        """The command has its copy of the write end: the node's is closed (the reader sees
        the end once every process of the run has gone) and the reading starts."""
        os.close(self.fd)
        self.fd = -1
        self._thread.start()

    def close(self, grace: float = 2.0) -> None:
        """Once the run's processes are ended: what they wrote is read (for up to `grace`
        seconds more, where a stray process of an unsandboxed run still holds the pipe)."""
        if self.fd >= 0:            # never started
            os.close(self.fd)
            self.fd = -1
        if self._thread.ident is not None:
            self._grace = grace
            self._ending.set()
            self._thread.join(grace + 1.0)
        if not self._thread.is_alive():
            os.close(self._r)
            self._file.close()

    _grace = 2.0

    def hit(self) -> LimitHit:
        return LimitHit("log", f"session exceeded its log limit ({size_text(self.cap)}): it printed "
                               f"{size_text(self.dropped + self._size)}; its log keeps the tail")

    def _pump(self) -> None:
        poller = select.poll()
        poller.register(self._r, select.POLLIN)
        paid_until = time.monotonic()     # the bytes read so far are paid for, at `rate`, by then
        deadline: float | None = None
        while True:
            if self._ending.is_set():
                deadline = deadline or time.monotonic() + self._grace
                if time.monotonic() > deadline:
                    return
            if not poller.poll(200):
                if self._ending.is_set():
                    return      # quiet after the run ended: a stray process holds the pipe
                continue
            try:
                data = os.read(self._r, self.CHUNK)
            except OSError:
                return
            if not data:        # every writer has gone
                return
            try:
                self._write(data)
            except (OSError, ValueError):   # the file failed (a full disk): the pipe is still drained
                pass
            paid_until = max(paid_until, time.monotonic()) + len(data) / self.rate
            wait = paid_until - time.monotonic()
            if wait > 0.005:
                time.sleep(wait)

    def _write(self, data: bytes) -> None:
        f = self._file
        f.write(data)
        self._size += len(data)
        if self._size <= self.cap:
            return
        f.flush()
        keep = self.cap // 2
        fd = f.fileno()
        tail = os.pread(fd, keep, self._size - keep)
        self.dropped += self._size - len(tail) - self._marker_len
        head = (f"[polar: {self.dropped} earlier bytes of this log were dropped; it keeps its last "
                f"{size_text(self.cap)} at most]\n").encode()
        f.seek(0)
        f.write(head + tail)
        f.truncate()
        f.flush()
        self._size = len(head) + len(tail)
        self._marker_len = len(head)

    _marker_len = 0
