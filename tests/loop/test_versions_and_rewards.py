"""policy_version is an integer column (a migration for older files, old log lines still
load), a call of an unknown version is never trained, reward writes never race the node's
or the loader's, and huge finite rewards never crash the figures or training."""

import math
import threading
import time

import duckdb
import pytest
from click.testing import CliRunner

from support.grpo_data import synthetic_calls, write_calls
from polar_mitm.grpo.advantages import group_advantages, group_stats, no_signal
from polar_mitm.rollout.spec import MAX_REWARD, TaskError, parse_reward
from polar_mitm.cli.rollout import reward_figures
from polar_mitm.store import CallRecord, CallWriter, SessionInfo, init_db, query, set_reward
from polar_mitm.store import db as store_db
from polar_mitm.store.schema import MIGRATIONS
from polar_mitm.store.training import UNKNOWN_VERSION_REASON, set_rewards, training_calls
from polar_mitm.cli.train import main as polar_train


def _at_version_9(db) -> None:
    """A database as migration 9 left it: policy_version VARCHAR, the gateway's integer as text."""
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ DEFAULT now())")
    for v, sql in enumerate(MIGRATIONS[:9], start=1):
        con.execute(sql)
        con.execute("INSERT INTO schema_version (version) VALUES (?)", [v])
    con.execute("INSERT INTO meta VALUES ('key_salt', 'x')")
    con.execute("INSERT INTO sessions (session_id, task_id) VALUES ('t~0', 't')")
    for table, rows in (("call_records_main", [("a", 1, "2"), ("b", 2, "10"), ("c", 3, None)]),
                        ("call_records_tail", [("d", 4, "junk"), ("e", 5, "3")])):
        for cid, seq, version in rows:
            con.execute(f"INSERT INTO {table} (call_id, session_id, seq, request_middle, prompt_suffix, token_ids, "
                        "policy_version) VALUES (?, 't~0', ?, 'hi', '[1]', [2], ?)", [cid, seq, version])
    con.close()


def test_policy_version_migrates_to_an_integer_that_orders_as_one(tmp_path):
    db = tmp_path / "old.duckdb"
    _at_version_9(db)
    assert query(db, "SELECT policy_version FROM calls WHERE policy_version IN ('2', '10') "
                     "ORDER BY policy_version")[1] == [("10",), ("2",)]   # as text: 10 before 2
    init_db(db)
    _, types = query(db, "SELECT table_name, data_type FROM information_schema.columns "
                         "WHERE column_name = 'policy_version' AND table_name LIKE 'call%' ORDER BY 1")
    assert types == [("call_records", "INTEGER"), ("call_records_main", "INTEGER"),
                     ("call_records_tail", "INTEGER"), ("calls", "INTEGER")]
    assert query(db, "SELECT call_id, policy_version FROM calls ORDER BY policy_version NULLS LAST, call_id")[1] == \
        [("a", 2), ("e", 3), ("b", 10), ("c", None), ("d", None)]   # text that is no integer: unknown
    assert query(db, "SELECT max(policy_version) FROM session_calls('t~0')")[1] == [(10,)]
    # new calls load after the old rows; a log line written with the version as text
    # (before the column was an integer) still loads, as its integer
    w = CallWriter(db).start()
    for i, version in enumerate([11, "12", None, "v13"]):
        w.submit(SessionInfo("t~0", task_id="t"),
                 CallRecord(f"n{i}", status_code=200, policy_version=version)).result(10)  # type: ignore[arg-type]
    w.close()
    assert w.load_errors == 0
    assert query(db, "SELECT call_id, policy_version, error FROM call_records WHERE call_id LIKE 'n%' "
                     "ORDER BY call_id")[1] == [("n0", 11, None), ("n1", 12, None), ("n2", None, None),
                                                 ("n3", None, None)]
    assert query(db, "SELECT policy_version FROM calls ORDER BY policy_version DESC NULLS LAST LIMIT 3")[1] == \
        [(12,), (11,), (10,)]


def test_a_fresh_database_records_the_version_as_an_integer(tmp_path):
    db = tmp_path / "new.duckdb"
    w = CallWriter(db).start()
    w.submit(SessionInfo("s~0"), CallRecord("c", status_code=200, policy_version=7)).result(10)
    w.close()
    assert query(db, "SELECT policy_version, typeof(policy_version) FROM calls")[1] == [(7, "INTEGER")]


