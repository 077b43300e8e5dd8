"""A cgroup per session sandbox: its memory (no swap; its tmpfs pages are charged to it too),
its processes and its CPU, and what it hit, read from the cgroup's own counters on the host.

The node's cgroups go under its own (so a container's or a systemd unit's limits still hold
over them): `polar-PID/` for this process, one `s-ID/` below it per sandbox, removed at
teardown; a node killed before it could remove them has its `polar-PID/` removed by the next
node that starts (its processes ended first).

- v2 (the unified hierarchy, where it has the memory and pids controllers): memory.max and
  memory.swap.max 0, pids.max, cpu.max; hits from memory.events (oom_kill) and pids.events.
- v1 (separate hierarchies, as on these machines: the v2 mount there has no controllers):
  memory.limit_in_bytes and memory.memsw.limit_in_bytes, pids.max, cpu.cfs_quota_us; hits
  from memory.oom_control (oom_kill) and pids.events.
- neither (not root, no controllers mounted, no write access): no cgroups; `host()` says why
  and the runtime warns once, bounding memory and processes only by rlimits.

A process enters its cgroup by writing its own PID to cgroup.procs before it execs the sandbox
(limits.launch_prefix): the node never forks with a preexec_fn.
"""

from __future__ import annotations

import atexit
import errno
import functools
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .limits import LimitHit, Limits, size_text

log = logging.getLogger("polar.sandbox")

CONTROLLERS = ("memory", "pids", "cpu")
PREFIX = "polar-"                # a node process's own cgroup: polar-PID
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class Host:
    """Where this process makes its sessions' cgroups: version 2 (one directory), 1 (one per
    controller), or 0 (none: `why`)."""
    version: Literal[0, 1, 2]
    parents: dict[str, Path] = field(default_factory=dict)   # controller -> this process's polar-PID/
    why: str = ""

    @property
    def enabled(self) -> bool:
        return self.version != 0


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fstype, super options) of the cgroup mounts in /proc/self/mountinfo."""
    out = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or len(rparts) < 3 or rparts[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((parts[3], parts[4].replace("\\040", " "), rparts[0], set(rparts[2].split(","))))
    return out


def _own(proc_cgroup: str) -> dict[str, str]:
    """This process's cgroup per v1 controller (and "" for v2's) from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for c in parts[1].split(",") if parts[1] else [""]:
            out[c] = parts[2]
    return out


def _under(mount: str, root: str, path: str) -> Path:
    """The directory of cgroup `path` (as /proc/self/cgroup names it) under a mount of the
    hierarchy whose root is `root`."""
    rel = path[len(root):] if root != "/" and path.startswith(root) else path
    return Path(mount) / rel.lstrip("/")


def detect(mountinfo: str, proc_cgroup: str, pid: int) -> Host:
    """Where this process's sessions' cgroups go (made here: polar-PID under its own), from
    its mountinfo and cgroup files. v2 where the unified hierarchy has memory and pids, else
    v1 where memory and pids are mounted; Host(0, why) where neither can be written."""
    mounts, own = _mounts(mountinfo), _own(proc_cgroup)
    why = "no cgroup hierarchy with the memory and pids controllers is mounted"
    for root, mount, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        base = _under(mount, root, own[""])
        try:
            available = set((base / "cgroup.controllers").read_text().split())
        except OSError:
            continue
        if {"memory", "pids"} <= available:
            try:
                return Host(2, {c: _v2_parent(base, pid, available) for c in CONTROLLERS if c in available})
            except OSError as e:
                why = f"cgroup v2 at {base} cannot be delegated to: {e}"
                break
    v1 = {}
    for root, mount, fstype, opts in mounts:
        for c in CONTROLLERS:
            if fstype == "cgroup" and c in opts and c in own and c not in v1:
                v1[c] = _under(mount, root, own[c]) / f"{PREFIX}{pid}"
    if "memory" in v1 and "pids" in v1:
        try:
            for c, parent in v1.items():
                parent.mkdir(exist_ok=True)
                if c == "cpu" and (parent / "cpu.shares").exists():
                    # the sessions together weigh as much as the node's busy threads, one a core
                    (parent / "cpu.shares").write_text(str(1024 * (os.cpu_count() or 1)))
        except OSError as e:
            return Host(0, why=f"cgroup v1 at {parent.parent} cannot be written: {e}")
        return Host(1, v1)
    return Host(0, why=why)


