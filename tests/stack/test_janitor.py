"""A process that dies without cleaning up (SIGKILL) takes what it started with it: the
services it launched (mitmdump, vLLM) and every process of every harness sandbox it ran,
including tool processes that left the harness's process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from polar_mitm.janitor import Janitor
from support.procs import alive as _alive, token as _token, until as _until

ROOT = str(Path(__file__).resolve().parents[2])


def _parent(script: str, tmp_path: Path) -> subprocess.Popen:
    """A Python process running script, started once it printed 'ready'."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_killed_parent_stops_its_services_with_sigterm_first(tmp_path):
    n = _token()
    flag = tmp_path / "got-sigterm"
    parent = _parent(f"""
        import sys, time
        from polar_mitm.stack import launch
        launch.Service("sleeper", ["sleep", "{n}1"])
        launch.Service("graceful", ["/bin/sh", "-c",
                       "trap 'touch {flag}; exit 0' TERM; sleep {n}2 & wait"])
        time.sleep(0.5)
        print("ready", flush=True)
        time.sleep(600)
    """, tmp_path)
    try:
        assert _until(lambda: _alive(f"sleep {n}1") and _alive(f"sleep {n}2"), 10)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _until(lambda: not _alive(f"sleep {n}1") and not _alive(f"sleep {n}2"), 30), \
            "a service outlived the process that started it"
        assert _until(flag.exists, 5)     # it was asked to stop before it was killed
    finally:
        for pid in _alive(f"sleep {n}"):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_node_ends_every_process_of_its_sandboxes(tmp_path):
    """The harness leader dies with its parent (PDEATHSIG), but its tool processes do not:
    one in the harness's process group and one that left it (setsid)."""
    n = _token()
    parent = _parent(f"""
        import os, threading, time
        from polar_mitm.rollout.runtime import LocalRuntime
        from polar_mitm.rollout.spec import Workspace
        box = LocalRuntime({str(tmp_path / 's')!r}, network="host").prepare("t~0", Workspace())
        argv = ["/bin/sh", "-c", "sleep {n}1 & setsid sleep {n}2 & exec sleep {n}3"]
        threading.Thread(target=box.run, args=(argv, {{"PATH": os.environ["PATH"]}}, 600, "h"),
                         daemon=True).start()
        time.sleep(1.0)
        print("ready", flush=True)
        time.sleep(600)
    """, tmp_path)
    try:
        assert _until(lambda: all(_alive(f"sleep {n}{i}") for i in (1, 2, 3)), 10)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _until(lambda: not _alive(f"sleep {n}"), 15), \
            f"left running: {[open(f'/proc/{p}/cmdline').read() for p in _alive(f'sleep {n}')]}"
    finally:
        for pid in _alive(f"sleep {n}"):
            os.kill(pid, signal.SIGKILL)


def test_a_group_stopped_by_its_owner_is_forgotten():
    """A group the parent stopped itself is not signalled later (its pgid may be reused)."""
    n = _token()
    j = Janitor()
    kept = subprocess.Popen(["sleep", f"{n}1"], start_new_session=True)
    ended = subprocess.Popen(["sleep", f"{n}2"], start_new_session=True)
    try:
        j.watch_group(kept.pid)
        j.forget_group(kept.pid)
        j.watch_group(ended.pid)
        reaper = threading.Thread(target=ended.wait)   # a zombie would still count as a member
        reaper.start()
        j.close()                      # as if the parent died
        reaper.join(30)
        assert ended.returncode == -signal.SIGTERM
        assert kept.poll() is None
    finally:
        for p in (kept, ended):   # reaped: a zombie still shows in `pgrep -f`
            p.kill()
            p.wait()
