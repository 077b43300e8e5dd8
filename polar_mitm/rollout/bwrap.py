"""A session's sandbox made by bubblewrap (`bwrap`): what the harness may see and reach.

Each run (the harness, then the evaluator) is one `bwrap` with every namespace unshared:

- processes: its own PID namespace. bwrap's init is its PID 1; when the command exits, or
  bwrap is killed (the node kills it, or the node dies: PDEATHSIG), PID 1 exits and the kernel
  kills every process left in the namespace, whatever its process group, session or
  environment (`setsid env -i`, double forks). Nothing is marked, nothing scans /proc.
- network: its own namespace with loopback only. With a proxy port, 127.0.0.1:PORT there leads
  to the proxy and nothing else leads out: the node makes the namespace and listens in it
  (netbridge.NetnsBridge) and the sandbox joins it (`nsenter --net` around bwrap, with
  --share-net: every other namespace is still its own), so nothing of the node runs inside;
  where the node may not make one, netbridge.py runs inside, on the node's Python, and
  forwards to a unix socket that the node joins to the proxy. The harness's HTTPS_PROXY
  address works unchanged. Host unix sockets are out of sight (a private /tmp and /run) and
  abstract ones belong to the host's network namespace.
- environment: bwrap and the helpers around it run with a clean one (HOST_ENV); the
  command's own (an image's Env, the task's) is set inside only (`--clearenv`, `--setenv`,
  read from a file descriptor: `env_args`), so an image's LD_PRELOAD or relative PATH never
  reaches a program the node runs as root outside.
- files: a read-only root of the system directories (/usr, /bin, /lib*, /etc without its
  secrets), the node's Python, Node.js and the harness installs; the session's workspace,
  HOME and TMPDIR read-write at their own paths; its logs read-only; the CA certificate the
  harness is given (never a file holding a private key). Nothing else of the node: no CA key,
  no database, no sibling session, no host /tmp.
- privileges: every capability dropped, a new session (no terminal to type into).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from .harnesses import CA_VARS, harness_root

NETBRIDGE = str(Path(__file__).with_name("netbridge.py"))
INSIDE = "/run/polar"                   # the bridge and the proxy's socket, as the sandbox sees them
NODE_INSIDE = "/run/polar/bin"          # in an image's sandbox: Node.js, first on its PATH
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# What of /etc is the node's own secret: hidden (an empty file, an empty directory).
SECRET_FILES = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers",
                "/etc/security/opasswd", "/etc/krb5.keytab")
SECRET_DIRS = ("/etc/ssh", "/etc/ssl/private", "/etc/sudoers.d", "/etc/polkit-1", "/etc/docker",
               "/etc/containerd", "/etc/kubernetes", "/etc/wireguard", "/etc/letsencrypt")
EXPOSE_ENV = "POLAR_SANDBOX_EXPOSE"      # more read-only paths, os.pathsep-separated
# The sandbox's writable memory-backed mounts (tmpfs): /tmp, /var/tmp, and /dev/shm in a /dev
# that is otherwise read-only (bwrap's /dev is a tmpfs of its own). `sized` gives each a size;
# a cgroup charges their pages to the session's memory (limits.py).
TMPFS = ("/tmp", "/var/tmp", "/dev/shm")
SCRATCH = ("--dev", "/dev", "--tmpfs", "/dev/shm", "--remount-ro", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp")
# What bwrap and the helpers around it (setpriv, nsenter, unshare, mount) get as their own
# environment: nothing of the command's.
HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def node_paths(expose=()) -> list[str]:
    """The node's own paths a sandbox sees read-only, besides the system: its Python (the
    bridge runs on it, and commands may use it), Node.js, the harness installs, and what is
    exposed (the argument, then $POLAR_SANDBOX_EXPOSE)."""
    paths = [sys.base_prefix, sys.prefix, str(harness_root())]
    node = shutil.which("node")
    if node:
        paths.append(str(Path(os.path.realpath(node)).parent.parent))   # its prefix: bin/, lib/node_modules
    paths += [str(p) for p in expose]
    paths += [p for p in os.environ.get(EXPOSE_ENV, "").split(os.pathsep) if p]
    return paths


def _covered(path: str, by: list[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in by)


def _holds_a_key(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"PRIVATE KEY" in f.read(1 << 20)
    except OSError:
        return True


class Bwrap:
    """How this node starts its sandboxes with bubblewrap: the fixed part of the arguments,
    made once; `argv` adds a session's own paths and its command."""

    def __init__(self, exe: str, expose=()):
        self.exe = exe
        self.python = os.path.realpath(sys.executable)
        ro: list[str] = []
        for p in sorted({os.path.abspath(p) for p in node_paths(expose)}, key=lambda p: (p.count("/"), p)):
            if os.path.exists(p) and not _covered(p, ro) and not _covered(p, ["/usr", "/etc"]):
                ro.append(p)
        args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        for d in SYSTEM:
            if os.path.islink(d):           # merged /usr: /bin -> usr/bin
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        for f in SECRET_FILES:
            if os.path.isfile(f) and not os.path.islink(f):
                args += ["--ro-bind", "/dev/null", f]
        for d in SECRET_DIRS:
            if os.path.isdir(d) and not os.path.islink(d):
                args += ["--tmpfs", d, "--remount-ro", d]
        args += ["--proc", "/proc", *SCRATCH]
        for p in ro:
            args += ["--ro-bind", p, p]
        self.readonly = ro
        self.fixed = args
        self.can_size = _has_size_option(exe)

    def image_fixed(self, root: str) -> list[str]:
        """An image's sandbox: root (the session's writable layer over the image) as /, and
        of the node only what runs the harness and the bridge, read-only: its Python (at its
        own paths), the harness installs, and Node.js's binary at NODE_INSIDE (its prefix may
        be /usr, which is the image's)."""
        args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--bind", root, "/",
                "--proc", "/proc", *SCRATCH]
        for p in self.readonly:
            args += ["--ro-bind", p, p]
        node = shutil.which("node")
        if node:
            args += ["--ro-bind", os.path.realpath(node), f"{NODE_INSIDE}/node"]
        return args

    def argv(self, argv: list[str], *, rw: list[Path], ro: list[Path], env: dict[str, str], cwd: Path | str,
             network: str, proxy_port: int | None = None, sock_dir: str | None = None,
             hide: Sequence[Path] = (), root: str | None = None,
             binds: Sequence[tuple[Path, str]] = (), joined: bool = False) -> list[str]:
        """The bwrap command line that runs argv in cwd, with rw and ro shown at their own
        paths over empty directories at `hide`, and each (path, where) of binds read-write at
        where. network: "isolated" (loopback; with proxy_port and sock_dir, 127.0.0.1:proxy_port
        inside leads to the unix socket sock_dir/proxy.sock outside) or "host". joined: the
        sandbox keeps the network namespace it is started in (one the node made, which
        nsenter joined). root: an image's root filesystem (writable: the session's own layer)
        instead of the node's. env is only read here (the CA variables): `env_args` sets it."""
        args = [self.exe, *(self.image_fixed(root) if root else self.fixed)]
        if network == "host" or joined:
            args.append("--share-net")
        shown = [str(p) for p in rw + ro]
        masks: list[str] = []           # empty directories: read-only once the binds below are in
        # the CA certificate, never its key (were the certificate's directory exposed, an empty
        # one goes over it: the key beside it stays out of sight)
        cas = [p for p in dict.fromkeys(env.get(var) for var in CA_VARS)
               if p and os.path.isfile(p) and not _covered(p, shown)]
        for d in dict.fromkeys(os.path.dirname(p) for p in cas):
            if _covered(d, self.readonly):
                masks.append(d)
                args += ["--tmpfs", d]
        for path in cas:
            if not _holds_a_key(path):
                args += ["--ro-bind", path, path]
        for d in map(str, hide):        # the sessions' directory, were it exposed: this one's alone shows
            if _covered(d, self.readonly):
                masks.append(d)
                args += ["--tmpfs", d]
        for p in rw:
            args += ["--bind", str(p), str(p)]
        for p, where in binds:
            args += ["--bind", str(p), where]
        for p in ro:
            args += ["--ro-bind", str(p), str(p)]
        bridged = network != "host" and not joined and bool(proxy_port) and bool(sock_dir)
        if bridged and proxy_port and sock_dir:
            args += ["--ro-bind", NETBRIDGE, f"{INSIDE}/netbridge.py", "--ro-bind", sock_dir, f"{INSIDE}/net"]
            if proxy_port < 1024:       # a privileged port, bound in the sandbox's own network only
                args += ["--cap-add", "CAP_NET_BIND_SERVICE"]
        for d in masks:
            args += ["--remount-ro", d]
        if not root:      # an image's root is the session's own layer: it writes there
            args += ["--remount-ro", "/"]
        args += ["--chdir", str(cwd), "--"]
        if bridged:
            args += [self.python, "-I", "-S", f"{INSIDE}/netbridge.py", str(proxy_port),
                     f"{INSIDE}/net/proxy.sock", "--"]
        return [*args, *argv]


