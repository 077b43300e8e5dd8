"""The loader under failures: every acknowledged call stored exactly once, whatever fails
when, and loading goes on after each fault.

Faults are injected into the loader's DuckDB connection at every point of a load: before
the insert, after it (before COMMIT), after a COMMIT that landed (DuckDB raises when its
autocheckpoint fails), in the checkpoint, a database invalidated after COMMIT, out of
memory; and kill -9 of the process between COMMIT and the next step."""

from __future__ import annotations

from dataclasses import replace
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import pytest

from polar_mitm.store import CallWriter, SessionInfo, init_db, log_dir, query
from polar_mitm.store import loader as loader_module
from polar_mitm.store.calllog import LogAppender, log_end
from polar_mitm.store.calllog_owner import claim_log
from polar_mitm.store.lines import dumps
from polar_mitm.store.load_batch import PositionMoved
from polar_mitm.store.loader import Loader, LoaderConfig, catch_up
from polar_mitm.store.log_rows import MAIN
from support import SUPPORT
from support.loader_faults import Faults, faulty_connect, record

ROOT = Path(__file__).resolve().parents[2]


def assert_exactly_once(db: Path, call_ids: list[str], unacknowledged: set[str] = frozenset()) -> None:
    """Every acknowledged call stored once; `unacknowledged` ones (durable when the process
    died, before the client heard) at most once; nothing else."""
    rows = query(db, "SELECT call_id, count(*) FROM call_records GROUP BY 1")[1]
    stored = dict(rows)
    assert len(call_ids) == len(set(call_ids))
    missing = [c for c in call_ids if c not in stored]
    twice = {c: n for c, n in stored.items() if n > 1}
    assert not missing, f"{len(missing)} acknowledged calls are not stored: {missing[:5]}"
    assert not twice, f"{len(twice)} calls are stored more than once: {list(twice.items())[:5]}"
    assert set(stored) <= set(call_ids) | set(unacknowledged)
    n = len(stored)
    assert query(db, "SELECT count(*), count(DISTINCT call_id) FROM call_records")[1] == [(n, n)]
    assert query(db, "SELECT count(*) FROM calls")[1] == [(n,)]   # one row per call


KINDS = ("before_insert", "after_insert", "after_commit", "checkpoint", "invalidated", "oom")


def test_every_fault_of_a_load_leaves_every_acknowledged_call_stored_exactly_once(tmp_path, monkeypatch):
    faults = Faults([None, "before_insert", None, "after_insert", "after_commit", None, "checkpoint",
                     "invalidated", None, "oom", "after_commit", "checkpoint"])
    monkeypatch.setattr(loader_module, "connect", faulty_connect(faults))
    db = tmp_path / "a.duckdb"
    w = CallWriter(db, load_interval=0.02).start()
    w.idle_release = 3600
    acked: list[str] = []
    try:
        for wave in range(24):   # waves of calls: tail loads between them, whole row groups
            n = 2048 + 300 if wave in (5, 15) else 120
            base = len(acked)
            futs = [w.submit(SessionInfo(f"s~{(base + i) % 37}", task_id="s"), record(base + i))
                    for i in range(n)]
            for i, f in enumerate(futs):
                f.result(30)
                acked.append(f"c{base + i}")
            time.sleep(0.15)
        deadline = time.monotonic() + 60
        while w.pending_lines and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.pending_lines == 0, "loading did not resume after the faults"
        # The faults end; one more call loads cleanly. (The health below is the last load's:
        # one that a fault failed after the rest was in, three times, read "failing".)
        faults.enabled = False
        w.submit(SessionInfo("s~0", task_id="s"), record(len(acked))).result(30)
        acked.append(f"c{len(acked)}")
        deadline = time.monotonic() + 60
        while w.pending_lines and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.pending_lines == 0
    finally:
        w.close()
    assert len(acked) > 5000
    assert all(faults.fired[k] >= 1 for k in KINDS), faults.fired
    assert w.load_errors == sum(faults.fired.values())
    assert w.health()["state"] == "ok"
    assert_exactly_once(db, acked)
    # whole row groups were loaded too (straight to the file), not only tail loads
    assert query(db, f"SELECT count(*) FROM {MAIN}")[1][0][0] >= 2048


def test_a_loader_that_keeps_failing_says_so_and_recovers_when_the_database_does(tmp_path, monkeypatch):
    faults = Faults(["before_insert"])   # every load fails
    monkeypatch.setattr(loader_module, "connect", faulty_connect(faults))
    db = tmp_path / "a.duckdb"
    w = CallWriter(db, load_interval=0.01).start()
    w.idle_release = 3600
    try:
        futs = [w.submit(SessionInfo("s~1"), record(i)) for i in range(50)]
        assert [f.result(10) for f in futs] == list(range(1, 51))   # acknowledged all the same
        deadline = time.monotonic() + 20
        while w.health()["state"] != "failing" and time.monotonic() < deadline:
            time.sleep(0.05)
        health = w.health()
        assert health["state"] == "failing" and health["failures"] >= 3
        assert "injected: before_insert" in health["last_error"]
        assert w.pending_lines == 50
        # still acknowledging while failing
        assert w.submit(SessionInfo("s~1"), record(50)).result(10) == 51
        faults.enabled = False   # the database is usable again
        deadline = time.monotonic() + 20
        while (w.pending_lines or w.health()["state"] != "ok") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.pending_lines == 0 and w.health()["state"] == "ok"
    finally:
        w.close()
    assert_exactly_once(db, [f"c{i}" for i in range(51)])


