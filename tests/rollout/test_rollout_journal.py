"""The rollout journal: it keeps the order of events stamped back to back (a session's init
and ready often arrive in one heartbeat, within the same microsecond of the wall clock); its
log makes a state change durable before it is acted on, and each batch lands in the tables
once, whenever the server dies."""

from __future__ import annotations

from polar_mitm.rollout import RolloutServer
from polar_mitm.rollout.spec import parse_task
from polar_mitm.store import journal_log
from polar_mitm.store import rollout_journal as journal
from polar_mitm.store.db import reading


def test_events_stamped_back_to_back_come_back_from_sql_in_order(tmp_path):
    db = tmp_path / "r.duckdb"
    server = RolloutServer(str(db))          # not started: only its clock is used
    journal.ensure(db)
    states = [f"s{i:04d}" for i in range(2000)]
    events = [journal.Event(at_us=server._stamp(), task_id="t", session_id="t~0", state=st,
                            node_id=None, detail=None) for st in states]
    journal.save(db, journal.Batch(tasks=[], sessions=[], events=events))
    with reading(db) as con:
        got = con.execute("SELECT list(state ORDER BY event_at), count(DISTINCT event_at), "
                          "list(epoch_us(event_at) ORDER BY event_at) FROM rollout_events").fetchone()
    assert got[0] == states
    assert got[1] == len(states)             # no two events share a timestamp
    assert got[2] == [e["at_us"] for e in events]   # stored exactly, in any session time zone


def test_a_restarted_server_takes_tasks_saved_in_one_batch_in_the_order_submitted(tmp_path):
    db = tmp_path / "r.duckdb"
    first = RolloutServer(str(db), check_workspaces=False)   # not started: its scheduler and journal only
    journal.ensure(db)
    names = ["zeta", "alpha", "mid", "beta"]
    with first._lock:
        for name in names:
            _, effects = first.scheduler.submit(parse_task(
                {"task_id": name, "instruction": "x", "harness": "command", "command": "true"}))
            first._perform(effects)
    first.flush()                            # one batch: one submitted_at for all four
    first.fold()                             # from the journal log into the tables
    with reading(db) as con:
        assert con.execute("SELECT count(DISTINCT submitted_at) FROM rollout_tasks").fetchone()[0] == 1

    again = RolloutServer(str(db), check_workspaces=False)
    again._restore()
    order = sorted(again.scheduler.tasks.values(), key=lambda t: t.order)
    assert [t.spec.task_id for t in order] == names
    # and a task submitted after the restart comes after them
    with again._lock:
        again._perform(again.scheduler.submit(parse_task(
            {"task_id": "after", "instruction": "x", "harness": "command", "command": "true"}))[1])
    assert max(again.scheduler.tasks.values(), key=lambda t: t.order).spec.task_id == "after"


# -- the journal log: durable before acted on, folded once ------------------------------------

def _task(tid: str = "t", **kw) -> dict:
    return {"task_id": tid, "instruction": "x", "harness": "command", "command": "true", **kw}


def test_a_heartbeat_answered_is_in_the_log_and_a_server_killed_before_folding_loses_nothing(tmp_path):
    """A heartbeat's state is durable (the journal log, fdatasync) before its answer; the
    database's tables lag until a fold. A server that dies before folding (kill -9: no stop)
    leaves the log, and the next server folds it at its start: the session it assigned is
    still on its node."""
    db = str(tmp_path / "r.duckdb")
    first = RolloutServer(db, fold_s=3600.0).start()     # no fold while it runs
    first.submit(_task("t", num_samples=2))
    got = first.heartbeat({"node_id": "n", "load": {"free": 1}, "active": [], "events": []})
    assert [a["session_id"] for a in got["assign"]] == ["t~0"]
    assert journal_log.segments(journal_log.log_dir(db))             # in the log ...
    assert journal.load(db)[1][0]["node_id"] == "n"                   # ... and read from it
    first._stop.set()              # dies: its threads stop, nothing is folded
    first._http.stop()
    with reading(db) as con:       # the tables never saw the assignment
        assert con.execute("SELECT count(*) FROM rollout_sessions WHERE node_id = 'n'").fetchone()[0] == 0

    again = RolloutServer(db).start()
    try:
        s = again.task_status("t")["sessions"][0]
        assert (s["session_id"], s["node_id"], s["state"]) == ("t~0", "n", "assigned")
        assert not journal_log.segments(journal_log.log_dir(db))      # folded at the start
        with reading(db) as con:
            assert con.execute("SELECT node_id FROM rollout_sessions WHERE session_id = 't~0'").fetchone() == ("n",)
            # each event once, although the dead server's log was read by load() above too
            assert con.execute("SELECT count(*) FROM rollout_events WHERE session_id = 't~0' "
                               "AND state = 'assigned'").fetchone()[0] == 1
    finally:
        again.stop()


def test_a_fold_lands_each_batch_once_and_a_torn_last_line_is_not_read(tmp_path):
    db = str(tmp_path / "r.duckdb")
    journal.ensure(db)
    log = journal_log.JournalLog(db, journal.folded_through(db))

    def event(state):
        return journal.Batch(tasks=[], sessions=[], events=[journal.Event(
            at_us=len(state), task_id="t", session_id="t~0", state=state, node_id=None, detail=None)])

    log.append(event("a"))
    log.append(event("bb"))
    first = journal_log.segments(log.dir)[0]
    # a crash after the fold's commit, before its segment was deleted: folded again, skipped
    assert journal.save_segments(db, [(journal_log.seq(first), journal_log.read_segment(first))]) == 2
    assert journal.fold(db, log) == 0 and not journal_log.segments(log.dir)
    # a crash mid-append: a last line without its newline was never acknowledged
    log.append(event("ccc"))
    with open(journal_log.segments(log.dir)[-1], "ab") as f:
        f.write(b'{"tasks": [], "sessions": [], "ev')
    assert journal.fold(db, log) == 1
    log.close()
    with reading(db) as con:
        assert con.execute("SELECT list(state ORDER BY event_at) FROM rollout_events").fetchone()[0] == ["a", "bb", "ccc"]
    # a new log numbers its segments after every one folded
    again = journal_log.JournalLog(db, journal.folded_through(db))
    again.append(event("dddd"))
    assert journal.fold(db, again) == 1
    again.close()
    with reading(db) as con:
        assert con.execute("SELECT count(*) FROM rollout_events").fetchone()[0] == 4


def test_sql_sees_what_a_killed_server_saved(tmp_path):
    """`polar-mitm sql` folds a log whose server is gone before it reads."""
    import subprocess
    import sys
    from pathlib import Path

    db = str(tmp_path / "r.duckdb")
    script = (f"from polar_mitm.rollout import RolloutServer; import os; "
              f"s = RolloutServer({db!r}, fold_s=3600.0).start(); "
              f"s.submit({_task('gone', num_samples=3)!r}); os._exit(0)")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert journal_log.segments(journal_log.log_dir(db)) and not journal_log.owner_alive(db)
    cli = str(Path(sys.executable).parent / "polar-mitm")
    r = subprocess.run([cli, "sql", "--db", db, "--format", "csv",
                        "SELECT count(*) AS n FROM rollout_sessions WHERE task_id = 'gone'"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["n", "3"], r.stdout + r.stderr