def _v2_parent(base: Path, pid: int, available: set[str]) -> Path:
    """polar-PID under this process's cgroup with the controllers delegated to its children.
    A v2 cgroup with processes in it cannot delegate ("no internal processes"): this process
    first moves itself into a leaf of its own there."""
    wanted = " ".join(f"+{c}" for c in CONTROLLERS if c in available)
    try:
        (base / "cgroup.subtree_control").write_text(wanted)
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
        leaf = base / f"{PREFIX}{pid}-node"
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(pid))
        (base / "cgroup.subtree_control").write_text(wanted)
    parent = base / f"{PREFIX}{pid}"
    parent.mkdir(exist_ok=True)
    (parent / "cgroup.subtree_control").write_text(wanted)
    return parent


@functools.cache
def host() -> Host:
    """This process's sessions' cgroups (detected once), what a killed node left removed."""
    try:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
        with open("/proc/self/cgroup") as f:
            proc_cgroup = f.read()
    except OSError as e:
        return Host(0, why=f"/proc cannot be read: {e}")
    found = detect(mountinfo, proc_cgroup, os.getpid())
    if found.enabled:
        sweep(found)
        atexit.register(_remove_own, found)
    return found


def _remove_own(h: Host) -> None:
    """At exit: this process's polar-PID cgroups (what a session left in them ended)."""
    for parent in dict.fromkeys(h.parents.values()):
        try:
            children = [c for c in parent.iterdir() if c.is_dir()]
        except OSError:
            continue
        for d in [*children, parent]:
            _remove(d, tries=3)