def test_a_load_that_starts_anywhere_but_the_stored_position_stores_nothing(tmp_path):
    """The compare-and-set: a loader whose idea of the position is stale (as after a COMMIT
    that raised but landed) cannot store the same lines again."""
    db = tmp_path / "a.duckdb"
    w = CallWriter(db).start()
    for i in range(10):
        w.submit(SessionInfo("s~1"), record(i)).result(10)
    w.close()
    log = LogAppender(log_dir(db))
    log.append(b"".join(dumps({"session_id": "s~2"}, {"call_id": f"x{i}", "seq": i + 1}) for i in range(3)))
    log.close()
    loader = Loader(db)
    loader.open(10)
    stale = loader.position
    end = log_end(log_dir(db))
    assert loader.load(end, group=False) == 3
    loader.position = stale   # as if that COMMIT had raised
    with pytest.raises(PositionMoved):
        loader.load(end, group=False)
    loader.open(10)           # reopened: the committed position
    assert loader.position == end
    loader.close()
    assert_exactly_once(db, [f"c{i}" for i in range(10)] + [f"x{i}" for i in range(3)])


KILLED_WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
from support.loader_faults import Faults, faulty_connect, record
from polar_mitm.store import CallWriter, SessionInfo
from polar_mitm.store import loader as loader_module
point, start, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
faults = Faults([None] * int(sys.argv[5]) + [point])
loader_module.connect = faulty_connect(faults)
w = CallWriter(sys.argv[1], load_interval=0.01).start()
w.idle_release = 3600
for i in range(start, start + n):   # calls until the fault in its loader kills it
    w.submit(SessionInfo(f"s~{{i % 5}}"), record(i)).result(10)
    print(f"c{{i}}", flush=True)
    time.sleep(0.002)
"""


def test_kill_9_between_commit_and_the_next_step_loses_and_repeats_nothing(tmp_path):
    db = tmp_path / "a.duckdb"
    script = tmp_path / "killed_writer.py"
    script.write_text(textwrap.dedent(KILLED_WRITER.format(tests=str(SUPPORT.parent))))
    acked: list[str] = []
    in_flight: set[str] = set()
    for run, skip in enumerate((0, 2, 1, 0, 3)):
        out = subprocess.run([sys.executable, str(script), str(db), "kill", str(run * 10_000), "10000", str(skip)],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]   # died right after a COMMIT
        assert out.stdout.split(), "the run acknowledged no call before its loader died"
        acked += out.stdout.split()
        last = int(acked[-1][1:])
        in_flight.add(f"c{last + 1}")   # durable perhaps, its ack not printed yet
    assert catch_up(db) >= 0    # what the last one left, as any reader would
    assert_exactly_once(db, acked, in_flight)


def test_a_new_database_never_adopts_a_log_it_does_not_own(tmp_path):
    """A database deleted with calls still in its log, made anew under the same name: the
    old log's calls are not the new database's. They were loaded into it (8 stray rows)."""
    db = tmp_path / "a.duckdb"
    init_db(db)
    old_id = query(db, "SELECT value FROM meta WHERE key = 'db_id'")[1][0][0]
    log_dir(db).mkdir(mode=0o700)
    claim_log(log_dir(db), old_id)
    log = LogAppender(log_dir(db))   # acknowledged, never loaded: the proxy was killed
    log.append(b"".join(dumps({"session_id": "old~1"}, {"call_id": f"old{i}", "seq": i + 1}) for i in range(8)))
    log.close()
    os.unlink(db)
    # a reader of the new database does not load it either
    init_db(db)
    assert query(db, "SELECT count(*) FROM call_records")[1] == [(0,)]
    w = CallWriter(db).start()
    try:
        assert w.submit(SessionInfo("new~1"), record(0)).result(10) == 1
    finally:
        w.close()
    assert query(db, "SELECT call_id FROM call_records")[1] == [("c0",)]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("a.duckdb.log.stray-")]
    assert len(aside) == 1 and len(list(aside[0].glob("*.jsonl"))) == 1   # kept, not loaded


def test_a_log_older_than_log_owners_is_still_loaded_into_its_database(tmp_path):
    """Logs written before they recorded their database carry no owner: the database they
    sit beside (made before ids too) keeps them."""
    db = tmp_path / "a.duckdb"
    init_db(db)
    con = duckdb.connect(str(db))
    con.execute("DELETE FROM meta WHERE key = 'db_id'")   # as made by an older version
    con.close()
    log = LogAppender(log_dir(db))
    log.append(dumps({"session_id": "s~1"}, {"call_id": "legacy", "seq": 1}))
    log.close()
    w = CallWriter(db).start()
    w.submit(SessionInfo("s~1"), record(0)).result(10)
    w.close()
    assert sorted(query(db, "SELECT call_id, seq FROM call_records")[1]) == [("c0", 2), ("legacy", 1)]


def test_loads_are_sized_by_bytes_with_memory_for_every_line(tmp_path):
    """A whole row group of large lines (2048 of 130 KB: 265 MB, more than the old line-
    counted limit had room for) loads whole, with memory for its bytes, not in a tail that
    is checkpointed every few MB."""
    config = LoaderConfig(group_bytes=8 << 20)
    db = tmp_path / "a.duckdb"
    w = CallWriter(db, load_interval=3600, loader=config).start()
    w.idle_release = 3600
    try:
        big = "y" * 3000   # 2048 lines of ~3 KB: ~6.5 MB, inside group_bytes
        futs = [w.submit(SessionInfo(f"s~{i}"), replace(record(i), request_text=big + str(i)))
                for i in range(2048 + 5)]
        [f.result(30) for f in futs]
        deadline = time.monotonic() + 30
        while w.pending_lines > 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.pending_lines == 5 and w.loads == 1 and w.load_errors == 0
    finally:
        w.close()
    assert query(db, f"SELECT count(*) FROM {MAIN}")[1] == [(2048,)]
