"""The rollout journal keeps the order of events stamped back to back (a session's init and
ready often arrive in one heartbeat, within the same microsecond of the wall clock)."""

from __future__ import annotations

from polar_mitm.rollout import RolloutServer
from polar_mitm.rollout.spec import parse_task
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
