"""Where a session runs: its own files, its own processes, ended all together at teardown.

`Runtime.prepare` makes a `Sandbox`; the node runs the harness and the evaluator in it and
tears it down. LocalRuntime is a directory per session (workspace copy, HOME, TMPDIR) and runs
each command in a bubblewrap sandbox (bwrap.py: its own PID, network and mount namespaces; it
sees the system read-only and, of the node, only its own session). Where bwrap is missing or
cannot start a sandbox, the node says so once and falls back to a weaker sandbox: every process
in one process group, marked in its environment so that processes that leave the group
(setsid, daemons) are found and ended, and a network namespace where `unshare -n` is allowed;
there the harness sees the node's whole filesystem. A container runtime implements the same
two classes.
"""

from __future__ import annotations

import fcntl
import functools
import glob
import json
import logging
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from .. import session_ids
from ..janitor import group_alive, janitor, kill_marked, uptime
from . import image_fit
from .bwrap import HOST_ENV, NETBRIDGE, NODE_INSIDE, Bwrap, env_args
from .bwrap import probe as bwrap_probe
from .images import CACHE_ENV, TEST_IMAGE, ImageCache, ImageError, Lease, cache_root, test_image, tool_path
from .netbridge import NetnsBridge, UnixToTcp, die_with_parent
from . import safe_read
from .evalview import MARK as EVALVIEW_MARK
from .spec import Action, RuntimeSpec, Workspace
from .bwrap import sized as bwrap_sized
from .cgroups import SessionCgroup
from .cgroups import host as cgroup_host
from .limits import DEFAULTS as DEFAULT_LIMITS
from .limits import CappedLog, DiskWatch, LimitHit, Limits, launch_prefix

log = logging.getLogger("polar.sandbox")

SANDBOX_MARK = "POLAR_SANDBOX"
IMAGE_CACHE_ENV = CACHE_ENV     # where a node unpacks images (default: images.default_root())
NET_PREFIX = "polar-net-"       # /tmp/polar-net-*: a proxy socket's directory
KEPT = ".kept"                  # a session directory kept on purpose (keep=True)


def host_tool(name: str) -> str | None:
    """A helper the node runs outside its sandboxes (setpriv, unshare, nsenter, mount, git) by
    its absolute path (images.tool_path): never found on a session's or an image's PATH."""
    return tool_path(name)


@functools.cache
def unshare_argv() -> tuple[str, ...] | None:
    """How to start a process in a new network namespace here, or None where the machine
    does not allow it (no unshare, no privileges for it)."""
    exe = host_tool("unshare")
    for argv in ((exe, "-n"), (exe, "-rn")) if exe else ():
        try:
            if subprocess.run([*argv, "/bin/true"], capture_output=True, timeout=10, env=HOST_ENV).returncode == 0:
                return argv
        except (OSError, subprocess.SubprocessError):
            continue
    return None


@functools.cache
def netns_nsenter() -> str | None:
    """nsenter's path where this node makes its sessions' network namespaces itself
    (netbridge.NetnsBridge: root), else None: the bridge then runs inside the sandbox."""
    exe = host_tool("nsenter")
    if exe is None:
        return None
    try:
        NetnsBridge(0, 1).close()
    except OSError as e:
        log.info("sessions' network namespaces are bwrap's, the proxy bridge inside on the node's Python "
                 "(an image needs the node's libc): %s", e)
        return None
    return exe


@dataclass
class RunResult:
    exit_code: int | None          # None: killed at the timeout or cancelled
    timed_out: bool
    cancelled: bool
    seconds: float
    output_tail: str
    limit: LimitHit | None = None     # a limit it went past (limits.py): it was ended for it
    usage: dict = field(default_factory=dict)   # what it used of its limits (peaks, disk, log dropped)


class Sandbox(Protocol):
    workdir: Path
    home: Path
    tmp: Path
    logs: Path

    @property
    def inside_workdir(self) -> str: ...

    def run(self, argv: list[str], env: dict[str, str], timeout: float, log_name: str,
            proxy_port: int | None = None) -> RunResult: ...
    def cancel(self) -> None: ...
    def teardown(self) -> None: ...
    def evaluation_box(self, reads: Sequence[str] = ()) -> EvaluationBox: ...


class EvaluationBox(Sandbox, Protocol):
    """A fresh sandbox where a session is evaluated (LocalSandbox.evaluation_box)."""
    output: str | None                  # POLAR_OUTPUT: the node's copy of the harness's output

    def output_of(self, log_name: str, limit: int) -> bytes: ...


class Runtime(Protocol):
    def prepare(self, session_id: str, workspace: Workspace, runtime: RuntimeSpec | None = None,
                actions: Sequence[Action] | None = None, limits: Mapping[str, Any] | None = None) -> Sandbox: ...


