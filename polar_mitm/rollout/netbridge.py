"""The one way out of an isolated session's network namespace: a listener on its loopback
that leads to the proxy.

A session runs in a new network namespace that has only a loopback device, so the harness and
whatever commands the model makes it run reach nothing, except 127.0.0.1:PORT, which leads to
the proxy. Two ways to make that:

- NetnsBridge (where the node may make network namespaces: root): the node makes the
  namespace itself, in a thread of its own, and listens on its loopback there; the sandbox
  joins it (`nsenter --net=...` around bwrap, with bwrap's --share-net). Nothing of the node
  runs inside the sandbox, so any image runs (musl, static, distroless, an older glibc), and
  the listener is up before the sandbox starts.
- Run as a script inside the namespace (bwrap's own, or `unshare -n` in the fallback sandbox):
  it brings loopback up, listens, forks a forwarder and execs the harness, so the harness
  keeps its own pid and the forwarder dies with it; it forwards over a unix socket (files
  cross namespaces, sockets don't) to UnixToTcp in the node. Standard library only (bwrap
  runs it with `python -I -S`): it starts in milliseconds. It runs on the node's Python,
  so in an image only where the image has the node's libc.

    python netbridge.py PORT UNIX_SOCKET -- HARNESS ARGV...     (PORT 0: loopback only)
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys
import threading

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
CLONE_NEWNET = 0x40000000


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def loopback_up() -> None:
    """Bring loopback up, unless it is (bwrap brings it up, then drops the capability to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _splice(client: socket.socket, connect) -> None:
    try:
        upstream = connect()
    except OSError:
        client.close()
        return
    t = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    t.start()
    _pump(client, upstream)
    t.join()
    client.close()
    upstream.close()


def serve(listener: socket.socket, connect, stop: threading.Event | None = None) -> None:
    """Accept forever (or until stop), joining each connection to connect()."""
    while stop is None or not stop.is_set():
        try:
            client, _ = listener.accept()
        except OSError:
            if stop is not None and stop.is_set():
                return
            continue
        threading.Thread(target=_splice, args=(client, connect), daemon=True).start()


class UnixToTcp:
    """The node's side: a unix socket that leads to the proxy's TCP port."""

    def __init__(self, path: str, port: int):
        self.path, self.port = path, port
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(64)
        threading.Thread(target=serve, args=(self._listener, self._connect, self._stop), daemon=True).start()

    def _connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port))

    def close(self) -> None:
        self._stop.set()
        _shut(self._listener)
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _shut(listener: socket.socket) -> None:
    # shutdown first: on Linux it wakes the thread blocked in accept(), which close alone
    # leaves blocked for good (a thread and the namespace kept per session)
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()


class NetnsBridge:
    """A network namespace of the session's own, made by the node, with loopback up and
    127.0.0.1:port listening in it; each connection is joined to 127.0.0.1:upstream in the
    node's own namespace (the proxy). `path` is what a sandbox joins (`nsenter --net=PATH`):
    the node holds the namespace open until close(), and it goes with the node's process.
    OSError where this process may not make a network namespace (it needs CAP_SYS_ADMIN)."""

    def __init__(self, port: int, upstream: int):
        self.upstream = upstream
        made: dict = {}
        # A thread of its own enters the new namespace and leaves it (setns): namespaces are
        # per thread, and no other thread of the node ever sees it.
        t = threading.Thread(target=self._make, args=(port, made), name="netns-bridge")
        t.start()
        t.join()
        if "error" in made:
            raise made["error"]
        self._nsfd: int | None = made["nsfd"]
        self._listener: socket.socket = made["listener"]
        self.path = f"/proc/{os.getpid()}/fd/{self._nsfd}"
        self._stop = threading.Event()
        threading.Thread(target=serve, args=(self._listener, self._connect, self._stop), daemon=True,
                         name=f"netns-bridge-{port}").start()

    @staticmethod
    def _make(port: int, made: dict) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.unshare(CLONE_NEWNET) != 0:
                e = ctypes.get_errno()
                made["error"] = OSError(e, f"unshare(CLONE_NEWNET): {os.strerror(e)}")
                return
            try:
                made["nsfd"] = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                loopback_up()
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", port))
                listener.listen(64)
                made["listener"] = listener     # a socket stays in the namespace it was made in
            except OSError as e:
                made["error"] = e
                if "nsfd" in made:
                    os.close(made["nsfd"])
        finally:
            libc.setns(home, CLONE_NEWNET)      # back home; the thread ends here either way
            os.close(home)

    def _connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.upstream))

    def close(self) -> None:
        self._stop.set()
        _shut(self._listener)
        if self._nsfd is not None:
            os.close(self._nsfd)
            self._nsfd = None


def main(argv: list[str]) -> None:
    port, path, sep, cmd = int(argv[0]), argv[1], argv[2], argv[3:]
    assert sep == "--" and cmd, __doc__
    loopback_up()
    if port == 0:               # loopback only, nothing leads out (the evaluator)
        os.execvp(cmd[0], cmd)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    harness = os.getpid()
    if os.fork() == 0:          # the forwarder: it ends with the harness, whatever kills it
        die_with_parent()
        if os.getppid() != harness:
            os._exit(0)
        serve(listener, connect)
        os._exit(0)
    listener.close()
    os.execvp(cmd[0], cmd)      # the harness, with the listener already up


if __name__ == "__main__":
    main(sys.argv[1:])
