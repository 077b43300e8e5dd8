"""Tasks in their own environment image, graded by their tests (issue 33): the shipped bug-fix
task file (examples/bugfix) through a real gateway and rollout server, each session in the
test image (scripts/build_test_image.sh) under bubblewrap. A `command` harness stands in for
the model: it applies the right patch (1.0), changes nothing (0.0: an empty diff), or games
the grader (deletes the failing test, adds a conftest.py that passes everything: 0.0; the grader
puts the test file, the pytest.ini and no conftest.py back, and its runner's report says the
test FAILED). tests/rollout/test_grader_attacks.py plays every other attack."""

from __future__ import annotations

import shlex
from pathlib import Path

from polar_mitm.rollout import images
from polar_mitm.rollout.protocol import Group
from polar_mitm.rollout.rewards import complete_fraction, incomplete
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.spec import TestsEvaluator
from polar_mitm.stack.local import read_tasks
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts

ROOT = Path(__file__).resolve().parents[2]
BUGFIX = ROOT / "examples" / "bugfix"

HOOK = ("printf '%s\\n' 'import pytest' '@pytest.hookimpl(hookwrapper=True)' "
        "'def pytest_runtest_makereport(item, call):' '    out = yield' '    out.get_result().outcome = \"passed\"'")
# deletes the failing test, and adds a hook that passes everything: as a conftest.py, and as a
# plugin that the pytest.ini loads
CHEAT = (f"rm -f tests/test_stats.py; {HOOK} > conftest.py; {HOOK} > polarcheat.py; "
         "printf '[pytest]\\npythonpath = .\\naddopts = -p polarcheat\\n' > pytest.ini")


def test_the_bugfix_tasks_score_by_their_tests_in_the_image(start_proxy, tmp_path):
    images.test_image()   # built once per machine (about 80 s), then cached
    tasks = {t.task_id: t for t in read_tasks(str(BUGFIX / "tasks.jsonl"), None, None)}
    assert set(tasks) == {"bugfix-slugify", "bugfix-stats", "bugfix-interval"}
    for t in tasks.values():   # relative to the task file
        assert Path(t.workspace.path or "").is_dir() and isinstance(t.evaluator, TestsEvaluator)
    submitted = []
    for t in tasks.values():
        name = t.task_id.removeprefix("bugfix-")
        patch = (BUGFIX / "fixes" / f"{name}.patch").read_text()
        spec = {**t.to_json(), "harness": "command", "num_samples": 1,
                "command": f"printf %s {shlex.quote(patch)} | git apply"}
        submitted.append(spec)
    stats = tasks["bugfix-stats"].to_json()
    submitted.append({**stats, "task_id": "nothing", "harness": "command", "num_samples": 1, "command": "true"})
    submitted.append({**stats, "task_id": "cheat", "harness": "command", "num_samples": 1, "command": CHEAT})
    with FakeVLLM() as backend:
        proxy = start_proxy(backend.url)
        with Rollouts(proxy, LocalRuntime(tmp_path / "sessions", sandbox="bwrap"),
                      backend_url=backend.url) as rollouts:
            groups: dict[str, Group] = rollouts.run(
                [{k: v for k, v in spec.items() if v is not None} for spec in submitted], timeout=600)
    final = {tid: g["sessions"][0] for tid, g in groups.items()}
    for tid in tasks:
        s = final[tid]
        assert s["state"] == "done" and s["reward"] == 1.0, s
        ev = tasks[tid].evaluator
        assert isinstance(ev, TestsEvaluator)
        assert s["stats"]["tests"] == {t: "PASSED" for t in (*ev.fail_to_pass, *ev.pass_to_pass)}, s["stats"]
        assert s["stats"]["image_unpack_s"] >= 0 and s["stats"]["diff_bytes"] > 0
    assert final["nothing"]["reward"] == 0.0 and final["nothing"]["reason"].startswith("empty diff"), final["nothing"]
    cheat = final["cheat"]
    assert cheat["state"] == "done" and cheat["reward"] == 0.0, cheat
    assert cheat["stats"]["tests"]["tests/test_stats.py::test_even_count"] == "FAILED", cheat["stats"]
    # groups good enough: one sample of one, done with its own reward
    assert complete_fraction(groups["bugfix-stats"]) == 1.0 and incomplete(groups["bugfix-stats"], 1.0) is None


def _group(states: list[tuple[str, float | None]]) -> Group:
    return {"task_id": "t", "state": "done", "sessions": [
        {"session_id": f"t~{i}", "state": st, "reward": r, "reason": None, "stats": {}, "attempt": 1}
        for i, (st, r) in enumerate(states)], "attempts": []}   # type: ignore[typeddict-item]


def test_a_group_trains_only_when_enough_of_its_samples_ended_with_a_reward():
    g = _group([("done", 1.0), ("done", 0.0), ("failed", 0.0), ("timed_out", 0.0), ("done", None)])
    assert complete_fraction(g) == 0.4
    assert incomplete(g, 0.0) is None and incomplete(g, 0.4) is None
    assert incomplete(g, 0.6) == ("2 of its 5 samples ended with a reward of their own, below its "
                                  "min_complete_fraction 0.6")


def test_pi_fixes_the_bugs_in_the_image_with_a_stand_in_that_answers_the_patch(tmp_path):
    """The must-show run: `polar-mitm rollout` of the shipped task file with Pi, each session
    in the test image, the stand-in backend answering Pi's first turn with a call of its bash
    tool that applies the right patch (scripts/bugfix_rollout.py): every test passes, 1.0."""
    import subprocess
    import sys

    from polar_mitm.store import query

    images.test_image()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bugfix_rollout.py"), "--backend", "stand-in",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, rows = query(tmp_path / "rollouts.duckdb", "SELECT session_id, state, reward, stats FROM rollout_sessions")
    assert sorted((sid, state, reward) for sid, state, reward, _ in rows) == [
        ("bugfix-interval~0", "done", 1.0), ("bugfix-slugify~0", "done", 1.0), ("bugfix-stats~0", "done", 1.0)]
    _, calls = query(tmp_path / "rollouts.duckdb", "SELECT count(*) FROM call_records WHERE error IS NULL")
    assert calls[0][0] >= 6   # Pi's turns went through the proxy: the tool call, then its answer
