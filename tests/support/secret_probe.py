"""Looks for a node's secrets from inside a session of the fallback sandbox: every other
process's command line, environment and memory, and every file of the given directories.
Writes what it could read into the folder `seen/` of the workspace (the test greps it for
the control token) and what each read got into probe.json. Standard library only.
Usage: python secret_probe.py DIR..."""

import errno
import json
import os
import re
import sys

os.makedirs("seen", exist_ok=True)
report: dict = {"processes": {}, "files": {}}
me = os.getpid()


def keep(name: str, data: bytes) -> None:
    with open(os.path.join("seen", re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:200]), "wb") as f:
        f.write(data)


def why(e: OSError) -> str:
    return f"blocked: {errno.errorcode.get(e.errno, type(e).__name__)}"


def memory(pid: int, limit: int = 256 << 20) -> str:
    """Every readable mapping of the process (bounded), kept for the grep."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
        read = 0
        chunks = []
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if "r" not in line.split()[1] or hi - lo > 64 << 20:
                continue
            try:
                mem.seek(lo)
                chunks.append(mem.read(hi - lo))
            except OSError:
                continue
            read += hi - lo
            if read > limit:
                break
        keep(f"mem-{pid}", b"".join(chunks))
        return f"read {read} bytes"


for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == me:
        continue
    pid = int(entry)
    seen: dict = {}
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                data = f.read()
            keep(f"{name}-{pid}", data)
            seen[name] = data.replace(b"\0", b" ").decode(errors="replace")[:300]
        except OSError as e:
            seen[name] = why(e)
    cmd = seen.get("cmdline", "")
    if isinstance(cmd, str) and ("mitmdump" in cmd or "pytest" in cmd or "polar" in cmd):
        try:
            seen["mem"] = memory(pid)
        except OSError as e:
            seen["mem"] = why(e)
        try:    # its open files (a pipe or a deleted file would still hold what was in it)
            opened = {}
            for fd in sorted(os.listdir(f"/proc/{pid}/fd"))[:50]:
                try:
                    with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
                        os.set_blocking(f.fileno(), False)
                        keep(f"fd-{pid}-{fd}", f.read(1 << 20) or b"")
                    opened[fd] = "read"
                except OSError as e:
                    opened[fd] = why(e)
            seen["fds"] = opened
        except OSError as e:
            seen["fds"] = why(e)
    report["processes"][pid] = seen

for top in sys.argv[1:]:
    for root, _, files in os.walk(top):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    keep(f"file-{path}", f.read(1 << 20))
                report["files"][path] = "read"
            except OSError as e:
                report["files"][path] = why(e)

with open("probe.json", "w") as f:
    json.dump(report, f, indent=1)
print("probed", len(report["processes"]), "processes")