class SetupError(RuntimeError):
    """The workspace could not be made (bad path, git failure)."""


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class ImageLayer:
    """A session's root in an environment image: the image's rootfs (shared, read-only) under
    an overlay whose upper directory is the session's own, mounted in a mount namespace of
    the sandbox's (it goes with it)."""
    lease: Lease                 # the image, held while the session lives (never evicted meanwhile)
    workdir: str                 # the session's working directory inside
    env: dict[str, str]          # the image's environment, then the task's
    upper: Path
    work: Path
    merged: Path
    bound: bool                  # the task's workspace, copied on the node, is bound at workdir
    network: str = "proxy"       # runtime.network: "none" is loopback alone, not even the proxy
    # What its runtime.prepare actions left (their layer, sealed: the session cannot change
    # it), under the session's own upper: an evaluator runs on the image and this, not on
    # what the session did to the image.
    prepared: Path | None = None

    def lowerdir(self) -> str:
        """The read-only layers under the session's own: the prepared layer over the image."""
        rootfs = str(self.lease.image.rootfs)
        return f"{self.prepared}:{rootfs}" if self.prepared is not None else rootfs

    def seal(self) -> None:
        """The prepare actions' upper directory becomes a read-only layer under a new, empty
        one: what the session does from now on is its own layer alone."""
        prepared = self.upper.with_name("prepared")
        self.upper.rename(prepared)
        self.upper.mkdir()
        self.prepared = prepared

    def mount_argv(self) -> list[str]:
        """The command that mounts the overlay and execs the rest: unshare's own mount
        namespace (as root; elsewhere a user namespace as well, where the kernel lets one
        mount overlayfs). Absolute paths: it runs as root outside the sandbox."""
        unshare, mount_exe = host_tool("unshare"), host_tool("mount")
        if not (unshare and mount_exe):
            raise SetupError("an image's session needs unshare and mount (util-linux), which this node lacks")
        opts = f"lowerdir={self.lowerdir()},upperdir={self.upper},workdir={self.work}"
        mount = f"{mount_exe} -t overlay overlay -o {shlex.quote(opts)} {shlex.quote(str(self.merged))}"
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        return [unshare, *user, "--mount", "--propagation", "private", "/bin/sh", "-c", f'{mount} && exec "$@"',
                "sh"]

    def environ(self, env: dict[str, str]) -> dict[str, str]:
        """env (the harness's or the evaluator's) inside the image: the image's and the task's
        variables under it, and PATH the image's (or the task's), with Node.js first."""
        path = self.env.get("PATH", DEFAULT_PATH)
        return {**self.env, **env, "PATH": f"{NODE_INSIDE}:{path}"}


