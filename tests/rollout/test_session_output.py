"""Each session's output is kept (issue 31, section 4): the tail of its harness's stdout and
stderr and its evaluator's output, with session credentials redacted, in the server's session
results (stats "harness_output", "eval_output"), in SQL (rollout_sessions' columns) and from
the CLI (`polar-mitm session-output SESSION_ID`)."""

from __future__ import annotations

from pathlib import Path

import duckdb
from click.testing import CliRunner

from polar_mitm.cli.main import main
from polar_mitm.rollout import GatewayNode, NodeConfig, RolloutServer
from polar_mitm.rollout.node import OUTPUT_CHARS
from polar_mitm.session_auth import redact
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.store import init_db, query
from polar_mitm.store import rollout_journal as journal
from polar_mitm.store.db import connect, migrate
from polar_mitm.store.loop import IterationRow, iterations, record_iteration
from polar_mitm.store.schema import MIGRATIONS

CRED = "0123456789abcdef0123456789abcdef"
# A harness that prints more than is kept, its session's credentials (API key and proxy URL),
# and its last lines on stdout and stderr.
HARNESS = (f'i=0; while [ $i -lt 400 ]; do echo "line $i of a long harness output"; i=$((i+1)); done; '
           f'echo "key polar-$POLAR_SESSION,{CRED} proxy http://o%7E0:{CRED}@127.0.0.1:9"; '
           f'echo "the harness says goodbye" >&2')
EVALUATOR = f'echo "grading with polar-x,{CRED}"; echo "the evaluator looked"; echo 0.25'


def test_redact_removes_session_credentials_only():
    text = (f"HTTPS_PROXY=http://t%7E0:{CRED}@127.0.0.1:8080 key=polar-t~0,{CRED} "
            f"plain polar-t~0 and hex {CRED} http://user:notahexpassword@host")
    assert redact(text) == ("HTTPS_PROXY=http://t%7E0:[redacted]@127.0.0.1:8080 key=polar-t~0,[redacted] "
                            f"plain polar-t~0 and hex {CRED} http://user:notahexpassword@host")


def test_harness_and_evaluator_output_are_kept_by_session_in_sql_and_the_cli(tmp_path):
    db = str(tmp_path / "r.duckdb")
    server = RolloutServer(db).start()
    node = GatewayNode(NodeConfig(server_url=server.url, proxy_port=1, ca_path="", heartbeat_s=0.1,
                                  init_workers=1, run_workers=1),
                       runtime=LocalRuntime(tmp_path / "s")).start()
    try:
        server.submit({"task_id": "o", "instruction": "x", "harness": "command", "command": HARNESS,
                       "evaluator": EVALUATOR})
        server.submit({"task_id": "f", "instruction": "x", "harness": "command",
                       "command": f'echo "failing with polar-f~0,{CRED}"; exit 4', "evaluator": "echo 1"})
        assert server.wait(["o", "f"], timeout=60)
        (s,) = server.group("o")["sessions"]
        (f,) = server.group("f")["sessions"]
    finally:
        node.stop()
        server.stop()
    # in the server's results (the loop reads stats["harness_output"] from the groups)
    out, ev = s["stats"]["harness_output"], s["stats"]["eval_output"]
    assert s["state"] == "done" and s["reward"] == 0.25
    assert len(out) <= OUTPUT_CHARS and "line 399 of a long harness output" in out and "line 0 of" not in out
    assert "the harness says goodbye" in out and CRED not in out
    assert "key polar-o~0,[redacted] proxy http://o%7E0:[redacted]@127.0.0.1:9" in out
    assert ev.rstrip("\n").endswith("the evaluator looked\n0.25") and "grading with polar-x,[redacted]" in ev
    assert CRED not in ev
    # a failed harness: its output and its reason, redacted
    assert f["state"] == "failed" and CRED not in f["reason"] and "polar-f~0,[redacted]" in f["reason"]
    assert "polar-f~0,[redacted]" in f["stats"]["harness_output"]
    # in SQL: columns of rollout_sessions, not in its stats JSON
    _, rows = query(db, "SELECT session_id, harness_output, eval_output, stats->>'harness_output', "
                        "stats->>'exit_code' FROM rollout_sessions ORDER BY 1")
    assert rows == [("f~0", f["stats"]["harness_output"], None, None, "4"), ("o~0", out, ev, None, "0")]
    # a restarted server has them back in its results
    again = RolloutServer(db).start()
    try:
        assert again.group("o")["sessions"][0]["stats"]["harness_output"] == out
        assert again.group("o")["sessions"][0]["stats"]["eval_output"] == ev
    finally:
        again.stop()
    # from the CLI, by session id
    r = CliRunner().invoke(main, ["session-output", "o~0", "--db", db])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("session o~0 (task o, node ")
    assert ": done, reward 0.25, harness exit code 0\n" in r.output
    assert "--- harness output ---\n" in r.output and "the harness says goodbye" in r.output
    assert "--- evaluator output ---\n" in r.output and "the evaluator looked" in r.output
    r = CliRunner().invoke(main, ["session-output", "f~0", "--db", db])
    assert r.exit_code == 0 and "failed, reward 0, harness exit code 4" in r.output
    assert "reason: harness exited with code 4" in r.output and "(none kept)" in r.output
    r = CliRunner().invoke(main, ["session-output", "nope~0", "--db", db])
    assert r.exit_code == 1 and f"no session nope~0 in {db}" in r.output
    r = CliRunner().invoke(main, ["session-output", "o~0", "--db", str(tmp_path / "missing.duckdb")])
    assert r.exit_code == 1 and "no database at" in r.output


def test_an_older_database_is_migrated_with_its_sessions_kept(tmp_path):
    """A database from before the output columns (schema 10): migrated on open, its sessions
    there with no output kept."""
    db = tmp_path / "old.duckdb"
    con = connect(db)
    con.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ DEFAULT now())")
    for v, sql in enumerate(MIGRATIONS[:10], start=1):
        con.execute(sql)
        con.execute("INSERT INTO schema_version (version) VALUES (?)", [v])
    con.execute("INSERT INTO rollout_sessions (session_id, task_id, sample, state, stats) "
                "VALUES ('old~0', 'old', 0, 'done', '{\"exit_code\": 0}')")
    con.close()
    init_db(db)
    _, rows = query(db, "SELECT session_id, harness_output, eval_output FROM rollout_sessions")
    assert rows == [("old~0", None, None)]
    _, sessions = journal.load(db)
    assert sessions[0]["stats"] == {"exit_code": 0}
    out = journal.session_output(db, "old~0")
    assert out is not None and out["harness_output"] is None and out["exit_code"] == 0
    con = duckdb.connect(str(db))
    try:
        assert migrate(con) == len(MIGRATIONS)     # once only
    finally:
        con.close()


def test_the_loop_row_keeps_its_released_sessions_by_cause(tmp_path):
    db = str(Path(tmp_path) / "l.duckdb")
    init_db(db)
    row = IterationRow(run_id="r", iteration=0, policy_version=0, sessions_released=3,
                       released_why={"backend unavailable": 2, "node stopped": 1})
    record_iteration(db, row, [])
    record_iteration(db, IterationRow(run_id="r", iteration=1, policy_version=1), [])
    got = iterations(db, "r")
    assert [(r["sessions_released"], r["released_why"]) for r in got] == \
        [(3, '{"backend unavailable":2,"node stopped":1}'), (None, None)]
