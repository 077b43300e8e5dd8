"""Tries to get out of a session's sandbox, from inside it (the `command` harness, then the
evaluator), and writes what each attempt got to escape-<NAME>.json in the workspace (or,
where it is read-only, in its HOME):
"blocked: <errno>" where it failed, "ESCAPED: ..." where it got through; listings are what
the sandbox shows. Standard library only. Usage: python escape_probe.py NAME (targets.json,
written by the test, names the node's paths and ports)."""

import errno
import glob
import json
import os
import socket
import sys


def attempt(fn, *args):
    try:
        return f"ESCAPED: {fn(*args)!r}"[:300]
    except OSError as e:
        return f"blocked: {errno.errorcode.get(e.errno, type(e).__name__)}"


def read(path):
    with open(path, "rb") as f:
        return f.read(40)


def write(path):
    with open(path, "w") as f:
        f.write("x")
    return "written"


def tcp(host, port):
    socket.create_connection((host, port), timeout=3).close()
    return "connected"


def unix(path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        s.connect(path)
    return "connected"


def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        return f"blocked: {errno.errorcode.get(e.errno, type(e).__name__)}"


def processes():
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode(errors="replace").strip())
        except OSError:
            pass
    return out


t = json.load(open("targets.json"))
got = {
    "host unix socket": attempt(unix, t["unix"]),
    "host abstract unix socket": attempt(unix, "\0" + t["abstract"]),
    "CA key": attempt(read, t["ca_key"]),
    "database": attempt(read, t["db"]),
    "sibling session file": attempt(read, os.path.join(t["sibling"], "work", "secret.txt")),
    "running sibling's file": glob.glob(os.path.join(t["base"], "*", "work", "secret.txt")),
    "TCP to the host's address": attempt(tcp, t["host_ip"], t["host_port"]),
    "TCP to the host's loopback": attempt(tcp, "127.0.0.1", t["host_port"]),
    "TCP to 1.1.1.1:443": attempt(tcp, "1.1.1.1", 443),
    "TCP to 1.1.1.1:53": attempt(tcp, "1.1.1.1", 53),
    "/etc/shadow": attempt(read, "/etc/shadow"),
    "write /usr": attempt(write, "/usr/polar-escape"),
    "write /": attempt(write, "/polar-escape"),
    # what the sandbox shows of the node: listings, the proxy, the CA certificate
    "ls CA dir": listing(os.path.dirname(t["ca_key"])),
    "ls database dir": listing(os.path.dirname(t["db"])),
    "ls sessions": listing(t["base"]),
    "ls /tmp": listing("/tmp"),
    "ls /run": listing("/run"),
    "ls /": listing("/"),
    "processes": processes(),
    "proxy": attempt(tcp, "127.0.0.1", t["proxy_port"]),
    "CA cert": attempt(read, t["ca_cert"]),
}
try:
    out = open(f"escape-{sys.argv[1]}.json", "w")
except OSError:      # the evaluator sees the workspace read-only: its own HOME then
    out = open(os.path.join(os.environ["HOME"], f"escape-{sys.argv[1]}.json"), "w")
with out as f:
    json.dump(got, f, indent=1)