def sweep(h: Host) -> None:
    """Remove the polar-PID cgroups beside this process's whose process is gone (a node that
    was killed), their processes ended first."""
    for parent in {p.parent for p in h.parents.values()}:
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for d in entries:
            name = d.name
            if not name.startswith(PREFIX) or not d.is_dir():
                continue
            pid = name[len(PREFIX):].removesuffix("-node")
            if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                continue
            for child in [c for c in d.iterdir() if c.is_dir()] + [d]:
                _remove(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _procs(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _remove(d: Path, tries: int = 20) -> bool:
    """rmdir a cgroup, its processes killed first (a session's: nothing else is in it)."""
    for _ in range(tries):
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY:
                return False
        for pid in _procs(d):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    log.warning("cgroup %s still has processes; it is left for the next start to remove", d)
    return False


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_keyed(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


class SessionCgroup:
    """One sandbox's cgroup (a directory per v1 controller, one in v2), made with its
    limits; `procs` are the files a process writes its PID to, to enter it."""

    def __init__(self, h: Host, limits: Limits, name: str | None = None):
        self.host, self.limits = h, limits
        name = name or f"s-{uuid.uuid4().hex[:12]}"
        self.dirs = {c: p / name for c, p in h.parents.items()}
        made: list[Path] = []
        try:
            for d in dict.fromkeys(self.dirs.values()):
                d.mkdir()
                made.append(d)
            self._configure()
        except OSError:
            for d in made:
                _remove(d)
            raise
        self._seen = self.events()

    @property
    def procs(self) -> list[Path]:
        return [d / "cgroup.procs" for d in dict.fromkeys(self.dirs.values())]

    def _configure(self) -> None:
        lim = self.limits
        mem, pids, cpu = self.dirs["memory"], self.dirs["pids"], self.dirs.get("cpu")
        if self.host.version == 2:
            (mem / "memory.max").write_text(str(lim.memory))
            if (mem / "memory.swap.max").exists():
                (mem / "memory.swap.max").write_text("0")
            (pids / "pids.max").write_text(str(lim.pids))
            if cpu is not None:
                (cpu / "cpu.max").write_text(f"{int(lim.cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
            return
        (mem / "memory.limit_in_bytes").write_text(str(lim.memory))
        try:    # memory + swap at the same limit: no swap (absent where swap is not accounted)
            (mem / "memory.memsw.limit_in_bytes").write_text(str(lim.memory))
        except FileNotFoundError:
            (mem / "memory.swappiness").write_text("0")
        (pids / "pids.max").write_text(str(lim.pids))
        if cpu is not None:
            (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(max(1000, int(lim.cpus * CPU_PERIOD_US))))

    def events(self) -> dict[str, int]:
        """Its counters: OOM kills, memory-limit hits, forks refused at pids.max."""
        mem, pids = self.dirs["memory"], self.dirs["pids"]
        if self.host.version == 2:
            m = _read_keyed(mem / "memory.events")
            return {"oom_kill": m.get("oom_kill", 0), "memory_max": m.get("max", 0),
                    "pids_max": _read_keyed(pids / "pids.events").get("max", 0)}
        return {"oom_kill": _read_keyed(mem / "memory.oom_control").get("oom_kill", 0),
                # either counter meets its limit first (memory + swap has the same one)
                "memory_max": (_read_int(mem / "memory.failcnt") or 0) + (_read_int(mem / "memory.memsw.failcnt") or 0),
                "pids_max": _read_keyed(pids / "pids.events").get("max", 0)}

    def hit(self) -> LimitHit | None:
        """The limit it went past since the last look, if any (memory before processes: a
        fork refused for want of memory is the memory's)."""
        now = self.events()
        new = {k: now[k] - self._seen.get(k, 0) for k in now}
        self._seen = now
        mib = size_text(self.limits.memory)
        if new["oom_kill"] > 0:
            # v1 kernels no longer count failcnt: its peak at the limit says it as well
            peak = self._peak()
            if new["memory_max"] > 0 or (peak is not None and peak >= self.limits.memory * 0.98):
                why = f"session exceeded its memory limit ({mib}): the OOM killer ended it"
            else:   # the host ran out, not the cgroup: its processes are the first the kernel ends
                why = (f"session was ended by the OOM killer when the node ran out of memory, within its "
                       f"memory limit ({mib})")
            return LimitHit("memory", why)
        if new["pids_max"] > 0:
            return LimitHit("pids", f"session exceeded its process limit ({self.limits.pids} processes and "
                                    f"threads): a fork was refused, and the session ended")
        return None

    def begin_run(self) -> None:
        """A run starts: its peaks (memory, processes) are its own from here (where the
        kernel lets them be reset)."""
        for f in ("memory.max_usage_in_bytes", "memory.peak"):
            try:
                (self.dirs["memory"] / f).write_text("0")
            except OSError:
                pass

    def _peak(self) -> int | None:
        mem = self.dirs["memory"]
        return _read_int(mem / ("memory.peak" if self.host.version == 2 else "memory.max_usage_in_bytes"))

    def usage(self) -> dict[str, float]:
        """What it used (peaks since it was made): for the session's stats."""
        pids, cpu = self.dirs["pids"], self.dirs.get("cpu")
        out: dict[str, float] = {}
        peak = self._peak()
        stat = _read_keyed(cpu / "cpu.stat") if cpu else {}
        if self.host.version == 2:
            throttled = stat.get("throttled_usec", 0) / 1e6
        else:
            throttled = stat.get("throttled_time", 0) / 1e9
        if peak is not None:
            out["memory_peak_mib"] = round(peak / (1 << 20), 1)
        pids_peak = _read_int(pids / "pids.peak")
        if pids_peak is not None:
            out["pids_peak"] = pids_peak
        if cpu is not None:
            out["cpu_throttled_s"] = round(throttled, 2)
        return out

    def kill_all(self) -> None:
        """SIGKILL whatever is still in it (the fallback sandbox's strays: setsid, daemons)."""
        for d in dict.fromkeys(self.dirs.values()):
            for pid in _procs(d):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove(self) -> None:
        for d in dict.fromkeys(self.dirs.values()):
            _remove(d)