class LocalSandbox:
    """One session's directory (work, home, tmp, logs) and the way its commands run: in a
    bubblewrap sandbox (`bwrap`), or, the fallback, in a process group marked in its
    environment, in a network namespace of its own where `isolate` is given."""

    def __init__(self, root: Path, keep: bool = False, isolate: tuple[str, ...] | None = None,
                 mark: str | None = None, bwrap: Bwrap | None = None, network: str | None = None):
        self.root, self.keep, self.isolate, self.bwrap = root, keep, isolate, bwrap
        self.image: ImageLayer | None = None
        self.kind = "bwrap" if bwrap else "local"
        self.network = network or ("isolated" if isolate else "host")
        self._bridges: list[tuple[UnixToTcp, str]] = []
        self._netns: list[NetnsBridge] = []     # the network namespaces made for its runs
        self._env_fd: int | None = None         # bwrap's --args: the command's environment
        self.workdir, self.home, self.tmp = root / "work", root / "home", root / "tmp"
        self.logs = root / "logs"
        self.mark = mark or uuid.uuid4().hex
        self.born = uptime()        # its processes all start after this (seconds since boot)
        self._proc: subprocess.Popen | None = None
        self._pid1: int | None = None   # bwrap: the sandbox's PID 1, as this node sees it
        self._pid1fd: int | None = None   # and a pidfd on it (the run's thread only)
        self.lock = None                # its runtime's lock on the sessions' directory, held while it lives
        self._cancelled = False
        self.setup_s = 0.0              # of its set-up, what pulling and unpacking its image took
        self._evaluations: list[EvaluationSandbox] = []   # live ones: a cancel ends them too
        # What its runs may use (limits.py: LocalRuntime.prepare puts the task's over the
        # node's), and the cgroup that holds them to it: made at its first run, removed at
        # teardown. use_cgroups False: rlimits only.
        self.limits: Limits = DEFAULT_LIMITS
        self.use_cgroups = True
        self.cgroup: SessionCgroup | None = None

    def run(self, argv: list[str], env: dict[str, str], timeout: float, log_name: str,
            proxy_port: int | None = None) -> RunResult:
        t0 = time.monotonic()
        if self._cancelled:
            return RunResult(None, False, True, 0.0, "cancelled before start")
        if self.image is not None:
            env = self.image.environ(env)
        if self.bwrap:
            argv = self._bwrapped(self.bwrap, argv, env, proxy_port)
            env = dict(HOST_ENV)     # the command's went in through bwrap --args: the helpers get none of it
            if self.bwrap.can_size:  # its tmpfs mounts at most its memory (a cgroup counts them in it too)
                argv = bwrap_sized(argv, self.bwrap.exe, self.limits.memory)
        else:
            env = {**env, SANDBOX_MARK: self.mark}
            argv = [*_drop_privileges(), *argv]
            if self.isolate:
                argv = self._isolated(self.isolate, argv, proxy_port)
        log = self.logs / f"{log_name}.log"
        out = CappedLog(log, self.limits.log)      # its output through a pipe, the file kept under the limit
        disk = DiskWatch(self.root, self.limits.disk)
        try:
            proc = self._start(argv, env, out.fd)
            out.started()
            if self._cancelled:      # cancel() ran between the check above and Popen
                self.cancel()
            timed_out, hit = self._watch(proc, timeout, disk)
            # The harness may leave tool processes behind (servers, sleeps): end them now,
            # whatever happened, so the evaluator sees a quiet workspace.
            if self.bwrap:
                self._end_sandbox(proc)
            else:
                self._end_group(proc)
                if self.cgroup is not None:     # what left its process group and marks too
                    self.cgroup.kill_all()
            self._proc = self._pid1 = None
        finally:
            out.close()
            disk.close()
        if hit is None and not self._cancelled:     # what it did since the last look
            hit = self.cgroup.hit() if self.cgroup is not None else None
            if hit is None and disk.measure() is not None and disk.over():
                hit = disk.hit()
        if hit is None and out.dropped:      # printed past its log limit (it ran on; the tail is kept)
            hit = out.hit()
        code = None if (timed_out or self._cancelled) else proc.returncode
        return RunResult(code, timed_out and not self._cancelled, self._cancelled,
                         time.monotonic() - t0, _tail(log), limit=hit, usage=self._usage(disk, out))

    LOOK_S = 0.2        # how often a run's cgroup counters and its filesystem's usage are read

    def _watch(self, proc: subprocess.Popen, timeout: float, disk: DiskWatch) -> tuple[bool, LimitHit | None]:
        """Waits for the run to end, for at most timeout seconds (then: True), looking at its
        limits meanwhile: past one, its sandbox is ended at once and the limit returned."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return True, None
            try:
                proc.wait(timeout=min(left, self.LOOK_S, max(disk.due(), 0.05)))
                return False, None
            except subprocess.TimeoutExpired:
                pass
            hit = self.cgroup.hit() if self.cgroup is not None else None
            if hit is None and disk.poll() is not None and disk.over():
                hit = disk.hit()
            if hit is not None:
                if self.bwrap:
                    self._kill_sandbox(proc)
                else:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return False, hit

    def _usage(self, disk: DiskWatch, out: CappedLog) -> dict:
        usage: dict = self.cgroup.usage() if self.cgroup is not None else {}
        if disk.used is not None:
            usage["disk_mib"] = round(disk.used / (1 << 20), 1)
        if out.dropped:
            usage["log_dropped_bytes"] = out.dropped
        return usage

    def _limit_prefix(self) -> list[str]:
        """The head of a run's command line that starts it inside its limits
        (limits.launch_prefix): in its cgroup (made at its first run) where the node has
        them, else under rlimits alone."""
        h = cgroup_host() if self.use_cgroups else None
        if h is not None and h.enabled and self.cgroup is None:
            self.cgroup = SessionCgroup(h, self.limits)
        elif self.cgroup is not None:
            self.cgroup.begin_run()
        return launch_prefix(self.limits, self.cgroup.procs if self.cgroup is not None else (),
                             data_limit=self.cgroup is None)

    def _start(self, argv: list[str], env: dict[str, str], out: int) -> subprocess.Popen:
        # Its own process group, and it dies if the node does: setpriv sets that signal and
        # execs it, so Popen can vfork. A preexec_fn would make it fork, which copies the
        # node's page tables while holding the GIL (a loop's node: 20-100 ms per session
        # start, every other thread of the process waiting).
        deathsig = _pdeathsig()
        kw: dict[str, Any] = dict(cwd=self.root if self.image else self.workdir, env=env, stdin=subprocess.DEVNULL,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  preexec_fn=None if deathsig else die_with_parent)
        argv = [*deathsig, *self._limit_prefix(), *argv]
        if not self.bwrap:
            self._proc = subprocess.Popen(argv, **kw)
            return self._proc
        # bwrap tells where its PID 1 is (JSON on --info-fd, written and closed at its start)
        r, w = os.pipe()
        with os.fdopen(r, "rb") as f:
            fds, self._env_fd = (self._env_fd,) if self._env_fd is not None else (), None
            try:
                at = argv.index(self.bwrap.exe) + 1    # an image's: after the overlay's mount
                self._proc = subprocess.Popen([*argv[:at], "--info-fd", str(w), *argv[at:]], pass_fds=(w, *fds),
                                              **kw)
            finally:
                os.close(w)
                for fd in fds:
                    os.close(fd)
            info = f.read()
        self._pid1 = self._pid1fd = None
        try:
            self._pid1 = int(json.loads(info)["child-pid"])
            self._pid1fd = os.pidfd_open(self._pid1)
        except (ValueError, KeyError, TypeError):
            pass                     # it failed to start; its exit status says why
        except OSError:              # PID 1 gone already, or a kernel without pidfds (< 5.3)
            pass
        return self._proc

    def _bwrapped(self, bwrap: Bwrap, argv: list[str], env: dict[str, str], proxy_port: int | None) -> list[str]:
        """The command line that runs argv in the session's bwrap sandbox, every helper of it
        by its absolute path; env goes to bwrap on a file descriptor (`--args`, `_start`
        passes it), set inside only. With proxy_port (and a network that has the proxy),
        127.0.0.1:proxy_port inside leads to it: a network namespace the node made
        (NetnsBridge), which nsenter joins before anything else runs, or where the node
        cannot make one, the bridge inside."""
        im = self.image
        if im is not None and im.network == "none":
            proxy_port = None        # loopback alone: nothing leads out, not even to the proxy
        sock_dir = joined = None
        nsenter = netns_nsenter() if proxy_port and self.network == "isolated" else None
        if proxy_port and self.network == "isolated":
            if nsenter:
                joined = NetnsBridge(proxy_port, proxy_port)
                self._netns.append(joined)
            else:
                sock_dir = self._bridge(proxy_port)
        if im is None:
            inner = bwrap.argv(argv, rw=[self.workdir, self.home, self.tmp], ro=[self.logs], env=env,
                               cwd=self.workdir, network=self.network, proxy_port=proxy_port, sock_dir=sock_dir,
                               hide=[self.root.parent], joined=joined is not None)
            outer: list[str] = []
        else:
            inner = bwrap.argv(argv, rw=[self.home, self.tmp], ro=[self.logs], env=env, cwd=im.workdir,
                               network=self.network, proxy_port=proxy_port, sock_dir=sock_dir,
                               hide=[self.root.parent], root=str(im.merged),
                               binds=[(self.workdir, im.workdir)] if im.bound else [], joined=joined is not None)
            outer = im.mount_argv()
        if joined is not None and nsenter:
            outer = [nsenter, f"--net={joined.path}", "--", *outer]
        return [*outer, inner[0], *self._env_args(env), *inner[1:]]

    def _env_args(self, env: dict[str, str]) -> list[str]:
        """bwrap's arguments that set the command's environment inside (--clearenv, --setenv),
        read from a memory file (--args FD): never on a command line, and none of it reaches
        the helpers outside. The fd is this sandbox's until its run starts."""
        fd = os.memfd_create("polar-env", os.MFD_CLOEXEC)
        data = memoryview(env_args(env))
        while data:
            data = data[os.write(fd, data):]
        os.lseek(fd, 0, os.SEEK_SET)
        if self._env_fd is not None:     # a command line made and never started
            os.close(self._env_fd)
        self._env_fd = fd
        return ["--args", str(fd)]

    def _bridge(self, proxy_port: int) -> str:
        """A unix socket, in a directory of its own, that leads to the proxy's port."""
        d = tempfile.mkdtemp(prefix=NET_PREFIX, dir="/tmp")   # unix socket paths are short
        self._bridges.append((UnixToTcp(os.path.join(d, "proxy.sock"), proxy_port), d))
        return d

    def _isolated(self, isolate: tuple[str, ...], argv: list[str], proxy_port: int | None) -> list[str]:
        """A new network namespace with loopback only; with proxy_port, 127.0.0.1:proxy_port
        inside leads to the proxy through a unix socket, and nowhere else does."""
        sock = os.path.join(self._bridge(proxy_port), "proxy.sock") if proxy_port else ""
        return [*isolate, sys.executable, NETBRIDGE, str(proxy_port or 0), sock or "-", "--", *argv]

    def _end_sandbox(self, proc: subprocess.Popen) -> None:
        """SIGKILL the sandbox's PID 1: the kernel ends every process of its PID namespace.
        bwrap itself exits as soon as the command does, before PID 1 has ended the others,
        so the run then waits on PID 1's pidfd: it turns readable only once the namespace
        is empty (the kernel reaps the rest first)."""
        if proc.poll() is None:
            self._kill_sandbox(proc)
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:    # never seen; bwrap's own death ends PID 1 too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        fd, self._pid1fd = self._pid1fd, None
        if fd is None:
            return
        # poll, not select: select fails on descriptors past 1024 (a long-lived node has them)
        waiter = select.poll()
        waiter.register(fd, select.POLLIN)
        try:
            if not waiter.poll(0):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                waiter.poll(10_000)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)

    def _kill_sandbox(self, proc: subprocess.Popen) -> None:
        pid1 = self._pid1
        try:
            if pid1 is not None and proc.poll() is None:   # bwrap has not reaped it: still ours
                os.kill(pid1, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGKILL)        # bwrap; PID 1 dies with it (--die-with-parent)
        except ProcessLookupError:
            pass

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

    @property
    def inside_workdir(self) -> str:
        """The working directory as its commands see it (an image's may be another path)."""
        return self.image.workdir if self.image is not None else str(self.workdir)

    def unfit_for(self, harness: str) -> str | None:
        """Why the harness cannot run in this session's image (image_fit: what the image
        lacks that the node's Node.js needs), or None."""
        if self.image is None:
            return None
        return image_fit.harness_unfit(self.image.lease.image.rootfs, harness)

    def evaluation_box(self, reads: Sequence[str] = ()) -> EvaluationSandbox:
        """A fresh sandbox to evaluate this session in (EvaluationSandbox): its workspace
        read-only, and of the rest of its space only `reads`. Its teardown is the caller's."""
        box = EvaluationSandbox(self, reads)
        self._evaluations.append(box)
        return box

    def act(self, action: Action, name: str) -> None:
        """One of a runtime's prepare actions: a shell line run in the workdir (with no way
        out: nothing reaches the proxy), or a node path copied in. SetupError where it fails."""
        if action.copy is not None:
            self._copy_in(Path(action.copy), action.to or ".")
            return
        assert action.run is not None
        env = {"PATH": DEFAULT_PATH, "HOME": str(self.home), "TMPDIR": str(self.tmp), "LANG": "C.UTF-8"}
        r = self.run(["/bin/sh", "-c", action.run], env, action.timeout, name)
        if r.exit_code != 0:
            why = "timed out" if r.timed_out else "was cancelled" if r.cancelled else f"exited with code {r.exit_code}"
            if r.limit is not None:
                why += f" ({r.limit.reason})"
            raise SetupError(f"runtime prepare action {action.run!r} {why}: {r.output_tail[-500:].strip()}")

    def _copy_in(self, src: Path, to: str) -> None:
        """src (a node path) at `to` in the session: in its workdir when relative (or inside
        it), else into the image layer's upper directory (the session's own files)."""
        if not src.exists():
            raise SetupError(f"runtime prepare: copy {src}: no such file or directory on this node")
        im = self.image
        inside = to if os.path.isabs(to) else os.path.join(im.workdir if im else str(self.workdir), to)
        inside = os.path.normpath(inside)
        if im is None or (im.bound and (inside + "/").startswith(im.workdir.rstrip("/") + "/")):
            base = im.workdir if im else str(self.workdir)
            dest = self.workdir / os.path.relpath(inside, base)
        else:
            dest = im.upper / inside.lstrip("/")
        if not (dest.resolve() == self.root.resolve() or self.root.resolve() in dest.resolve().parents):
            raise SetupError(f"runtime prepare: copy to {to}: outside the session")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest)

    def cancel(self) -> None:
        self._cancelled = True
        for evaluation in list(self._evaluations):
            evaluation.cancel()
        proc = self._proc
        if proc is None:
            return
        if self.bwrap:
            self._kill_sandbox(proc)
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def teardown(self) -> None:
        if not self.bwrap:      # in bwrap, nothing outlives its run
            kill_marked(f"{SANDBOX_MARK}={self.mark}", self.born)
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        for bridge, d in self._bridges:
            bridge.close()
            shutil.rmtree(d, ignore_errors=True)
        self._bridges.clear()
        for ns in self._netns:
            ns.close()
        self._netns.clear()
        if self._env_fd is not None:     # a command line made and never started
            os.close(self._env_fd)
            self._env_fd = None
        if self.image is not None:
            self.image.lease.release()
        if not self.keep:
            _remove_tree(self.root)
        elif self.root.exists():
            (self.root / KEPT).touch()     # kept on purpose: the next start leaves it


