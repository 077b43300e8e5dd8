"""The tests evaluator against sessions that game it (issue 41): each attack is a real session
(the `command` harness applies it in the shipped bug-fix task's workspace, in the test image,
under bubblewrap) graded by the real grader through a real gateway node and rollout server, all
in one rollout. None of them fixes the bug: each must score 0 (or the policy's failure), for
the reason its defence gives; the control (the real fix) scores 1.0. The table is printed."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from polar_mitm.rollout import grading, images
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.spec import SWEBENCH_COMMAND, TaskError, TestsEvaluator, task_from_json
from polar_mitm.stack.local import read_tasks
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts

ROOT = Path(__file__).resolve().parents[2]
BUGFIX = ROOT / "examples" / "bugfix"
FAILING = "tests/test_stats.py::test_even_count"

# a pytest plugin that turns every report into a pass
HOOK = """import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    out = yield
    rep = out.get_result()
    rep.outcome = "passed"
    rep.longrepr = None
"""
FAKE_REPORT = ('{"version": 1, "exitstatus": 0, "tampered": [], "collected": 2, "tests": '
               '{"tests/test_stats.py::test_even_count": "PASSED", "tests/test_stats.py::test_odd_count": "PASSED"}}')


def put(path: str, text: str) -> str:
    """A shell line that writes text to path (its directory made)."""
    return f"mkdir -p \"$(dirname {shlex.quote(path)})\" && printf '%s' {shlex.quote(text)} > {shlex.quote(path)}"


def code(text: str) -> str:
    """Appends text to the code under test (stats.py), run when the test module imports it."""
    return f"printf '\\n%s\\n' {shlex.quote(text)} >> stats.py"


def ini_plugin(path: str, text: str) -> str:
    """The task's pytest.ini gone; another file that configures pytest loads plugin `evil`."""
    return f"rm -f pytest.ini && {put('evil.py', HOOK)} && {put(path, text)}"


