"""Where a session runs: its own files, its own processes, ended all together at teardown.

`Runtime.prepare` makes a `Sandbox`; the node runs the harness and the evaluator in it and
tears it down. LocalRuntime is a directory per session (workspace copy, HOME, TMPDIR) with
every process in one process group, marked in its environment so that even processes that
leave the group (setsid, daemons) are found and ended. A container runtime implements the
same two classes.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..janitor import group_alive, janitor, kill_marked, uptime
from .netbridge import UnixToTcp, die_with_parent
from .spec import Workspace

SANDBOX_MARK = "POLAR_SANDBOX"
NETBRIDGE = str(Path(__file__).with_name("netbridge.py"))


@functools.cache
def unshare_argv() -> tuple[str, ...] | None:
    """How to start a process in a new network namespace here, or None where the machine
    does not allow it (no unshare, no privileges for it)."""
    for argv in (("unshare", "-n"), ("unshare", "-rn")):
        try:
            if subprocess.run([*argv, "true"], capture_output=True, timeout=10).returncode == 0:
                return argv
        except (OSError, subprocess.SubprocessError):
            continue
    return None


@dataclass
class RunResult:
    exit_code: int | None          # None: killed at the timeout or cancelled
    timed_out: bool
    cancelled: bool
    seconds: float
    output_tail: str


class Sandbox(Protocol):
    workdir: Path
    home: Path

    def run(self, argv: list[str], env: dict[str, str], timeout: float, log_name: str,
            proxy_port: int | None = None) -> RunResult: ...
    def cancel(self) -> None: ...
    def teardown(self) -> None: ...


class Runtime(Protocol):
    def prepare(self, session_id: str, workspace: Workspace) -> Sandbox: ...


class SetupError(RuntimeError):
    """The workspace could not be made (bad path, git failure)."""


class LocalSandbox:
    def __init__(self, root: Path, keep: bool = False, isolate: tuple[str, ...] | None = None,
                 mark: str | None = None):
        self.root, self.keep, self.isolate = root, keep, isolate
        self.network = "isolated" if isolate else "host"
        self._bridges: list[tuple[UnixToTcp, str]] = []
        self.workdir, self.home, self.tmp = root / "work", root / "home", root / "tmp"
        self.logs = root / "logs"
        self.mark = mark or uuid.uuid4().hex
        self.born = uptime()        # its processes all start after this (seconds since boot)
        self._proc: subprocess.Popen | None = None
        self._cancelled = False

    def run(self, argv: list[str], env: dict[str, str], timeout: float, log_name: str,
            proxy_port: int | None = None) -> RunResult:
        t0 = time.monotonic()
        if self._cancelled:
            return RunResult(None, False, True, 0.0, "cancelled before start")
        if self.isolate:
            argv = self._isolated(argv, proxy_port)
        log = self.logs / f"{log_name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=self.workdir, env={**env, SANDBOX_MARK: self.mark},
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,   # its own process group
                                    preexec_fn=die_with_parent)   # and it dies if the node does
            self._proc = proc
            if self._cancelled:      # cancel() ran between the check above and Popen
                self.cancel()
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            # The harness may leave tool processes behind (servers, sleeps): end the group
            # now, whatever happened, so the evaluator sees a quiet workspace.
            self._end_group(proc)
            self._proc = None
        code = None if (timed_out or self._cancelled) else proc.returncode
        return RunResult(code, timed_out and not self._cancelled, self._cancelled,
                         time.monotonic() - t0, _tail(log))

    def _isolated(self, argv: list[str], proxy_port: int | None) -> list[str]:
        """A new network namespace with loopback only; with proxy_port, 127.0.0.1:proxy_port
        inside leads to the proxy through a unix socket, and nowhere else does."""
        sock = ""
        if proxy_port:
            d = tempfile.mkdtemp(prefix="polar-net-", dir="/tmp")   # unix socket paths are short
            sock = os.path.join(d, "proxy.sock")
            self._bridges.append((UnixToTcp(sock, proxy_port), d))
        return [*self.isolate, sys.executable, NETBRIDGE, str(proxy_port or 0), sock or "-", "--", *argv]

    def _end_group(self, proc: subprocess.Popen) -> None:
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
            if not group_alive(proc.pid):
                break
        kill_marked(f"{SANDBOX_MARK}={self.mark}", self.born)

    def cancel(self) -> None:
        self._cancelled = True
        proc = self._proc
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def teardown(self) -> None:
        kill_marked(f"{SANDBOX_MARK}={self.mark}", self.born)
        for bridge, d in self._bridges:
            bridge.close()
            shutil.rmtree(d, ignore_errors=True)
        self._bridges.clear()
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)


class LocalRuntime:
    """Sandboxes under one directory on this machine. network: "isolated" (a network
    namespace per session that reaches only the proxy), "host", or "auto" (isolated where
    the machine allows it)."""

    def __init__(self, base: str | Path | None = None, keep: bool = False, network: str = "auto"):
        self.base = Path(base) if base else Path(tempfile.mkdtemp(prefix="polar-sessions-"))
        self.base.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.keep = keep
        if network not in ("auto", "isolated", "host"):
            raise ValueError(f"network must be auto, isolated or host, not {network!r}")
        self.isolate = None if network == "host" else unshare_argv()
        if network == "isolated" and self.isolate is None:
            raise RuntimeError("network isolation asked for, but `unshare -n` is not allowed here")
        # Each sandbox's mark starts with this runtime's: if this process dies without a
        # teardown (SIGKILL), its janitor ends every process of every sandbox it ran.
        self.mark = uuid.uuid4().hex
        self._watched = False

    def prepare(self, session_id: str, workspace: Workspace) -> LocalSandbox:
        safe = session_id.replace("/", "_").replace("~", "-")
        root = Path(tempfile.mkdtemp(prefix=f"{safe}-", dir=self.base))
        if not self._watched:
            janitor().watch_marks(f"{SANDBOX_MARK}={self.mark}.", uptime())
            self._watched = True
        box = LocalSandbox(root, self.keep, self.isolate, mark=f"{self.mark}.{uuid.uuid4().hex}")
        for d in (box.home, box.tmp, box.logs):
            d.mkdir(mode=0o700)
        try:
            _materialize(workspace, box.workdir)
        except BaseException:
            box.teardown()
            raise
        return box


def _materialize(ws: Workspace, dest: Path) -> None:
    if ws.git:
        _git(["git", "clone", "--quiet", "--no-hardlinks", ws.git, str(dest)], f"git clone {ws.git}")
        if ws.commit:
            _git(["git", "-C", str(dest), "checkout", "--quiet", "--detach", ws.commit],
                 f"git checkout {ws.commit} (of {ws.git})")
    elif ws.path:
        src = Path(ws.path)
        if not src.is_dir():
            raise SetupError(f"workspace {ws.path} is not a directory")
        shutil.copytree(src, dest, symlinks=True)
    else:
        dest.mkdir()


def _git(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    if done.returncode != 0:
        raise SetupError(f"{what} failed: {done.stderr.strip()[-500:]}")


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