def test_calls_of_an_unknown_policy_version_are_never_trained(tmp_path):
    """NULL: the gateway could not vouch for the weights that served the call. Such a call
    is left out of training in every path (the reader all of them share), and counted."""
    db = tmp_path / "a.duckdb"
    calls = synthetic_calls(tasks=2)
    unknown = [c for c in calls if c.session_id == "t0~1"]
    rest = [c for c in calls if c.session_id != "t0~1"]
    extra = [({"session_id": c.session_id, "task_id": c.group},
              {"status_code": 200, "prompt_token_ids": list(c.prompt), "token_ids": list(c.tokens),
               "logprobs": list(c.logprobs), "policy_version": None}) for c in unknown]
    write_calls(db, rest, extra)
    set_rewards(db, [{"session_id": s, "reward": float(i % 2)} for i, s in enumerate(sorted({c.session_id for c in calls}))])
    for kwargs in ({}, {"require_reward": False}, {"tasks": ["t0"]},
                   {"sessions": sorted({c.session_id for c in calls})}):   # the loop reads by session
        data = training_calls([db], **kwargs)
        assert data.skipped[UNKNOWN_VERSION_REASON] == len(unknown), kwargs
        assert "t0~1" not in {c.session_id for c in data.calls}
        assert all(c.policy_version == 0 for c in data.calls)
    assert len(training_calls([db]).calls) == len(rest)
    # its reward still counts in its group's baseline, as any rewarded session's
    assert "t0~1" in training_calls([db]).rewards
    out = CliRunner().invoke(polar_train, ["stats", "--db", str(db)], catch_exceptions=False)
    assert out.exit_code == 0 and f"{UNKNOWN_VERSION_REASON} {len(unknown)}" in out.output, out.output


def test_only_unknown_versions_means_nothing_to_train_and_says_why(tmp_path):
    db = tmp_path / "a.duckdb"
    calls = synthetic_calls(tasks=1, sessions=2, turns=1)
    extra = [({"session_id": c.session_id, "task_id": c.group},
              {"status_code": 200, "prompt_token_ids": list(c.prompt), "token_ids": list(c.tokens),
               "logprobs": list(c.logprobs), "policy_version": None}) for c in calls]
    write_calls(db, [], extra)
    set_rewards(db, [{"session_id": c.session_id, "reward": 1.0} for c in calls])
    data = training_calls([db])
    assert not data.calls and data.skipped == {UNKNOWN_VERSION_REASON: len(calls)}
    out = CliRunner().invoke(polar_train, ["train", "--db", str(db), "--out", str(tmp_path / "run"),
                                           "--model", str(tmp_path / "none")])
    assert out.exit_code == 1 and f"{UNKNOWN_VERSION_REASON} {len(calls)}" in out.output, out.output


# ---- reward writes and the loader storing the same new session ----------------------------


def _record(sid: str, i: int) -> tuple[SessionInfo, CallRecord]:
    return (SessionInfo(sid, task_id=sid.rsplit("~", 1)[0], source="proxy_user", client="10.0.0.1"),
            CallRecord(f"{sid}-{i}", status_code=200, policy_version=0))


def test_a_reward_before_the_session_has_calls_then_its_calls(tmp_path):
    db = tmp_path / "a.duckdb"
    init_db(db)
    sid = "dbg4@013a1a.0~1"
    set_reward(db, sid, 0.5, info={"state": "done"}, task_id="dbg4@013a1a.0")
    w = CallWriter(db).start()
    w.submit(*_record(sid, 0)).result(10)
    w.close()
    assert w.load_errors == 0
    assert query(db, "SELECT session_id, task_id, source, client, reward FROM sessions")[1] == \
        [(sid, "dbg4@013a1a.0", "proxy_user", "10.0.0.1", 0.5)]   # the gateway's source filled in
    assert query(db, "SELECT count(*) FROM calls WHERE session_id = ?", [sid])[1] == [(1,)]


def test_calls_then_the_reward(tmp_path):
    db = tmp_path / "a.duckdb"
    sid = "dbg4@013a1a.0~1"
    w = CallWriter(db).start()
    w.submit(*_record(sid, 0)).result(10)
    w.close()
    set_reward(db, sid, 1.0, task_id="dbg4@013a1a.0")
    set_reward(db, sid, 0.25, task_id="dbg4@013a1a.0")   # again: an upsert
    assert query(db, "SELECT session_id, source, reward FROM sessions")[1] == [(sid, "proxy_user", 0.25)]


def test_a_write_that_lost_a_race_is_tried_again(tmp_path, monkeypatch):
    """The failures DuckDB gives two transactions of one process storing the same new row."""
    db = tmp_path / "a.duckdb"
    init_db(db)
    real = store_db.writing
    fails = [duckdb.ConstraintException('Duplicate key "session_id: s~1" violates primary key constraint'),
             duckdb.TransactionException("TransactionContext Error: Failed to commit: PRIMARY KEY or UNIQUE "
                                         "constraint violated: duplicate key \"s~1\""),
             duckdb.TransactionException("TransactionContext Error: Conflict on update!")]

    def flaky(path, timeout=30.0):
        if fails:
            raise fails.pop(0)
        return real(path, timeout)

    monkeypatch.setattr(store_db, "writing", flaky)
    set_reward(db, "s~1", 1.0)
    assert not fails and query(db, "SELECT session_id, reward FROM sessions")[1] == [("s~1", 1.0)]
    monkeypatch.setattr(store_db, "writing", lambda *a, **k: (_ for _ in ()).throw(
        duckdb.ConstraintException("NOT NULL constraint failed: sessions.session_id")))
    with pytest.raises(duckdb.ConstraintException):   # not a race: raised at once
        set_reward(db, "s~2", 1.0)


