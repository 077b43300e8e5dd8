"""Gaps found in the call log design, each reproduced deterministically and now closed:
a reader the proxy died on, a failed (partial) append, a second writer on one database.
Each runs its writer in a child process, killed -9 where the scenario needs a crash."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path


from polar_mitm.store import query

ROOT = str(Path(__file__).resolve().parents[2])


def writer_process(db: Path, body: str, *args: str) -> subprocess.Popen:
    """A child process with a CallWriter `w` on db, running `body`; rec(i) makes a record."""
    code = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, {root!r})
        from polar_mitm.store import CallRecord, CallWriter, SessionInfo
        def rec(i):
            return CallRecord(str(i), request_text="x", started_at=time.time(), status_code=200)
        w = CallWriter({db!r}, load_interval=float(sys.argv[1])).start()
    """).format(root=ROOT, db=str(db)) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(10)


def test_a_read_begun_while_the_proxy_lived_sees_what_it_acknowledged(tmp_path):
    db = tmp_path / "a.duckdb"
    p = writer_process(db, """
        for i in range(5):
            w.submit(SessionInfo("s"), rec(i)).result(10)
        print("acked", flush=True)
        time.sleep(60)
    """, "3600")   # it loads only when a reader asks
    try:
        assert p.stdout.readline().strip() == "acked"
        p.send_signal(signal.SIGSTOP)          # hung, or busy: it cannot answer the reader
        seen = {}
        t = threading.Thread(target=lambda: seen.update(rows=query(db, "SELECT count(*) FROM calls")[1]))
        t.start()
        time.sleep(0.5)
    finally:
        kill(p)                                # ... and dies before it does
    t.join(30)
    assert query(db, "SELECT count(*) FROM calls")[1] == [(5,)]   # durable: the next read has them
    assert seen["rows"] == [(5,)]


def test_a_failed_append_does_not_swallow_the_next_acknowledged_call(tmp_path):
    db = tmp_path / "a.duckdb"
    p = writer_process(db, """
        import errno
        w.submit(SessionInfo("s"), rec(0)).result(10)
        real = w._log._f

        class DiskFull:                        # half the batch is written, then ENOSPC
            failed = False
            def write(self, view):
                if not self.failed:
                    self.failed = True
                    return real.write(view[:len(view) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            def fileno(self):
                return real.fileno()
            def close(self):
                real.close()

        w._log._f = DiskFull()
        try:
            w.submit(SessionInfo("s"), rec(1)).result(10)
            print("c1 acknowledged", flush=True)
        except OSError:
            print("c1 failed", flush=True)
        if isinstance(w._log._f, DiskFull):    # space freed (a log that moved on keeps its file)
            w._log._f = real
        w.submit(SessionInfo("s"), rec(2)).result(10)
        print("c2 acknowledged", flush=True)
        time.sleep(60)
    """, "3600")
    try:
        lines = [p.stdout.readline().strip() for _ in range(2)]
    finally:
        kill(p)                                # before the loader took c2
    assert lines == ["c1 failed", "c2 acknowledged"]
    stored = [r[0] for r in query(db, "SELECT call_id FROM calls ORDER BY seq")[1]]
    assert "2" in stored and "1" not in stored


def test_a_second_writer_on_one_database_loses_nothing(tmp_path):
    db = tmp_path / "a.duckdb"
    body = """
        print("started", flush=True)
        for line in sys.stdin:
            w.submit(SessionInfo(sys.argv[2]), rec(line.strip())).result(10)
            print("acked", flush=True)
    """
    acked = []

    def call(p, name):
        p.stdin.write(f"{name}\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "acked"
        acked.append(name)

    a = writer_process(db, body, "0.2", "a")
    b = None
    try:
        assert a.stdout.readline().strip() == "started"
        for i in range(3):
            call(a, f"a{i}")
        time.sleep(0.5)
        b = writer_process(db, body, "0.2", "b")
        assert b.stdout.readline().strip() == ""      # refused: it never starts
        assert b.wait(30) != 0
        time.sleep(3)                          # a idles and lets go of the file
        for i in range(3, 6):
            call(a, f"a{i}")
    finally:
        for p in (a, b):
            if p:
                kill(p)                        # both crash before loading the last calls
    stored = {r[0] for r in query(db, "SELECT call_id FROM calls")[1]}
    assert set(acked) <= stored, sorted(set(acked) - stored)