EVAL_OUTPUT_LIMIT = 1 << 20     # of the harness's output, the tail an evaluator gets (POLAR_OUTPUT)
EVALVIEW = str(Path(__file__).with_name("evalview.py"))


def evaluator_path(path: str, workdir: str) -> str:
    """A PATH for an evaluator: its absolute entries outside the session's workdir (a relative
    one, or one in the workspace, would run what the session left there)."""
    inside = workdir.rstrip("/") + "/"
    kept = [p for p in path.split(":") if p.startswith("/") and not (p.rstrip("/") + "/").startswith(inside)]
    return ":".join(dict.fromkeys(kept)) or DEFAULT_PATH


class EvaluationSandbox(LocalSandbox):
    """A fresh sandbox where a session is evaluated, never the session's own: what the session
    left in its HOME, its TMPDIR or its image layer (start-up files, a replaced shell or
    python, a fake git on a PATH) does not run in it.

    - its workspace read-only, at the path the session saw it;
    - a fresh HOME, TMPDIR and /tmp, made by the node, empty; loopback only, no proxy;
    - in an image: a fresh writable layer over the image (and what the task's prepare actions
      left), not the session's; its workdir is the session's, read-only (where the session's
      layer holds it: opened without following links, or not shown at all);
    - of the rest of the session's space, only the evaluator's `reads` ("~/..." in its HOME,
      absolute paths in its image), read-only, each opened without following links
      (evalview.py), at the same path ("~/": in the fresh HOME);
    - `output`: a copy the node wrote of the harness's output (its last EVAL_OUTPUT_LIMIT
      bytes), or None where there is none.

    Without bwrap (the fallback sandbox) it gets a fresh HOME and TMPDIR only: that sandbox
    guards nothing of the node's anyway."""

    def __init__(self, session: LocalSandbox, reads: Sequence[str] = ()):
        root = Path(tempfile.mkdtemp(prefix="eval-", dir=session.root))
        super().__init__(root, keep=session.keep, isolate=session.isolate, mark=f"{session.mark}.eval",
                         bwrap=session.bwrap, network="isolated" if session.bwrap else None)
        self.session, self.reads, self.layer = session, tuple(reads), session.image
        self.limits, self.use_cgroups = session.limits, session.use_cgroups   # its code runs here: its limits
        self.workdir = session.workdir       # the session's; the rest is this sandbox's own
        self.out = root / "out"
        for d in (self.home, self.tmp, self.logs, self.out):
            d.mkdir(mode=0o700)
        self._status = root / "view-status"
        self._viewed = False                 # the last run's bwrap came through evalview.py
        self.output: str | None = None
        try:
            got = safe_read.read_regular(session.logs, "harness.log", EVAL_OUTPUT_LIMIT, tail=True)
        except safe_read.UnsafePath:
            got = None
        if got is not None:
            (self.out / "output").write_bytes(got.data)
            self.output = str(self.out / "output")
        if not self.bwrap:
            for r in self.reads:
                if r.startswith("~/"):
                    (self.home / r[2:]).parent.mkdir(parents=True, exist_ok=True)
                    (self.home / r[2:]).symlink_to(session.home / r[2:])

    @property
    def inside_workdir(self) -> str:
        return self.layer.workdir if self.layer is not None else str(self.workdir)

    def run(self, argv: list[str], env: dict[str, str], timeout: float, log_name: str,
            proxy_port: int | None = None) -> RunResult:
        """argv run in it (never with the proxy). SetupError where the view of the session
        could not be made: the grader's failure, not the policy's."""
        if self.layer is not None:
            env = self.layer.environ(env)
        env = {**env, "PATH": evaluator_path(env.get("PATH", DEFAULT_PATH), self.inside_workdir)}
        self._viewed = False
        self._status.unlink(missing_ok=True)
        r = super().run(argv, env, timeout, log_name, None)
        if self._viewed and not r.cancelled:
            status = safe_read.read_text(self.root, self._status.name, 4096)
            if status != "ok":
                raise SetupError(f"the evaluation sandbox could not be made: {status or 'it did not start'}")
        return r

    def output_of(self, log_name: str, limit: int) -> bytes:
        """What a run printed (its log's first `limit` bytes), read without following links."""
        try:
            return safe_read.read_regular(self.logs, f"{log_name}.log", limit).data
        except safe_read.UnsafePath:
            return b""

    def _bwrapped(self, bwrap: Bwrap, argv: list[str], env: dict[str, str], *_, **__) -> list[str]:
        s, im = self.session, self.layer
        spec: dict = {"status": str(self._status), "binds": [], "mounts": []}
        for r in self.reads:
            if r.startswith("~/"):
                spec["binds"].append([str(s.home), r[2:], str(self.home / r[2:]), False, r])
        if im is None:
            inner = bwrap.argv(argv, rw=[self.home, self.tmp], ro=[s.workdir, self.out], env=env, cwd=s.workdir,
                               network="isolated", hide=[s.root.parent])
            outer: list[str] = []
        else:
            layer = self.root / "layer"
            upper, work, fresh, view = (layer / n for n in ("upper", "work", "root", "view"))
            for d in (upper, work, fresh, view):
                d.mkdir(parents=True, exist_ok=True)
            # the evaluator's own root: a fresh layer over the image (and the prepared layer)
            spec["mounts"].append([f"lowerdir={im.lowerdir()},upperdir={upper},workdir={work}", str(fresh)])
            absolute = [r for r in self.reads if r.startswith("/")]
            if not im.bound or absolute:
                # the session's root as it left it, read-only: paths are shown from here
                spec["mounts"].append([f"lowerdir={im.upper}:{im.lowerdir()}", str(view)])
            spec["binds"] += [[str(view), r, r, False, r] for r in absolute]
            # the workdir last, over any read above it: the session's copy, or its layer's
            spec["binds"].append([str(s.workdir), "", im.workdir, True, "workdir"] if im.bound else
                                 [str(view), im.workdir, im.workdir, True, f"workdir {im.workdir}"])
            inner = bwrap.argv(argv, rw=[self.home, self.tmp], ro=[self.out], env=env, cwd=im.workdir,
                               network="isolated", hide=[s.root.parent], root=str(fresh))
            unshare, mount = host_tool("unshare"), host_tool("mount")
            if not (unshare and mount):
                raise SetupError("an image's evaluator needs unshare and mount (util-linux), which this node lacks")
            spec["mount"] = mount
            user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
            outer = [unshare, *user, "--mount", "--propagation", "private"]
        inner = [inner[0], *self._env_args(env), *inner[1:]]
        if not (spec["mounts"] or spec["binds"]):
            return [*outer, *inner]
        # the binds go in after bwrap's own (the image's root first), before its --chdir
        options = len(inner) - len(argv)
        at = options - 1 - inner[options - 1::-1].index("--chdir")
        inner.insert(at, EVALVIEW_MARK)
        self._viewed = True
        return [*outer, bwrap.python, "-I", "-S", EVALVIEW, json.dumps(spec), "--", *inner]

    def teardown(self) -> None:
        if self in self.session._evaluations:
            self.session._evaluations.remove(self)
        super().teardown()       # its own processes and directory; the session's image stays leased