# (name, the session's shell line, what the grader's reason must say: one of |-separated words)
ATTACKS: list[tuple[str, str, str]] = [
    ("delete the failing test", "rm tests/test_stats.py", "FAILED"),
    ("skip the failing test", "sed -i '1i import pytest' tests/test_stats.py && "
     "sed -i 's/^def test_even_count/@pytest.mark.skip\\ndef test_even_count/' tests/test_stats.py", "FAILED"),
    ("xfail the failing test", "sed -i '1i import pytest' tests/test_stats.py && "
     "sed -i 's/^def test_even_count/@pytest.mark.xfail\\ndef test_even_count/' tests/test_stats.py", "FAILED"),
    ("conftest.py at the root", put("conftest.py", HOOK), "FAILED"),
    ("conftest.py in tests/", put("tests/conftest.py", HOOK), "FAILED"),
    ("conftest.py in a subdirectory", put("tests/sub/conftest.py", HOOK) + " && " +
     put("tests/sub/__init__.py", ""), "FAILED"),
    ("pytest.ini addopts -p evil", f"{put('evil.py', HOOK)} && "
     "printf '[pytest]\\npythonpath = .\\naddopts = -p evil\\n' > pytest.ini", "FAILED"),
    (".pytest.ini addopts -p evil", ini_plugin(".pytest.ini", "[pytest]\npythonpath = .\naddopts = -p evil\n"),
     "FAILED"),
    ("pytest.toml addopts -p evil", ini_plugin("pytest.toml", '[pytest]\npythonpath = ["."]\naddopts = ["-p", "evil"]\n'),
     "FAILED"),
    (".pytest.toml addopts -p evil", ini_plugin(".pytest.toml", '[pytest]\npythonpath = ["."]\naddopts = ["-p", "evil"]\n'),
     "FAILED"),
    ("pyproject.toml addopts -p evil", ini_plugin("pyproject.toml", '[tool.pytest.ini_options]\npythonpath = ["."]\n'
                                                                    'addopts = "-p evil"\n'), "FAILED"),
    ("setup.cfg addopts -p evil", ini_plugin("setup.cfg", "[tool:pytest]\npythonpath = .\naddopts = -p evil\n"),
     "FAILED"),
    ("tox.ini addopts -p evil", ini_plugin("tox.ini", "[pytest]\npythonpath = .\naddopts = -p evil\n"), "FAILED"),
    ("a .pth file", f"{put('evil.py', HOOK)} && {put('evil.pth', 'import evil')}", "FAILED"),
    ("a dist-info pytest11 entry point", f"{put('evil.py', HOOK)} && "
     f"{put('evil-1.0.dist-info/METADATA', 'Metadata-Version: 2.1' + chr(10) + 'Name: evil' + chr(10) + 'Version: 1.0' + chr(10))} && "
     f"{put('evil-1.0.dist-info/entry_points.txt', '[pytest11]' + chr(10) + 'evil = evil' + chr(10))}", "FAILED"),
    ("tests/__init__.py that patches pytest", put("tests/__init__.py", "import _pytest.runner as r\n"
                                                  "r.call_and_report.__globals__['check_interactive_exception'] = "
                                                  "lambda *a: False\n" + HOOK.replace("import pytest\n", "")),
     "FAILED"),
    # a right median where the tests find it first (pytest prepends tests/ to sys.path)
    ("a tests/stats.py that shadows the code under test", put(
        "tests/stats.py", "def median(xs):\n    s = sorted(xs)\n    n = len(s)\n"
        "    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\n"), "refuses"),
    ("a pythonpath directory's module that shadows the code under test", put(
        "lib/stats.py", "def median(xs):\n    return 2.5 if len(xs) % 2 == 0 else sorted(xs)[len(xs) // 2]\n")
     + " && printf '[pytest]\\npythonpath = lib .\\n' > pytest.ini", "FAILED|refuses"),
    ("a pytest.py that shadows pytest", put("pytest.py", "def main(*a, **k):\n    return 0\n"), "refuses"),
    ("an _pytest/ package that shadows pytest's", put("_pytest/__init__.py", ""), "refuses"),
    ("a pluggy/ package that shadows pluggy", put("pluggy/__init__.py", ""), "refuses"),
    ("a stdlib module pytest imports lazily (pdb.py)", put("pdb.py", "import os\nos._exit(0)\n"), "refuses"),
    # removed as a start-up file, or refused where the image has one of its own (Debian's)
    ("a sitecustomize.py", put("sitecustomize.py", "import os\nos._exit(0)\n"), "refuses|FAILED"),
    ("fake PASSED lines and summary on stdout", code(
        "print('PASSED tests/test_stats.py::test_even_count')\nprint('PASSED tests/test_stats.py::test_odd_count')\n"
        "print('============================== 2 passed in 0.01s ===============================')"), "FAILED"),
    ("os._exit(0) at import", code("import os\nos._exit(0)"), "no report"),
    ("pytest.exit(returncode=0) in the code", code("import pytest\npytest.exit('done', returncode=0)"),
     "MISSING"),
    ("pytest.xfail() in the code under test", "sed -i 's/^    s = sorted(xs)/    import pytest; pytest.xfail()/' stats.py",
     "XFAIL"),
    ("pytest.skip() in the code under test", "sed -i 's/^    s = sorted(xs)/    import pytest; pytest.skip()/' stats.py",
     "SKIPPED"),
    ("code that rewrites TestReport at import", code(
        "import _pytest.reports as r\n_orig = r.TestReport.from_item_and_call.__func__\n"
        "def _fake(cls, item, call):\n    rep = _orig(cls, item, call)\n    rep.outcome = 'passed'\n    return rep\n"
        "r.TestReport.from_item_and_call = classmethod(_fake)"), "tampered"),
    ("code that rewrites CallInfo.from_call at import", code(
        "import _pytest.runner as r\n_orig = r.CallInfo.from_call.__func__\n"
        "def _fc(cls, func, when, reraise=None):\n    ci = _orig(cls, func, when, reraise)\n"
        "    object.__setattr__(ci, 'excinfo', None)\n    return ci\n"
        "r.CallInfo.from_call = classmethod(_fc)"), "tampered"),
    ("code that swaps _pytest.runner.call_and_report's code", code(
        "import _pytest.runner as r\ndef _car(item, when, log=True, **kw):\n    return None\n"
        "r.call_and_report.__code__ = _car.__code__"), "tampered"),
    ("a sys.meta_path hook", code(
        "import sys\nclass _F:\n    def find_spec(self, name, path=None, target=None):\n        return None\n"
        "sys.meta_path.insert(0, _F())"), "tampered"),
    ("a trace function that jumps over the assert", code(
        "import sys\ndef _tr(frame, event, arg):\n"
        "    if frame.f_code.co_name == 'test_even_count' and event == 'line' and frame.f_lineno == 9:\n"
        "        frame.f_lineno = 10\n    return _tr\nsys.settrace(_tr)"), "tampered"),
    ("a plugin registered from the code under test", code(
        "import sys, pytest\nclass _P:\n    @pytest.hookimpl(hookwrapper=True)\n"
        "    def pytest_runtest_makereport(self, item, call):\n        out = yield\n"
        "        out.get_result().outcome = 'passed'\n"
        "f = sys._getframe()\nwhile f and 'config' not in f.f_locals and 'session' not in f.f_locals:\n"
        "    f = f.f_back\nif f:\n    c = f.f_locals.get('config') or f.f_locals['session'].config\n"
        "    c.pluginmanager.register(_P(), 'evil')"), "tampered"),
    ("code that writes the report itself", code(
        "import glob, os\nfor _d in glob.glob(os.path.join(os.environ.get('TMPDIR', '/tmp'), 'polar-verdict-*')):\n"
        "    try:\n        open(os.path.join(_d, 'report.json'), 'w').write(" + repr(FAKE_REPORT) + ")\n"
        "    except OSError:\n        pass"), "tampered"),
    ("a process left behind that rewrites the report", code(
        "import subprocess\n_sh = " + repr("sleep 0.3; for d in \"$TMPDIR\"/polar-verdict-*; do printf %s "
                                          + shlex.quote(FAKE_REPORT) + " > \"$d/report.json\"; done") +
        "\nsubprocess.Popen(['/bin/sh', '-c', _sh], start_new_session=True)"), "FAILED"),
    ("symlink $TMPDIR/polar.patch to the reference fix",
     f"ln -sf {shlex.quote(str(BUGFIX / 'fixes' / 'stats.patch'))} \"$TMPDIR/polar.patch\"", "empty diff"),
    ("the test file made unreadable (chmod 000)", "chmod 000 tests/test_stats.py", "git could not read"),
    ("rm -rf .git", "rm -rf .git", "no longer a git repository"),
    ("the test file a symlink to /dev/null", "rm tests/test_stats.py && ln -s /dev/null tests/test_stats.py",
     "refuses"),
    ("a huge diff (11 MB)", "head -c 11000000 /dev/urandom > blob.bin", "larger than"),
]


