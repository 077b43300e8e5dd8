"""The version on a call is the version that served it (issue 31, section 2). A stand-in vLLM
restarts under the gateway (back on its start-up weights, untagged) while calls come: no
stored call carries a version whose weights did not serve it; the gateway notices at once
(its kept connection ends with the old process), records the calls it cannot vouch for as
unknown (NULL), reloads its checkpoint and vouches again; and unknown calls are never
trained."""

from __future__ import annotations

import threading
import time

import httpx
import openai

from support.fake_vllm import FakeVLLM
from polar_mitm.store import query
from support.procs import until

TOKEN = "restart-token"


def post(proxy, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(proxy.base_url + path, json=body or {}, headers={"authorization": f"Bearer {TOKEN}"},
                      timeout=60, trust_env=False)


def health(proxy) -> dict:
    return httpx.get(proxy.base_url + "/_polar/health", headers={"authorization": f"Bearer {TOKEN}"},
                     timeout=10, trust_env=False).json()


def served_by(content: str) -> str:
    """The weights that answered, from the stand-in's answer ("ok" or "ok <weights>")."""
    return "base" if content == "ok" else content.removeprefix("ok ")


OK_LOGPROBS = (-0.5, -0.1)      # the stand-in's "ok" answer's two tokens, under its start-up weights


def check_versions(db, weights_of: dict[int, str]) -> dict:
    """Every stored call's version against the weights that answered it; counts per version.
    On the token route every token's version is checked: its logprob is the one the weights
    of that version give it (the stand-in's logprob_under, a re-score), and the call's version
    is its first token's. On the chat route the answer names the weights that served it."""
    rows = query(db, "SELECT policy_version, token_versions, logprobs, "
                     "response_json->>'$.choices[0].message.content' FROM calls WHERE error IS NULL")[1]
    counts: dict = {}
    for version, versions, logprobs, content in rows:
        counts[version] = counts.get(version, 0) + 1
        if versions is not None:
            assert len(versions) == len(logprobs) and version == versions[0], (version, versions)
            for j, v in enumerate(versions):
                if v is not None:
                    want = FakeVLLM.logprob_under(weights_of[v], OK_LOGPROBS[j])
                    assert abs(logprobs[j] - want) < 1e-5, (j, v, logprobs, want)
        elif version is not None:
            assert served_by(content) == weights_of[version], (version, content)
    return counts


def test_a_restarted_backend_never_passes_for_the_synced_version(start_proxy):
    with FakeVLLM(delay=0.05) as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}", "polar_policy_checkpoint=base",
                                       "polar_version_check=0.2"])
        assert post(proxy, "/_polar/sync", {"checkpoint": "/ckpt/1", "version": 1}).status_code == 200
        stop = threading.Event()
        errors: list[BaseException] = []

        def caller(i: int) -> None:
            client = openai.OpenAI(base_url=proxy.base_url + "/v1", api_key=f"polar-restart~{i}", max_retries=0,
                                   timeout=30)
            while not stop.is_set():
                try:
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                except openai.APIError:
                    time.sleep(0.02)      # the backend is down for a moment: a failed call, recorded as one
                except BaseException as e:   # noqa: BLE001
                    errors.append(e)
                    return

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
        for t in callers:
            t.start()
        try:
            for _ in range(3):          # restarts under load, each back at once (a fast supervisor)
                time.sleep(0.6)
                fake.restart()
                assert until(lambda: health(proxy)["policy"]["verified"], 10), health(proxy)
        finally:
            time.sleep(0.5)
            stop.set()
            for t in callers:
                t.join(30)
        assert not errors, errors
        report = health(proxy)
    # every restart was seen, and healed by reloading the synced checkpoint
    check = report["version_check"]
    assert report["policy"]["epoch"] == report["policy"]["losses"] == 3 and check["resyncs"] == 3, report
    assert [w for _, _, w in fake.reloads] == ["/ckpt/1"] * 4
    counts = check_versions(proxy.db, {1: "/ckpt/1"})
    assert counts.get(1, 0) > 20, counts          # most calls are vouched for
    # the stand-in served base weights after each restart until the reload: none of those
    # answers carries version 1 (check_versions), and some came (the test saw the window)
    based = [s for s in fake.served if s[2] == "base"]
    assert based, "no call reached the restarted backend before the reload"


def test_verify_and_a_sync_that_finds_a_foreign_tag(start_proxy):
    """/_polar/verify reads the tag at once (a node asks when a session ends); a sync that
    finds vLLM tagged by someone else loses the version first: the calls since the last check
    cannot be vouched for."""
    with FakeVLLM() as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}", "polar_version_check=0"])
        assert post(proxy, "/_polar/sync", {"checkpoint": "/ckpt/1", "version": 1}).status_code == 200
        assert post(proxy, "/_polar/verify").json() == {"state": "ok", "verified": True, "epoch": 0, "losses": 0,
                                                        "version": 1, "error": None}
        fake.weight_version = "someone-else"         # another gateway synced this vLLM
        got = post(proxy, "/_polar/verify").json()
        # no checkpoint known? it has /ckpt/1 from the sync: reloaded, vouched for again
        assert got["epoch"] == 1 and got["verified"] and fake.reloads[-1][2] == "/ckpt/1", got
        fake.weight_version = "someone-else"
        assert post(proxy, "/_polar/sync", {"checkpoint": "/ckpt/2", "version": 2}).status_code == 200
        assert health(proxy)["policy"]["epoch"] == 2 and health(proxy)["policy"]["verified"]
        assert post(proxy, "/_polar/verify", None).status_code == 200
        assert httpx.post(proxy.base_url + "/_polar/verify", timeout=10, trust_env=False).status_code == 403


