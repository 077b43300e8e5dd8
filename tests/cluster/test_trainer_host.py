"""The trainer as a Ray actor (cluster/trainer_host.py) on another node than the driver: it
trains as a Trainer here does, its checkpoint and state come back to the driver's disk, its
weights are served from its own node, a run resumes on it from the driver's files, and its node
never opens the driver's folder (everything it needs is sent through Ray)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import pytest

from support.ray_cluster import LocalCluster  # noqa: E402  (before Ray is imported: it keeps Ray on loopback)
from support import file_access  # noqa: E402
from support.grpo_data import synthetic_calls, tiny_model_dir

ray = pytest.importorskip("ray", reason="the [ray] extra is part of the test install (pyproject)")

import httpx  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load, load_file  # noqa: E402

from polar_mitm.cluster.trainer_host import RemoteTrainer  # noqa: E402
from polar_mitm.grpo.config import LossConfig, TrainConfig  # noqa: E402
from polar_mitm.grpo.train import Trainer, TrainError  # noqa: E402

PLACE = {"trainer_test": 1.0}     # only node n1 offers it
CFG = TrainConfig(lr=1e-3, warmup_steps=3, token_budget=64, groups_per_step=1, loss=LossConfig(kl_coef=0.05))


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(nodes=2, cpus=2, resources={1: PLACE})
    try:
        ray.init(address=c.address, namespace="polar-trainer-test", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-5) for k in a)


def test_the_trainer_actor_trains_saves_and_publishes_as_a_local_trainer(cluster, tmp_path):
    driver = tmp_path / "driver"
    model = tiny_model_dir(driver / "model")
    watch = file_access.OpenWatch(tmp_path) if file_access.available() is None else None
    remote = RemoteTrainer.start(model, CFG, ref_model=model, resources=PLACE)
    try:
        # placed on the node with the resource, not the driver's; its folder is that node's own
        assert remote.where["node_id"] != ray.get_runtime_context().get_node_id()
        assert remote.where["dir"].startswith(str(cluster.dirs[1].root)), remote.where
        assert remote.where["address"] == "127.0.0.1" and remote.where["gpus"] == []
        assert remote.step == 0

        local = Trainer(model, CFG, ref_model=model)
        calls = synthetic_calls(tasks=2, seed=0)
        seen: list[tuple[int, int, float]] = []
        got = remote.train_on(calls, driver / "it0", lambda n, total, m: seen.append((n, total, m.loss)))
        want = local.train_on(calls, tmp_path / "local0")
        # the same losses, step by step (fp tolerance: the actor's torch runs on fewer threads)
        assert [m.step for m in got.history] == [1, 2]
        for g, w in zip(got.history, want.history):
            assert g.loss == pytest.approx(w.loss, rel=1e-4, abs=1e-6)
            assert g.kl == pytest.approx(w.kl, rel=1e-3, abs=1e-7) and g.lr == w.lr
        assert (got.calls, got.groups, got.sessions) == (want.calls, want.groups, want.sessions)
        # progress came step by step, and the metric files are on the driver's disk
        assert [(n, total) for n, total, _ in seen] == [(1, 2), (2, 2)]
        assert got.metrics_path == driver / "it0" / "metrics.jsonl"
        assert [json.loads(line)["step"] for line in got.metrics_path.read_text().splitlines()] == [1, 2]
        assert (driver / "it0" / "metrics.png").stat().st_size > 0
        assert remote.step == local.step == 2

        # the checkpoint folder, written on the driver: the local save's files, the same tensors
        remote.save(driver / "ckpt")
        local.save(tmp_path / "ckpt-local")
        assert sorted(p.name for p in (driver / "ckpt").iterdir()) == \
            sorted(p.name for p in (tmp_path / "ckpt-local").iterdir())
        assert close(tensors(driver / "ckpt"), tensors(tmp_path / "ckpt-local"))
        assert not (driver / "ckpt.tmp").exists()
        print("transfers:", {k: dataclasses.asdict(v) for k, v in remote.transfers.items()})

        # published from the actor's own weight server: the blob's digest, the trained weights
        published = remote.publish(None)
        assert published.url.startswith("http://127.0.0.1:")
        blob = httpx.get(published.url, trust_env=False, timeout=30).content
        assert len(blob) == published.bytes and hashlib.sha256(blob).hexdigest() == published.sha256
        served = load(blob)
        assert all(torch.allclose(served[k], v, atol=1e-6, rtol=1e-5)
                   for k, v in tensors(driver / "ckpt").items())

        # the trainer's state on the driver's disk, and back: load_state resets the clock
        remote.save_state(driver / "state.pt")
        assert torch.load(driver / "state.pt", weights_only=True)["step"] == 2
        assert not list(driver.glob("*.tmp")) and not list(driver.glob("state.pt.*"))
        remote.train_on(synthetic_calls(tasks=2, seed=1), driver / "it1")
        assert remote.step == 4
        remote.load_state(driver / "state.pt")
        assert remote.step == 2

        # the trainer's own errors are raised as themselves
        flat = [dataclasses.replace(c, reward=1.0) for c in calls]
        with pytest.raises(TrainError, match="rewards are equal"):
            remote.train_on(flat, driver / "flat")
    finally:
        remote.close()
        if watch is not None:
            watch.stop()
    if watch is not None:   # node n1 opened nothing of the driver's: everything came through Ray
        assert not watch.opens.get("n1"), sorted(watch.opens["n1"])[:5]


def test_a_resumed_run_ships_its_checkpoint_and_state_to_the_actor(cluster, tmp_path):
    """A rerun's trainer: the driver's checkpoint and trainer state sent to a new actor, which
    goes on as the trainer that saved them (as Trainer(checkpoint) + load_state does here)."""
    model = tiny_model_dir(tmp_path / "model")
    first = Trainer(model, CFG, ref_model=model)
    first.train_on(synthetic_calls(tasks=2, seed=0), tmp_path / "a0")
    first.save(tmp_path / "ckpt")
    first.save_state(tmp_path / "state.pt")
    first.train_on(synthetic_calls(tasks=2, seed=1), tmp_path / "a1")

    with RemoteTrainer.start(tmp_path / "ckpt", CFG, ref_model=model, trainer_state=tmp_path / "state.pt",
                             resources=PLACE, name="polar-trainer-resumed") as resumed:
        assert resumed.step == 2
        assert set(resumed.transfers) == {"send model", "send state"}
        got = resumed.train_on(synthetic_calls(tasks=2, seed=1), tmp_path / "b1")
        resumed.save(tmp_path / "ckpt-resumed")
    first.save(tmp_path / "ckpt-first")
    assert [m.global_step for m in got.history] == [3, 4]
    assert close(tensors(tmp_path / "ckpt-resumed"), tensors(tmp_path / "ckpt-first"))
    assert ray.util.list_named_actors() == [] or "polar-trainer-resumed" not in ray.util.list_named_actors()


def test_the_loop_trains_in_the_actor_and_resumes_from_the_drivers_files(cluster, tmp_path):
    """`polar-train loop --ray ... --trainer-actor`: the actor trains, serves each version to the
    replica and writes the checkpoints, the trainer state and the metrics on the driver's --out;
    a rerun resumes there, its checkpoint and state sent to a new actor."""
    from support.fake_vllm import FakeVLLM
    from support.loop_run import TRAIN, LoopRun, fake_tasks
    from polar_mitm.store import query

    model = str(tiny_model_dir(tmp_path / "model"))
    tasks = fake_tasks(tmp_path, "ok 2")
    env = {**cluster.env(), "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    out = tmp_path / "run"
    with FakeVLLM(delay=0.01) as replica:
        replica.fetch_pulls = True
        for iterations in (1, 2):
            run = LoopRun([TRAIN, "loop", "--ray", cluster.address, "--tasks", str(tasks), "--iterations",
                           str(iterations), "--out", str(out), "--backend", replica.url, "--model", model,
                           "--harness", "command", "--workers", "2", "--max-tokens", "8", "--lr", "1e-3",
                           "--token-budget", "256", "--samples", "3", "--trainer-actor"], env=env, cwd=str(tmp_path))
            t0 = time.monotonic()
            assert run.wait(300) == 0, run.output[-4000:]
            print(f"loop --iterations {iterations} --trainer-actor: {time.monotonic() - t0:.1f}s")
            assert "trainer: Ray actor polar-trainer on node" in run.output, run.output[-3000:]
            assert f"synced policy v{iterations}" in run.output, run.output[-3000:]
        assert replica.weight_version == "polar-v2"
        # the second run's first pull is v1 again (resumed from the driver's checkpoint), then v2
        assert len({sha for sha, _ in replica.pulled}) == 2, replica.pulled
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["v1", "v2"]
    assert (out / "checkpoints" / "v2" / "model.safetensors").exists()
    assert [p.name for p in (out / "trainer").iterdir()] == ["v2.pt"]
    assert torch.load(out / "trainer" / "v2.pt", weights_only=True)["step"] == 2
    for it in ("0000", "0001"):
        assert (out / "iterations" / it / "metrics.jsonl").read_text().strip()
    _, rows = query(str(out / "rollouts.duckdb"), "SELECT iteration, policy_version FROM loop_iterations ORDER BY 1")
    assert [tuple(r) for r in rows] == [(0, 0), (1, 1)]