def env_args(env: dict[str, str]) -> bytes:
    """bwrap's arguments that give the command exactly env, NUL-separated for `--args FD`:
    on its command line they would show the session's credential to every user of the host."""
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise ValueError(f"environment variable {k!r}: a name with '=' or NUL, or a value with NUL")
    args = ["--clearenv"]
    for k, v in env.items():
        args += ["--setenv", k, v]
    return b"".join(a.encode("utf-8", "surrogateescape") + b"\0" for a in args)


def _has_size_option(exe: str) -> bool:
    """Whether this bwrap sizes a tmpfs (--size: bubblewrap 0.7 and later)."""
    try:
        done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=10, env=HOST_ENV)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--size" in done.stdout + done.stderr


def sized(argv: list[str], exe: str, size: int) -> list[str]:
    """argv (a command line with bwrap in it, `exe`) with each writable tmpfs of bwrap's
    (TMPFS) at most `size` bytes (`--size`, bwrap 0.7 and later): without a cgroup's memory
    limit they would take the node's RAM, as much as a session writes to them."""
    if exe not in argv:
        return argv
    at = argv.index(exe) + 1
    end = argv.index("--", at) if "--" in argv[at:] else len(argv)
    out = argv[:at]
    i = at
    while i < end:
        if argv[i] == "--tmpfs" and i + 1 < end and argv[i + 1] in TMPFS and out[-2:-1] != ["--size"]:
            out += ["--size", str(size)]
        out.append(argv[i])
        i += 1
    return out + argv[end:]


@functools.cache
def probe(expose: tuple[str, ...] = ()) -> tuple[Bwrap | None, str]:
    """(a Bwrap, "") where bubblewrap starts a sandbox here (the node's Python runs in it,
    on loopback only), else (None, why not)."""
    exe = shutil.which("bwrap")
    if not exe:
        return None, "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    bw = Bwrap(exe, expose)
    with tempfile.TemporaryDirectory(prefix="polar-bwrap-probe-") as d:
        check = "import socket; socket.create_server(('127.0.0.1', 0)).close(); print('ok')"
        argv = bw.argv([bw.python, "-I", "-S", "-c", check], rw=[Path(d)], ro=[], env={}, cwd=Path(d),
                       network="isolated")
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"{exe} could not start a sandbox: {e}"
    if done.returncode != 0 or done.stdout.strip() != "ok":
        return None, f"{exe} could not start a sandbox (exit {done.returncode}): {done.stderr.strip()[-300:]}"
    return bw, ""