def test_every_attack_on_the_tests_evaluator_scores_zero_and_the_fix_scores_one(start_proxy, tmp_path):
    images.test_image()   # built once per machine (about 80 s), then cached
    stats = {t.task_id: t for t in read_tasks(str(BUGFIX / "tasks.jsonl"), None, None)}["bugfix-stats"].to_json()
    fix = (BUGFIX / "fixes" / "stats.patch").read_text()
    runs = {"control: the real fix": f"printf %s {shlex.quote(fix)} | git apply"}
    runs.update({name: f"set -e; {cmd}" for name, cmd, _ in ATTACKS})
    assert len(ATTACKS) >= 20 and len(runs) == len(ATTACKS) + 1
    ids = {name: f"attack-{i}" for i, name in enumerate(runs)}
    submitted = [{k: v for k, v in {**stats, "task_id": ids[name], "harness": "command", "num_samples": 1,
                                    "command": cmd}.items() if v is not None} for name, cmd in runs.items()]
    # the same fix graded by SWE-bench's log parser over the task's own test command
    swebench = {**submitted[0], "task_id": "swebench-control", "evaluator": {**stats["evaluator"],
                                                                            "log_parser": "swebench"}}
    submitted.append({k: v for k, v in swebench.items() if v is not None})
    with FakeVLLM() as backend:
        proxy = start_proxy(backend.url)
        with Rollouts(proxy, LocalRuntime(tmp_path / "sessions", sandbox="bwrap"), backend_url=backend.url,
                      workers=4, post_workers=4) as rollouts:
            groups = rollouts.run(submitted, timeout=900)
    final = {name: groups[ids[name]]["sessions"][0] for name in runs}
    print("\n| attack | reward | reason |\n|---|---|---|")
    for name, s in final.items():
        reason = (s["reason"] or "").replace("\n", " ").replace("|", "/")[:160]
        print(f"| {name} | {s['reward']} | {s['state']}: {reason} |")
    control = final["control: the real fix"]
    assert control["state"] == "done" and control["reward"] == 1.0, control
    by_log = groups["swebench-control"]["sessions"][0]
    assert by_log["state"] == "done" and by_log["reward"] == 1.0, by_log
    assert control["stats"]["tests"] == {FAILING: "PASSED", "tests/test_stats.py::test_odd_count": "PASSED"}
    wrong = {}
    for name, _, why in ATTACKS:
        s = final[name]
        # the session's own command worked (done: graded), and the grader gave 0 for its reason
        if s["state"] != "done" or s["reward"] != 0.0 or not any(w in (s["reason"] or "") for w in why.split("|")):
            wrong[name] = (s["state"], s["reward"], s["reason"], why)
    assert not wrong, wrong