def test_a_gateway_that_never_synced_takes_a_restarted_untagged_backend_as_at_start(start_proxy):
    """Without a checkpoint to reload (polar-mitm up or rollout against a --backend), version
    0 is what the backend was started with, as the gateway took it at its own start: a
    restarted, untagged backend is taken the same way again. The calls across the restart
    stay unknown and count as a loss (a node releases the sessions that ran across it)."""
    with FakeVLLM(delay=0.3) as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}", "polar_version_check=0.2"])
        client = openai.OpenAI(base_url=proxy.base_url + "/v1", api_key="polar-unknown~0", max_retries=0)
        ask = lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])  # noqa: E731
        ask()
        assert until(lambda: health(proxy)["version_check"]["checks"] >= 1, 10)   # tagged polar-v0 by now
        results: list = []
        def ask_across():
            try:
                results.append(ask())
            except openai.APIError as e:
                results.append(e)
        across = threading.Thread(target=ask_across)
        across.start()
        time.sleep(0.1)
        fake.restart()                          # the call in flight is cut; it fails
        across.join(30)
        assert until(lambda: health(proxy)["version_check"]["state"] == "ok", 10), health(proxy)
        ask()
        policy = health(proxy)["policy"]
        assert fake.weight_version == "polar-v0" and policy["losses"] == 1 and policy["verified"], policy
    rows = query(proxy.db, "SELECT policy_version, error IS NULL FROM calls ORDER BY seq")[1]
    assert rows[0] == (0, True) and rows[-1] == (0, True) and (rows[1][1] is False or rows[1][0] is None), rows


def test_a_backend_restart_during_the_loops_rollouts_trains_no_call_as_the_wrong_version(tmp_path):
    """`polar-train loop` against a stand-in vLLM that restarts (twice) during iteration 2's
    rollouts, back on its start-up weights: the gateway reloads version 1 itself, the
    sessions that ran across a restart run again, every stored call's version is the one
    whose weights answered it (or unknown), and no unknown call is in a rewarded session."""
    from pathlib import Path

    from support.grpo_data import tiny_model_dir
    from support.loop_run import TRAIN, LoopRun, fake_tasks

    model = str(Path(tiny_model_dir(tmp_path / "model")).resolve())
    tasks = fake_tasks(tmp_path, "slow:0.5 3")
    out = tmp_path / "run"
    with FakeVLLM(delay=0.15) as fake:
        run = LoopRun([TRAIN, "loop", "--tasks", str(tasks), "--iterations", "3", "--out", str(out),
                       "--harness", "command", "--samples", "2", "--backend", fake.url, "--model", model,
                       "--lr", "1e-3", "--token-budget", "256", "--workers", "2", "--max-tokens", "8"])
        assert until(lambda: "rollouts (policy v1)" in run.output or run.proc.poll() is not None, 300), run.output
        assert until(lambda: len(fake.bodies) > 0 and fake.weights != "base" and run.proc.poll() is None, 30)
        seen = len(fake.bodies)
        assert until(lambda: len(fake.bodies) >= seen + 2, 30)
        fake.restart()
        assert until(lambda: fake.weights != "base", 30), "the gateway never reloaded its version"
        assert until(lambda: len(fake.bodies) >= seen + 6 or run.proc.poll() is not None, 30)
        fake.restart(pause=0.5)
        assert run.wait(600) == 0, run.output[-3000:]
    assert fake.restarts == 2
    db = out / "rollouts.duckdb"
    weights = {0: model, **{v: ck for v, ck in query(db, "SELECT version, checkpoint FROM policy_versions")[1]}}
    counts = check_versions(db, {**weights, 0: model})
    assert set(counts) - {None} == {0, 1, 2}, counts
    # released because of the restarts: never scored; the final attempts all were
    rows = query(db, "SELECT session_id, state, reward, reason FROM rollout_sessions")[1]
    released = [r for r in rows if r[1] == "released"]
    assert released and all(r[2] is None for r in released), rows
    assert all(("backend" in r[3] or "version" in r[3]) for r in released), released
    # no rewarded session has a call of unknown version (and so none was trained)
    bad = query(db, "SELECT c.session_id FROM calls c JOIN sessions s USING (session_id) "
                    "WHERE s.reward IS NOT NULL AND c.policy_version IS NULL")[1]
    assert bad == [], bad
    print("calls per version", counts, "released", [(r[0], r[3]) for r in released])
