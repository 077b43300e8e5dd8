"""What an evaluator sees of its session, made where a session path is never followed: run by
the node (as root, in a mount namespace of its own) just before the evaluator's bwrap.

    python -I -S evalview.py SPEC_JSON -- BWRAP ARGV...

SPEC_JSON holds:
- "mounts": [[options, target], ...]: overlay mounts, made in order (the evaluator's fresh
  root over the image, and a read-only view of the session's layer over the image);
- "binds": [[base, relative, dest, required, label], ...]: base/relative opened one component at a
  time without following links (a link, a FIFO, a device or anything but a regular file or
  a directory is refused), then shown read-only at dest with bwrap's --ro-bind-fd: bwrap
  mounts the very file opened here, never a path the session could have swapped. A refused
  one is left out (an evaluator that needs it fails as it would without it), or, where
  required (the workdir), ends the run with exit 126: the session's doing;
- "status": a file in a node-made directory that nothing in the sandbox sees: "ok" is
  written there just before bwrap starts, anything else says why the view could not be
  made (the grader's failure, never the policy's).

The binds go where BWRAP ARGV holds MARK, in order (the workdir's last). Standard library only."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

MARK = "@polar-eval-binds@"
REFUSED = 126          # a required path of the session's is not a plain directory or file


def _status(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def open_below(base: str, relative: str) -> int:
    """An O_PATH fd on base/relative, no component followed if it is a link; OSError where
    the path is missing, holds a link, or ends in anything but a regular file or directory."""
    parts = [p for p in relative.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise OSError(f"{relative!r} leaves its base")
    fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts:
            nxt = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                raise OSError(f"{name} is a link, which is not followed")
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise OSError("not a regular file or a directory")
        return fd
    except BaseException:
        os.close(fd)
        raise


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    if argv[2] != "--" or MARK not in argv:
        print("evalview: usage: evalview.py SPEC -- BWRAP ARGV (with the bind mark)", file=sys.stderr)
        return 2
    status = spec["status"]
    clean = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    for options, target in spec.get("mounts", []):
        done = subprocess.run([spec["mount"], "-t", "overlay", "overlay", "-o", options, target],
                              capture_output=True, text=True, env=clean)
        if done.returncode != 0:
            _status(status, f"mounting {target} failed: {done.stderr.strip()[-300:]}")
            return 1
    extra: list[str] = []
    for base, relative, dest, required, label in spec.get("binds", []):
        try:
            fd = open_below(base, relative)
        except OSError as e:
            why = e.strerror or str(e)
            if required:
                print(f"polar: the session's {label} is not shown to the evaluator: {why}", file=sys.stderr)
                _status(status, "ok")
                return REFUSED
            print(f"polar: evaluator.reads {label}: not shown ({why})", file=sys.stderr)
            continue
        os.set_inheritable(fd, True)
        extra += ["--ro-bind-fd", str(fd), dest]
    bwrap = argv[3:]
    at = bwrap.index(MARK)
    bwrap[at:at + 1] = extra
    _status(status, "ok")
    try:
        os.execv(bwrap[0], bwrap)
    except OSError as e:
        _status(status, f"starting {bwrap[0]} failed: {e}")
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