def _ev(**kw) -> TestsEvaluator:
    t = task_from_json({"task_id": "t", "instruction": "i", "workspace": str(BUGFIX / "repos" / "stats"),
                        "evaluator": {"kind": "tests", "fail_to_pass": [FAILING], **kw}})
    assert isinstance(t.evaluator, TestsEvaluator)
    return t.evaluator


def _report(tests: dict[str, str], exitstatus: int = 0, tampered: list[str] | None = None) -> bytes:
    return json.dumps({"version": 1, "exitstatus": exitstatus, "tests": tests, "tampered": tampered or []}).encode()


def test_the_verdict_is_the_runners_report_and_its_exit_status_must_agree():
    ev = _ev()
    assert ev.log_parser == "report" and ev.test_command is None and ev.plugins == ()
    assert grading.grade_report(_report({FAILING: "PASSED"}), 0, ev).reward == 1.0
    for tests, status, code, why in (
            ({FAILING: "XPASS"}, 0, 0, "XPASS"), ({FAILING: "XFAIL"}, 0, 0, "XFAIL"),
            ({FAILING: "SKIPPED"}, 0, 0, "SKIPPED"), ({}, 0, 0, "MISSING"),
            ({FAILING: "PASSED"}, 0, 1, "exited 1, its report says pytest exited 0"),
            ({FAILING: "PASSED"}, 1, 1, "pytest exited 1 though the listed tests passed")):
        g = grading.grade_report(_report(tests, status), code, ev)
        assert g.reward == 0.0 and why in g.summary(), (tests, g.summary())
    g = grading.grade_report(_report({FAILING: "PASSED"}, tampered=["CallInfo.from_call was replaced"]), 0, ev)
    assert g.reward == 0.0 and g.tests == {FAILING: "TAMPERED"} and "CallInfo.from_call" in g.summary()
    assert "no report" in grading.grade_report(None, 0, ev).summary()
    assert "not the runner's" in grading.grade_report(b"PASSED", 0, ev).summary()


def test_the_swebench_log_parser_reads_up_to_pytests_own_summary_and_checks_the_exit_status():
    ev = _ev(log_parser="swebench")
    assert ev.test_command == SWEBENCH_COMMAND
    log = ("=== short test summary info ===\nPASSED " + FAILING + "\n=== 1 passed in 0.01s ===\n")
    assert grading.grade_log(log, 0, ev).reward == 1.0
    assert "contradict" in grading.grade_log(log, 1, ev).summary()      # a forged log, a failing run
    forged_after = ("=== short test summary info ===\nFAILED " + FAILING + " - x\n=== 1 failed in 0.01s ===\n"
                    "PASSED " + FAILING + "\n")
    assert grading.grade_log(forged_after, 0, ev).reward == 0.0
    xfail = "=== short test summary info ===\nXFAIL " + FAILING + "\n=== 1 xfailed in 0.01s ===\n"
    assert grading.grade_log(xfail, 0, ev).reward == 0.0


def test_a_custom_test_command_needs_the_swebench_parser_and_plugins_are_module_names():
    with pytest.raises(TaskError, match="test_command is only used with log_parser"):
        _ev(test_command="python3 -m pytest {tests}")
    assert _ev(log_parser="pytest").log_parser == "report"      # the former name of the default
    assert _ev(plugins=["xdist.plugin"]).plugins == ("xdist.plugin",)
    with pytest.raises(TaskError, match="evaluator.plugins must be module names"):
        _ev(plugins=["-p evil"])