class LocalRuntime:
    """Sandboxes under one directory on this machine.

    sandbox: "bwrap" (bubblewrap; an error where it cannot start one), "local" (the fallback:
    process groups and environment marks), or "auto" (bwrap where it works, else the fallback
    with one warning); default $POLAR_SANDBOX or "auto". network: "isolated" (a network
    namespace per session that reaches only the proxy), "host", or "auto" (isolated where the
    machine allows it; always, with bwrap). expose: more of the node's paths that sessions see
    read-only (also $POLAR_SANDBOX_EXPOSE), besides the system, the node's Python, Node.js and
    the harness installs.

    The runtime holds base/.lock while it lives; a runtime that gets it removes what a killed
    one left in base (session directories not kept on purpose), and, on any start, proxy
    sockets in /tmp that nothing serves any more."""

    def __init__(self, base: str | Path | None = None, keep: bool = False, network: str = "auto",
                 sandbox: str | None = None, expose=(), limits: Limits | None = None, cgroups: bool = True):
        self.base = Path(base) if base else Path(tempfile.mkdtemp(prefix="polar-sessions-"))
        # Each session's limits (limits.py): these, with its task's own over them. cgroups
        # False: rlimits alone, as on a host without them (where one warning says so).
        self.limits = limits or DEFAULT_LIMITS
        self.use_cgroups = cgroups and cgroup_host().enabled
        if cgroups and not self.use_cgroups:
            _warn_no_cgroups(cgroup_host().why)
        self.base.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.keep = keep
        if network not in ("auto", "isolated", "host"):
            raise ValueError(f"network must be auto, isolated or host, not {network!r}")
        sandbox = sandbox or os.environ.get("POLAR_SANDBOX") or "auto"
        if sandbox not in ("auto", "bwrap", "local"):
            raise ValueError(f"sandbox must be auto, bwrap or local, not {sandbox!r}")
        self.bwrap: Bwrap | None = None
        if sandbox != "local":
            self.bwrap, why = bwrap_probe(tuple(str(p) for p in expose))
            if self.bwrap is None:
                if sandbox == "bwrap":
                    raise RuntimeError(f"the bwrap sandbox was asked for, but {why}")
                _warn_fallback(why)
        self.sandbox = "bwrap" if self.bwrap else "local"
        if self.bwrap:
            self.isolate = None
            self.network = "host" if network == "host" else "isolated"
        else:
            self.isolate = None if network == "host" else unshare_argv()
            if network == "isolated" and self.isolate is None:
                raise RuntimeError("network isolation asked for, but `unshare -n` is not allowed here")
            self.network = "isolated" if self.isolate else "host"
        # Each sandbox's mark starts with this runtime's: if this process dies without a
        # teardown (SIGKILL), its janitor ends every process of every sandbox it ran.
        self.mark = uuid.uuid4().hex
        self._watched = False
        self.images: ImageCache | None = None   # made at the first session with an image
        self._lock = _claim(self.base)     # held while this runtime or one of its sandboxes lives
        sweep_bridges()

    def prepare(self, session_id: str, workspace: Workspace, runtime: RuntimeSpec | None = None,
                actions: Sequence[Action] | None = None, limits: Mapping[str, Any] | None = None) -> LocalSandbox:
        """A session's sandbox: its directories, its workspace, and with runtime its image's
        root with runtime.prepare's actions run in it (actions: these instead, as a grading
        environment's eval_prepare). limits: its task's (spec.TaskRequest.limits), over this
        runtime's. SetupError where any of it fails."""
        safe = session_ids.file_safe(session_id)
        root = Path(tempfile.mkdtemp(prefix=f"{safe}-", dir=self.base))
        if not self._watched and not self.bwrap:     # bwrap's sandboxes die with this process
            janitor().watch_marks(f"{SANDBOX_MARK}={self.mark}.", uptime())
            self._watched = True
        box = LocalSandbox(root, self.keep, self.isolate, mark=f"{self.mark}.{uuid.uuid4().hex}",
                           bwrap=self.bwrap, network=self.network)
        box.lock = self._lock
        box.limits, box.use_cgroups = self.limits.merged(limits), self.use_cgroups
        for d in (box.home, box.tmp, box.logs):
            d.mkdir(mode=0o700)
        try:
            if runtime is None:
                _materialize(workspace, box.workdir)
                return box
            box.image = self._image_layer(root, workspace, runtime)
            if box.image.bound:
                _materialize(workspace, box.workdir)
            else:
                box.workdir.mkdir()
            box.setup_s = box.image.lease.image.unpack_s
            for i, action in enumerate(runtime.prepare if actions is None else actions):
                box.act(action, f"prepare-{i}")
            if any(box.image.upper.iterdir()):
                box.image.seal()
        except BaseException:
            box.teardown()
            raise
        return box

    def _image_layer(self, root: Path, workspace: Workspace, runtime: RuntimeSpec) -> ImageLayer:
        if self.bwrap is None:
            raise SetupError(f"runtime.image {runtime.image} needs the bwrap sandbox, which this node lacks")
        if runtime.engine != "bwrap":
            raise SetupError(f"runtime.engine {runtime.engine} is not one this node runs (bwrap)")
        if self.images is None:
            self.images = ImageCache(cache_root())
        try:
            # the test image (scripts/build_test_image.sh) by its name: built here the first time
            ref = str(test_image()) if runtime.image == TEST_IMAGE else runtime.image
            lease = self.images.lease(ref)
        except ImageError as e:
            raise SetupError(str(e)) from None
        cfg = lease.image.config or {}
        # what a process environment can hold: a name, without NUL (the rest never reaches bwrap)
        env = {k: v for k, _, v in (e.partition("=") for e in cfg.get("Env") or [] if isinstance(e, str) and "=" in e)
               if k and "\0" not in k + v}
        if runtime.network != "none" and self.network == "isolated" and not netns_nsenter():
            why = image_fit.python_unfit(lease.image.rootfs, self.bwrap.python)   # the bridge runs inside
            if why:
                lease.release()
                raise SetupError(f"runtime.image {runtime.image}: {why}")
        layer = ImageLayer(lease=lease, workdir=runtime.workdir or cfg.get("WorkingDir") or "/workspace",
                           env={**env, **runtime.env}, upper=root / "layer" / "upper", work=root / "layer" / "work",
                           merged=root / "layer" / "root", bound=bool(workspace.path or workspace.git),
                           network=runtime.network)
        for d in (layer.upper, layer.work, layer.merged):
            d.mkdir(parents=True)
        return layer