def test_reward_writes_and_loads_of_the_same_new_sessions_at_once(tmp_path):
    """The loop's reward write, the node's reward thread and the gateway's loader, all on the
    same new sessions at the same moment, for about two seconds: no write fails."""
    db = tmp_path / "a.duckdb"
    init_db(db)
    errors: list[BaseException] = []
    deadline = time.monotonic() + 2.0
    n = 0
    w = CallWriter(db, load_interval=0.0).start()
    try:
        # two rounds at least, however loaded the machine (the first alone can take the 2 s)
        while (time.monotonic() < deadline or n < 2) and not errors:
            sids = [f"t{n}@run.0~{i}" for i in range(3)]
            n += 1
            go = threading.Barrier(3)

            def loop_write(sids=sids, go=go):
                go.wait()
                set_rewards(db, [{"session_id": s, "reward": 1.0} for s in sids], timeout=30.0)

            def node_write(sids=sids, go=go):
                go.wait()
                for s in sids:
                    set_reward(db, s, 1.0, task_id=s.rsplit("~", 1)[0], timeout=30.0)

            def guarded(f):
                try:
                    f()
                except BaseException as e:   # noqa: BLE001 - any failure fails the test
                    errors.append(e)

            threads = [threading.Thread(target=guarded, args=(f,)) for f in (loop_write, node_write)]
            for t in threads:
                t.start()
            go.wait()
            futures = [w.submit(*_record(s, 0)) for s in sids]
            for t in threads:
                t.join(60)
            for f in futures:
                f.result(30)
    finally:
        w.close()
    assert not errors, errors
    assert w.load_errors == 0
    assert n >= 2
    assert query(db, "SELECT count(*), count(reward), count(DISTINCT session_id) FROM sessions")[1] == [(3 * n, 3 * n, 3 * n)]
    assert query(db, "SELECT count(*) FROM call_records")[1] == [(3 * n,)]


# ---- huge finite rewards ---------------------------------------------------------------------


def test_group_stats_of_huge_finite_rewards_are_finite():
    s = group_stats([1e200, 0.0])
    assert (s.n, s.mean, s.std) == (2, 5e199, 5e199)
    s = group_stats([1.7e308, -1.7e308, 1.7e308])
    assert math.isfinite(s.mean) and math.isfinite(s.std) and s.std > 1e308
    assert group_stats([1e200, 1e200]).std == 0 and no_signal(group_stats([1e200, 1e200]))
    assert group_stats([0.0, 1.0]) == (2, 0.5, 0.5)   # ordinary rewards: as before
    assert math.isnan(group_stats([math.inf, 0.0]).std)   # never raises
    adv = group_advantages({"a": 1e200, "b": 0.0}, {"a": "g", "b": "g"})
    assert adv["a"] == pytest.approx(1.0) and adv["b"] == pytest.approx(-1.0)


def test_the_evaluator_cannot_print_a_reward_past_the_bound():
    assert parse_reward("score\n1e6\n", 0) == MAX_REWARD
    assert parse_reward("-0.5\n", 1) == -0.5
    for bad in ("1e200", "-2e6", "1000001"):
        with pytest.raises(TaskError, match=r"beyond \+-1e\+06"):
            parse_reward(f"{bad}\n", 0)
    with pytest.raises(TaskError, match="not a finite number"):   # past float's range: inf
        parse_reward("1" + "0" * 400, 0)


def test_non_finite_rewards_are_refused_when_stored(tmp_path):
    db = tmp_path / "a.duckdb"
    init_db(db)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            set_rewards(db, [{"session_id": "s~0", "reward": bad}])
        with pytest.raises(ValueError, match="finite"):
            set_reward(db, "s~0", bad)


def test_a_huge_reward_already_stored_does_not_crash_reading_or_the_figures(tmp_path):
    """A database from before the bound holds 1e200: the reader, the advantages and the
    figures of a rerun take it."""
    db = tmp_path / "a.duckdb"
    calls = synthetic_calls(tasks=1)
    write_calls(db, calls)
    sids = sorted({c.session_id for c in calls})
    set_rewards(db, [{"session_id": s, "reward": 1e200 if i == 0 else 0.0} for i, s in enumerate(sids)])
    data = training_calls([db])
    rewards = {s: r.reward for s, r in data.rewards.items()}
    adv = group_advantages(rewards, {s: r.group for s, r in data.rewards.items()})
    assert all(math.isfinite(a) for a in adv.values()) and adv[sids[0]] > 0
    figures = reward_figures([{"reward": r} for r in rewards.values()])
    assert figures is not None and figures["max"] == 1e200 and math.isfinite(figures["std"])
