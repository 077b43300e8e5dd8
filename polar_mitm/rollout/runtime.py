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
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from .. import session_ids
from ..janitor import group_alive, janitor, kill_marked, uptime
from .bwrap import NETBRIDGE, NODE_INSIDE, Bwrap
from .bwrap import probe as bwrap_probe
from .images import ImageCache, ImageError, Lease, default_root, test_image
from .netbridge import UnixToTcp, die_with_parent
from .spec import Action, RuntimeSpec, Workspace

log = logging.getLogger("polar.sandbox")

SANDBOX_MARK = "POLAR_SANDBOX"
TEST_IMAGE = "polar-test:bookworm"     # the image scripts/build_test_image.sh builds (tests, the bug-fix tasks)
IMAGE_CACHE_ENV = "POLAR_IMAGE_CACHE"   # where a node unpacks images (default: images.default_root())
NET_PREFIX = "polar-net-"       # /tmp/polar-net-*: a proxy socket's directory
KEPT = ".kept"                  # a session directory kept on purpose (keep=True)


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
    tmp: Path
    logs: Path

    @property
    def inside_workdir(self) -> str: ...

    def run(self, argv: list[str], env: dict[str, str], timeout: float, log_name: str,
            proxy_port: int | None = None) -> RunResult: ...
    def cancel(self) -> None: ...
    def teardown(self) -> None: ...


