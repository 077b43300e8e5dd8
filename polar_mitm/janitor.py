"""Ends what a process started once that process is gone, however it went (SIGKILL too).

A process that starts services (mitmdump, vLLM) or runs harness sandboxes starts one janitor
(this file, run by itself), in a session of its own (a Ctrl-C to the parent's terminal
does not reach it), with a pipe from the parent that tells it what to end:

    group PGID START   a process group (START: its leader's start time, in clock ticks)
    forget PGID        that group was stopped by its owner
    mark PREFIX BORN   every process whose environment has an entry starting with PREFIX
                       (a sandbox's POLAR_SANDBOX=...), started BORN seconds after boot or later

When the pipe closes (the parent exited, or was killed: the kernel closes its end), the
janitor sends SIGTERM to each group, SIGKILL to what is left after a grace period, ends the
marked processes, and exits. The harness leader's own PDEATHSIG (netbridge.die_with_parent)
only reaches the leader; the janitor ends the tool processes it spawned as well.
Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 20.0   # what a service gets to stop on SIGTERM (mitmdump's final load, vLLM), as Service.stop
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- the parent's side --------------------------------------------------------------------

class Janitor:
    """The parent's pipe to its janitor. Best effort: if it cannot be started or written
    to, the parent runs on as before (its own stop() and teardown still end everything)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid = os.getpid()
        try:
            # -I: this file alone, standard library only (no package import, no PYTHONPATH)
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
        except OSError:
            self._proc = None

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.stdin is None:
                return
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except (OSError, ValueError):
                self._proc = None

    def watch_group(self, pgid: int) -> None:
        self._send(f"group {pgid} {start_ticks(pgid)}")

    def forget_group(self, pgid: int) -> None:
        self._send(f"forget {pgid}")

    def watch_marks(self, prefix: str, born: float) -> None:
        if any(c.isspace() for c in prefix):
            raise ValueError(f"a mark prefix has no spaces: {prefix!r}")
        self._send(f"mark {prefix} {born}")

    def close(self) -> None:
        """Ends everything still registered now (as the parent's death would)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
            proc.wait()


_janitor: Janitor | None = None
_janitor_lock = threading.Lock()


def janitor() -> Janitor:
    """This process's janitor, started on first use (again in a forked child)."""
    global _janitor
    with _janitor_lock:
        if _janitor is None or _janitor._pid != os.getpid():
            _janitor = Janitor()
        return _janitor


# ---- processes ---------------------------------------------------------------------------

def start_ticks(pid: int) -> int:
    """When the process started, in clock ticks since boot (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def uptime() -> float:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def is_user_process(pid: str, born: float = 0.0) -> bool:
    """A live process that is not a kernel thread (kernel threads and zombies have no
    environment, for good) and started `born` seconds after boot or later."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (fields[0] not in (b"Z", b"X") and not int(fields[6]) & 0x00200000   # PF_KTHREAD
                and int(fields[19]) / _CLK_TCK >= born - 1.0)
    except (OSError, ValueError, IndexError):
        return False


def kill_marked(prefix: str | list[str], born: float = 0.0) -> None:
    """SIGKILL every process with an environment entry starting with `prefix` (or any of
    them; also those that left their process group). Several passes: a process caught
    mid-exec shows an empty environment for an instant, and a fork can land between two
    reads."""
    needles = tuple(p.encode() for p in ([prefix] if isinstance(prefix, str) else prefix))
    if not needles:
        return
    me = str(os.getpid())
    quiet, deadline = 0, time.monotonic() + 5.0
    pauses = iter((0.0, 0.02, 0.05, 0.1, 0.2))
    # until two clean passes in a row; a process that stays unreadable (an exec slowed down
    # by a loaded machine) keeps it looking, up to the deadline
    while time.monotonic() < deadline:
        time.sleep(next(pauses, 0.25))
        found = unsure = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or entry.name == me:
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    env = f.read()
                if not env:   # mid-exec, if it is one of ours (started after the mark)
                    unsure = unsure or is_user_process(entry.name, born)
                    continue
                if any(e.startswith(needles) for e in env.split(b"\0")):
                    os.kill(int(entry.name), signal.SIGKILL)
                    found = True
            except (OSError, ValueError):
                continue
        quiet = 0 if (found or unsure) else quiet + 1
        if quiet == 2:    # two clean passes in a row
            return


def group_alive(pgid: int) -> bool:
    """Whether any process of the group lives (a zombie still counts)."""
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def end_groups(groups: dict[int, int], grace: float = GRACE_S) -> None:
    """SIGTERM each group, SIGKILL what is left after `grace` seconds. A group whose
    leader's pid now belongs to a newer process is not ours any more and is left alone (a
    pgid is not reused while any process of the group lives)."""
    ours = [g for g, start in groups.items() if start_ticks(g) in (0, start)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        live = [g for g in ours if group_alive(g)]
        for g in live:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            time.sleep(0.1)
            live = [g for g in live if group_alive(g)]
        if not live:
            return


# ---- the janitor's side ------------------------------------------------------------------

def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)   # it outlives its parent on purpose
    groups: dict[int, int] = {}
    marks: list[tuple[str, float]] = []
    for raw in sys.stdin.buffer:             # until the parent's end of the pipe closes
        parts = raw.decode(errors="replace").split()
        try:
            if parts[0] == "group":
                groups[int(parts[1])] = int(parts[2])
            elif parts[0] == "forget":
                groups.pop(int(parts[1]), None)
            elif parts[0] == "mark":
                marks.append((parts[1], float(parts[2])))
        except (IndexError, ValueError):
            continue
    end_groups(groups)
    if marks:
        kill_marked([prefix for prefix, _ in marks], min(born for _, born in marks))


if __name__ == "__main__":
    main()
