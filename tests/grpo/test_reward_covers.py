"""Which calls a session's reward covers: all of them, or its main loop only (the model it
called most; a router's or a title call's smaller model is auxiliary). Per task (its
reward_covers) or for a whole run (--reward-covers); stats shows the split."""

from __future__ import annotations

import time

from click.testing import CliRunner

from polar_mitm.rollout import RolloutServer
from polar_mitm.rollout.spec import parse_task
from polar_mitm.store import CallRecord, CallWriter, SessionInfo
from polar_mitm.store.training import set_rewards, training_calls
from polar_mitm.cli.train import main as polar_train


def record(db, session: str, model: str, n: int, start: int) -> list:
    w = CallWriter(db).start()
    futures = [w.submit(SessionInfo(session, task_id=session.split("~")[0], source="api_key"),
                        CallRecord(call_id=f"{session}-{start + i}", style="openai_chat", status_code=200,
                                   requested_model=model, started_at=time.time(),
                                   prompt_token_ids=[1, 5, 6, start + i], token_ids=[7, 8], logprobs=[-0.5, -0.1],
                                   finish_reason="stop", policy_version=0)) for i in range(n)]
    for f in futures:
        f.result(30)
    w.close()


def test_the_main_loop_is_the_model_a_session_calls_most(tmp_path):
    db = tmp_path / "r.duckdb"
    for s in ("gem~0", "gem~1"):   # Gemini CLI: a flash-lite router call, then its main model
        record(db, s, "gemini-2.5-flash-lite", 1, 0)
        record(db, s, "gemini-2.5-pro", 3, 10)
    set_rewards(db, [{"session_id": "gem~0", "reward": 1.0}, {"session_id": "gem~1", "reward": 0.0}])

    every = training_calls([db], reward_covers="all")
    assert len(every.calls) == 8 and every.call_kinds == {"main": 6, "auxiliary": 2}
    main = training_calls([db], reward_covers="main")
    assert len(main.calls) == 6 and main.skipped["auxiliary_call"] == 2
    assert {c.prompt[-1] for c in main.calls} == {10, 11, 12}
    assert len(training_calls([db], reward_covers={"gem": "main"}).calls) == 6
    assert len(training_calls([db], reward_covers={"other": "main"}).calls) == 8

    # the task's own choice, stored with it by the rollout server, is the default of stats and train
    server = RolloutServer(str(db)).start()
    try:
        server.submit(parse_task({"task_id": "gem", "instruction": "x", "harness": "command", "command": "true",
                                  "num_samples": 1, "reward_covers": "main"}))
    finally:
        server.stop()
    r = CliRunner().invoke(polar_train, ["stats", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert "main loop (the model each session called most) 6, auxiliary (a router's, a title call's) 2, " \
           "of which left out (reward_covers main) 2" in r.output
    r = CliRunner().invoke(polar_train, ["stats", "--db", str(db), "--reward-covers", "all"])
    assert "of which left out (reward_covers main) 0" in r.output and r.exit_code == 0