class Runtime(Protocol):
    def prepare(self, session_id: str, workspace: Workspace, runtime: RuntimeSpec | None = None,
                actions: Sequence[Action] | None = None) -> Sandbox: ...


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

    def mount_argv(self) -> list[str]:
        """The command that mounts the overlay and execs the rest: unshare's own mount
        namespace (as root; elsewhere a user namespace as well, where the kernel lets one
        mount overlayfs)."""
        opts = f"lowerdir={self.lease.image.rootfs},upperdir={self.upper},workdir={self.work}"
        mount = f"mount -t overlay overlay -o {shlex.quote(opts)} {shlex.quote(str(self.merged))}"
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        return ["unshare", *user, "--mount", "--propagation", "private", "/bin/sh", "-c", f'{mount} && exec "$@"',
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

    def run(self, argv: list[str], env: dict[str, str], timeout: float, log_name: str,
            proxy_port: int | None = None) -> RunResult:
        t0 = time.monotonic()
        if self._cancelled:
            return RunResult(None, False, True, 0.0, "cancelled before start")
        if self.image is not None:
            env = self.image.environ(env)
        if self.bwrap:
            argv = self._bwrapped(self.bwrap, argv, env, proxy_port)
        else:
            env = {**env, SANDBOX_MARK: self.mark}
            argv = [*_drop_privileges(), *argv]
            if self.isolate:
                argv = self._isolated(self.isolate, argv, proxy_port)
        log = self.logs / f"{log_name}.log"
        with open(log, "wb") as out:
            proc = self._start(argv, env, out)
            if self._cancelled:      # cancel() ran between the check above and Popen
                self.cancel()
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            # The harness may leave tool processes behind (servers, sleeps): end them now,
            # whatever happened, so the evaluator sees a quiet workspace.
            if self.bwrap:
                self._end_sandbox(proc)
            else:
                self._end_group(proc)
            self._proc = self._pid1 = None
        code = None if (timed_out or self._cancelled) else proc.returncode
        return RunResult(code, timed_out and not self._cancelled, self._cancelled,
                         time.monotonic() - t0, _tail(log))

    def _start(self, argv: list[str], env: dict[str, str], out) -> subprocess.Popen:
        # Its own process group, and it dies if the node does: setpriv sets that signal and
        # execs it, so Popen can vfork. A preexec_fn would make it fork, which copies the
        # node's page tables while holding the GIL (a loop's node: 20-100 ms per session
        # start, every other thread of the process waiting).
        deathsig = _pdeathsig()
        kw = dict(cwd=self.root if self.image else self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                  stderr=subprocess.STDOUT, start_new_session=True,
                  preexec_fn=None if deathsig else die_with_parent)
        argv = [*deathsig, *argv]
        if not self.bwrap:
            self._proc = subprocess.Popen(argv, **kw)
            return self._proc
        # bwrap tells where its PID 1 is (JSON on --info-fd, written and closed at its start)
        r, w = os.pipe()
        with os.fdopen(r, "rb") as f:
            try:
                at = argv.index(self.bwrap.exe) + 1    # an image's: after the overlay's mount
                self._proc = subprocess.Popen([*argv[:at], "--info-fd", str(w), *argv[at:]], pass_fds=(w,), **kw)
            finally:
                os.close(w)
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
        sock_dir = None
        if proxy_port and self.network == "isolated":
            sock_dir = self._bridge(proxy_port)
        im = self.image
        if im is None:
            return bwrap.argv(argv, rw=[self.workdir, self.home, self.tmp], ro=[self.logs], env=env,
                              cwd=self.workdir, network=self.network, proxy_port=proxy_port, sock_dir=sock_dir,
                              hide=[self.root.parent])
        inner = bwrap.argv(argv, rw=[self.home, self.tmp], ro=[self.logs], env=env, cwd=im.workdir,
                           network=self.network, proxy_port=proxy_port, sock_dir=sock_dir, hide=[self.root.parent],
                           root=str(im.merged), binds=[(self.workdir, im.workdir)] if im.bound else [])
        return [*im.mount_argv(), *inner]

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
        for bridge, d in self._bridges:
            bridge.close()
            shutil.rmtree(d, ignore_errors=True)
        self._bridges.clear()
        if self.image is not None:
            self.image.lease.release()
        if not self.keep:
            _remove_tree(self.root)
        elif self.root.exists():
            (self.root / KEPT).touch()     # kept on purpose: the next start leaves it


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
                 sandbox: str | None = None, expose=()):
        self.base = Path(base) if base else Path(tempfile.mkdtemp(prefix="polar-sessions-"))
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
                actions: Sequence[Action] | None = None) -> LocalSandbox:
        """A session's sandbox: its directories, its workspace, and with runtime its image's
        root with runtime.prepare's actions run in it (actions: these instead, as a grading
        environment's eval_prepare). SetupError where any of it fails."""
        safe = session_ids.file_safe(session_id)
        root = Path(tempfile.mkdtemp(prefix=f"{safe}-", dir=self.base))
        if not self._watched and not self.bwrap:     # bwrap's sandboxes die with this process
            janitor().watch_marks(f"{SANDBOX_MARK}={self.mark}.", uptime())
            self._watched = True
        box = LocalSandbox(root, self.keep, self.isolate, mark=f"{self.mark}.{uuid.uuid4().hex}",
                           bwrap=self.bwrap, network=self.network)
        box.lock = self._lock
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
            self.images = ImageCache(Path(os.environ.get(IMAGE_CACHE_ENV) or default_root()))
        try:
            # the test image (scripts/build_test_image.sh) by its name: built here the first time
            ref = str(test_image()) if runtime.image == TEST_IMAGE else runtime.image
            lease = self.images.lease(ref)
        except ImageError as e:
            raise SetupError(str(e)) from None
        cfg = lease.image.config or {}
        env = dict(v.split("=", 1) for v in cfg.get("Env") or [] if "=" in v)
        layer = ImageLayer(lease=lease, workdir=runtime.workdir or cfg.get("WorkingDir") or "/workspace",
                           env={**env, **runtime.env}, upper=root / "layer" / "upper", work=root / "layer" / "work",
                           merged=root / "layer" / "root", bound=bool(workspace.path or workspace.git))
        for d in (layer.upper, layer.work, layer.merged):
            d.mkdir(parents=True)
        return layer


_DROP: tuple[str, ...] | None = None
_DEATHSIG: tuple[str, ...] | None = None


def _setpriv() -> str | None:
    return shutil.which("setpriv") or next((p for p in ("/usr/bin/setpriv", "/bin/setpriv") if os.path.exists(p)),
                                           None)


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
