"""Finding test processes by their command line, for tests that check what survived."""

from __future__ import annotations

import os
import random
import time


def alive(token: str) -> list[int]:
    """Live (not zombie) processes whose command line contains token."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmd and state not in (b"Z", b"X") and int(pid) != os.getpid():
            out.append(int(pid))
    return out


def token() -> str:
    """Digits for a sleep's argument that no other test's sleep has."""
    return f"86{random.randrange(10_000, 99_999)}"


def until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()