_DROP: tuple[str, ...] | None = None
_DEATHSIG: tuple[str, ...] | None = None


def _setpriv() -> str | None:
    return host_tool("setpriv")


def _pdeathsig() -> tuple[str, ...]:
    """A prefix that makes the command SIGKILLed when the thread that started it dies
    (PR_SET_PDEATHSIG, kept across exec); () where setpriv lacks --pdeathsig."""
    global _DEATHSIG
    if _DEATHSIG is None:
        exe = _setpriv()
        argv: tuple[str, ...] = ()
        if exe:
            argv = (exe, "--pdeathsig", "KILL", "--")
            try:
                if subprocess.run([*argv, "/bin/true"], capture_output=True, timeout=10).returncode != 0:
                    argv = ()
            except (OSError, subprocess.SubprocessError):
                argv = ()
        _DEATHSIG = argv
    return _DEATHSIG


def _drop_privileges() -> tuple[str, ...]:
    """The fallback sandbox's commands run without capabilities: as root they would read any
    process's memory and environment in /proc (the proxy's control token, the node's) and
    files of any owner. setpriv empties the bounding set, so nothing the session execs gets
    one back. () where setpriv is missing or refused (a warning says so, and the next
    session asks again). Found by its absolute path: a session's PATH is its own."""
    global _DROP
    if _DROP is not None:
        return _DROP
    exe = _setpriv()
    if exe:
        argv: tuple[str, ...] = (exe, "--bounding-set", "-all", "--inh-caps", "-all", "--no-new-privs", "--")
        if os.geteuid() != 0:
            argv = (exe, "--no-new-privs", "--")      # no capabilities to drop
        try:
            if subprocess.run([*argv, "/bin/true"], capture_output=True, timeout=10).returncode == 0:
                _DROP = argv
                return argv
        except (OSError, subprocess.SubprocessError):
            pass
    log.warning("WARNING: setpriv is missing or refused: this fallback sandbox keeps the node's privileges")
    return ()


