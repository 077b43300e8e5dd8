"""The one way out of an isolated session's network namespace: a unix socket to the proxy.

A session runs in a new network namespace (bwrap's, or `unshare -n` in the fallback sandbox)
that has only a loopback device, so the harness and whatever commands the model makes it run
reach nothing, except this: inside, 127.0.0.1:PORT is forwarded over a unix socket (files
cross namespaces, sockets don't) to the node, which forwards it to the proxy. Run as a script
inside the namespace, it brings loopback up, listens, forks a forwarder and execs the harness,
so the harness keeps its own pid and the forwarder dies with it. Standard library only (bwrap
runs it with `python -I -S`): it starts in milliseconds.

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
        self._listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


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
