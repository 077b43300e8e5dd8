"""The loop against stand-ins (a dev-mode vLLM stand-in, the fake harness, a tiny random
model), killed -9 during rollouts, during training and during a sync, then rerun: it
resumes, every call carries the version of its iteration, no group has more sessions than
samples, the backend serves the version the loop knows, and no process is left behind."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from support.fake_vllm import FakeVLLM
from support.grpo_data import tiny_model_dir
from polar_mitm.store import query
from polar_mitm.store.training import training_calls
from support.procs import alive, token, until
from support import SUPPORT
from support.loop_run import TRAIN, LoopRun, fake_tasks

HERE = SUPPORT   # the helper scripts the sessions run
def test_the_loop_resumes_after_kill_9_in_every_phase(tmp_path):
    model = str(tiny_model_dir(tmp_path / "model"))
    mark = token()
    tasks = fake_tasks(tmp_path, f"slow:1 2 {mark}")
    out = tmp_path / "run"
    with FakeVLLM(delay=0.1, reload_delay=3.0) as fake:
        argv = [TRAIN, "loop", "--tasks", str(tasks), "--iterations", "2", "--out", str(out),
                "--harness", "command", "--samples", "2", "--backend", fake.url, "--model", model,
                "--lr", "1e-3", "--token-budget", "256", "--workers", "2", "--max-tokens", "8", "--keep", "1"]
        phases = {"rollouts": lambda r: "rollouts (policy v" in r.output,
                  "training": lambda r: "training" in r.output,
                  "sync": lambda r: fake.reloading and "synced" not in r.output and "training" in r.output}
        for phase, ready in phases.items():
            run = LoopRun(argv)
            assert until(lambda: ready(run) or run.proc.poll() is not None, 240), run.output[-2000:]
            assert run.proc.poll() is None, f"finished before the {phase} kill: {run.output[-2000:]}"
            run.kill()
            # what it started ends with it (the janitor), harness runs included
            assert until(lambda: not alive(str(out)) and not alive(mark), 30), (phase, alive(str(out)), alive(mark))
        run = LoopRun(argv)
        assert run.wait(600) == 0, run.output[-3000:]
        assert not alive(str(out)) and not alive(mark)
        state = json.loads((out / "loop.json").read_text())
        assert state["completed"] == 2 and state["version"] == 2
        assert fake.weights == state["checkpoint"]   # the backend serves the version the loop knows

    db = out / "rollouts.duckdb"
    run_id = state["run_id"]
    _, rows = query(db, "SELECT session_id, policy_version FROM calls")
    assert rows
    for sid, version in rows:   # iteration i's calls were all sampled by version i
        assert sid.split("@")[1].startswith(f"{run_id}.") and version == int(sid.split(".")[1].split("~")[0]), (sid, version)
    data = training_calls([db])
    per_group = Counter()
    for sid in {c.session_id for c in data.calls}:
        per_group[sid.rsplit("~", 1)[0]] += 1
    assert per_group and all(n <= 2 for n in per_group.values()), per_group   # never more than samples
    _, rows = query(db, "SELECT iteration, policy_version FROM loop_iterations ORDER BY 1")
    assert rows == [(0, 0), (1, 1)]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["v2"]   # --keep 1
    assert [p.name for p in (out / "trainer").iterdir()] == ["v2.pt"]    # the one a resume reads


def test_with_max_staleness_1_the_next_rollouts_run_during_training(tmp_path):
    """K=1: iteration i+1's sessions start while iteration i trains, so its calls carry
    version i or i+1 (whichever sampled them), and all of them are trained (none dropped)."""
    model = str(tiny_model_dir(tmp_path / "model"))
    tasks = fake_tasks(tmp_path, "ok 3")
    out = tmp_path / "run"
    with FakeVLLM(delay=0.3, reload_delay=0.2) as fake:
        run = LoopRun([TRAIN, "loop", "--tasks", str(tasks), "--iterations", "3", "--out", str(out),
                       "--harness", "command", "--samples", "2", "--backend", fake.url, "--model", model,
                       "--lr", "1e-3", "--token-budget", "256", "--workers", "4", "--max-tokens", "8",
                       "--max-staleness", "1"])
        assert run.wait(600) == 0, run.output[-3000:]
    db = out / "rollouts.duckdb"
    _, rows = query(db, "SELECT session_id, policy_version FROM calls")
    for sid, version in rows:
        it = int(sid.split("@")[1].split(".")[1].split("~")[0])
        assert int(version) in (it - 1, it) if it else int(version) == 0, (sid, version)
    _, rows = query(db, "SELECT iteration, policy_version, stale_dropped, stale_tokens, calls FROM loop_iterations "
                        "ORDER BY 1")
    assert [r[:4] for r in rows] == [(0, 0, 0, 0), (1, 1, 0, 0), (2, 2, 0, 0)] and all(r[4] > 0 for r in rows)
    assert run.output.count("tokens, 0.0% stale") == 3, run.output[-3000:]


def test_colocate_puts_vllm_to_sleep_for_training_and_wakes_it_with_the_new_weights(tmp_path):
    """--colocate against a stand-in with vLLM's sleep endpoints: after each iteration's
    rollouts the gateway holds and drains, vLLM sleeps (level 2: weights discarded); after
    training it wakes the weights, reloads the checkpoint into them, wakes the KV cache,
    resets the prefix cache and sets the version. No generation reaches it while it sleeps."""
    model = str(tiny_model_dir(tmp_path / "model"))
    tasks = fake_tasks(tmp_path, "ok 2")
    out = tmp_path / "run"
    with FakeVLLM(delay=0.05) as fake:
        run = LoopRun([TRAIN, "loop", "--tasks", str(tasks), "--iterations", "2", "--out", str(out),
                       "--harness", "command", "--samples", "2", "--backend", fake.url, "--model", model,
                       "--lr", "1e-3", "--token-budget", "256", "--workers", "2", "--max-tokens", "8",
                       "--colocate"])
        assert run.wait(600) == 0, run.output[-3000:]
        state = json.loads((out / "loop.json").read_text())
        assert fake.served_asleep == 0 and not fake.sleeping
        assert fake.weights == state["checkpoint"] == str(out / "checkpoints" / "v2")
        sync = ["/wake_up?tags=weights", "/collective_rpc", "/wake_up?tags=kv_cache", "/reset_prefix_cache",
                "/update_weight_version"]
        # --backend: v0 first, in flight (vLLM awake, the stand-in has the token route); each
        # later sync wakes a sleeping vLLM, so it is in drain mode (nothing runs in a sleeping one)
        start = ["/pause?mode=keep&clear_cache=true", "/collective_rpc", "/update_weight_version", "/resume"]
        # (the gateway's version watch may have tagged the untagged stand-in before that sync)
        control = fake.control[1:] if fake.control[:2] == ["/update_weight_version", start[0]] \
            else fake.control
        assert control == start + (["/sleep?level=2"] + sync) * 2, fake.control
    db = out / "rollouts.duckdb"
    _, rows = query(db, "SELECT session_id, policy_version FROM calls")
    assert rows and all(v == int(sid.split("@")[1].split(".")[1].split("~")[0]) for sid, v in rows)
    _, rows = query(db, "SELECT iteration, policy_version, sleep_s, sync_wake_s, sync_reload_s "
                        "FROM loop_iterations ORDER BY 1")
    assert [r[:2] for r in rows] == [(0, 0), (1, 1)] and all(r[2] > 0 and r[3] > 0 and r[4] > 0 for r in rows)
    # a colocated loop cannot sample while it trains
    bad = LoopRun([TRAIN, "loop", "--tasks", str(tasks), "--iterations", "1", "--out", str(tmp_path / "bad"),
                   "--colocate", "--max-staleness", "1", "--backend", "http://127.0.0.1:9", "--model", model])
    assert bad.wait(60) != 0 and "--colocate needs --max-staleness 0" in bad.output


def test_the_loop_syncs_every_node_of_a_remote_rollout_server_through_heartbeats(tmp_path):
    """--server: a rollout server with two gateway nodes, each with its own proxy, database
    and vLLM stand-in. The loop only talks to the server; each node learns of a new policy in
    its heartbeat, syncs its own gateway and vLLM, and reports back. Every call on either
    node carries the version of its iteration, and both vLLMs end on the last checkpoint."""
    from polar_mitm.stack import launch
    from polar_mitm.stack.local import Stack

    model = str(tiny_model_dir(tmp_path / "model"))
    tasks = fake_tasks(tmp_path, "ok 2")
    out = tmp_path / "run"
    with FakeVLLM(delay=0.2) as fake_a, FakeVLLM(delay=0.2) as fake_b:
        with Stack() as stack:    # stopped in reverse: the nodes, the server, the proxies
            server = stack.start_server(str(tmp_path / "server.duckdb"))
            for name, fake in (("a", fake_a), ("b", fake_b)):
                stack.start_node(db=str(tmp_path / f"node-{name}.duckdb"), backend=fake.url,
                                 work=tmp_path / f"node-{name}", proxy_port=launch.free_port(),
                                 workers=1, max_tokens=8, server_url=server.url, node_id=name)
            run = LoopRun([TRAIN, "loop", "--tasks", str(tasks), "--iterations", "2", "--out", str(out),
                           "--harness", "command", "--samples", "2", "--server", server.url, "--model", model,
                           "--lr", "1e-3", "--token-budget", "256"])
            assert run.wait(600) == 0, run.output[-3000:]
        state = json.loads((out / "loop.json").read_text())
        assert state["version"] == 2
        for fake in (fake_a, fake_b):    # v0 (the base) at start, then v1 and v2
            assert [w for _, _, w in fake.reloads] == [str(Path(model).resolve()), str(out / "checkpoints" / "v1"),
                                                      state["checkpoint"]]
    ran = set()
    for name in ("a", "b"):
        _, rows = query(tmp_path / f"node-{name}.duckdb", "SELECT session_id, policy_version FROM calls")
        ran |= {name} if rows else set()
        assert all(v == int(sid.split("@")[1].split(".")[1].split("~")[0]) for sid, v in rows), rows
    assert ran == {"a", "b"}   # one RUN slot each: both nodes sampled
    _, rows = query(out / "loop.duckdb", "SELECT iteration, policy_version, calls FROM loop_iterations ORDER BY 1")
    assert [r[:2] for r in rows] == [(0, 0), (1, 1)] and all(r[2] > 0 for r in rows)