_warned: set[str] = set()


def _warn_fallback(why: str) -> None:
    if why in _warned:          # once per process
        return
    _warned.add(why)
    log.warning("WARNING: sessions run WITHOUT the bwrap sandbox: %s. The fallback keeps each session "
                "in its own process group and, where `unshare -n` is allowed, its own network; it "
                "sees this machine's whole filesystem (the CA key, the databases, other sessions). "
                "Install bubblewrap (scripts/install.sh does, as root) for a real sandbox.", why)


def _warn_no_cgroups(why: str) -> None:
    if f"cgroups: {why}" in _warned:      # once per process
        return
    _warned.add(f"cgroups: {why}")
    log.warning("WARNING: sessions run WITHOUT cgroup limits: %s. Each process of a session is bounded by "
                "rlimits only (its data segment at the memory limit, open files, file size) and its tmpfs "
                "mounts by their size; a session's processes together, its process count and its CPU are "
                "not bounded. Run the node as root on a host with the memory and pids controllers "
                "(cgroup v2, or v1) for real limits.", why)


def _claim(base: Path):
    """Lock base/.lock (released when the file returned is closed or collected, or this
    process ends); if no live runtime held it, remove what a killed one left in base.
    None: another live runtime uses base, and nothing is removed."""
    f = open(base / ".lock", "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        log.warning("%s is in use by another live runtime: its sessions are left alone", base)
        return None
    for entry in base.iterdir():
        if entry.name != ".lock" and entry.is_dir() and not (entry / KEPT).exists():
            shutil.rmtree(entry, ignore_errors=True)
    return f


def sweep_bridges(min_age: float = 60.0) -> None:
    """Remove the proxy sockets' directories in /tmp that no live node serves any more (a
    killed run's); a new one (its socket about to be bound) is left alone."""
    now = time.time()
    for d in glob.glob(os.path.join("/tmp", NET_PREFIX + "*")):
        sock = os.path.join(d, "proxy.sock")
        try:
            if os.path.exists(sock):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(1.0)
                    try:
                        s.connect(sock)
                        continue                # served: a live node's
                    except (ConnectionRefusedError, FileNotFoundError):
                        pass
            elif now - os.stat(d).st_mtime < min_age:
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)


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


def _remove_tree(path: Path) -> None:
    """A session's directory, whatever its image layer holds (a directory of mode 0555, the
    overlay's work directory of mode 000)."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                try:
                    os.chmod(p, 0o700)
                except OSError:
                    pass
    shutil.rmtree(path, ignore_errors=True)


def _git(argv: list[str], what: str) -> None:
    # by its absolute path; the node's own environment (its proxies, credentials), never a session's
    exe = host_tool("git")
    if exe is None:
        raise SetupError(f"{what}: git is not installed on this node")
    done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    if done.returncode != 0:
        raise SetupError(f"{what} failed: {done.stderr.strip()[-500:]}")


def _tail(path: Path, limit: int = 4000) -> str:
    """The end of a log the node opened in its own directory (path.parent): read without
    following a link put in its place, as a regular file only (safe_read)."""
    return safe_read.read_text(path.parent, path.name, limit, tail=True)
