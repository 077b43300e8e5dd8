"""The tests evaluator's parts (spec.TestsEvaluator): the shell that takes a session's diff,
the shell that applies it to a fresh copy and runs the task's tests, and the grade, read with
the official `swebench` package's log parser and report.

The grade is stricter than SWE-bench's report alone: every fail_to_pass and pass_to_pass
test must show as passed in the log. A test that never ran (its file deleted, a collection
error) counts as failed, never as "silently" passed. And the diff cannot change what grades
it: the test files the tests name, every conftest.py, and the files that configure pytest
(pytest.ini, tox.ini, setup.cfg, pyproject.toml) are the task's own again after the diff is
applied (new ones are removed). What it cannot stop: the code under test runs in the test
process, so a diff can still rewrite how that process reports (as in SWE-bench itself).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from .spec import TestsEvaluator

PATCH = "polar.patch"      # in the session's TMPDIR
# Left out of the diff: the harnesses' own files, installs, caches (as the seed's harness does)
EXCLUDED = (".git", ".claude", ".codex", ".gemini", ".qwen", ".pi", ".mcp.json", ".polar", "node_modules",
            ".venv", "venv", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", ".ruff_cache", "trajectories")


# Files that configure the test runner, at any depth: after the diff, the task's versions (or
# none, where the task has none). A plugin named in an ini file's addopts is code that grades.
RUNNER_FILES = " ".join(f"'{p}' '*/{p}'" for p in ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg",
                                                   "pyproject.toml"))


class GradingUnavailable(RuntimeError):
    """The swebench package is not installed on this node."""


def diff_script(workdir: str, exclude: tuple[str, ...] = ()) -> str:
    """Writes the session's diff of its workdir against its commit to $TMPDIR/polar.patch
    (exit 3: the workdir is no git repository)."""
    specs = " ".join(shlex.quote(f":(exclude,glob)**/{p}") + " " + shlex.quote(f":(exclude,glob)**/{p}/**")
                     for p in (*EXCLUDED, *exclude))
    # the session's own .git/config may name commands (an fsmonitor, an external diff): off
    git = ("git -c safe.directory='*' -c core.quotepath=off -c core.fsmonitor=false -c core.hooksPath=/dev/null "
           "-c diff.external=")
    return (f"cd {shlex.quote(workdir)} || exit 3\n"
            f"{git} rev-parse --verify -q HEAD >/dev/null || "
            f"{{ echo 'the workspace is not a git repository with a commit: the tests evaluator diffs against it' >&2;"
            f" exit 3; }}\n"
            f"{git} add -A -- . {specs} >/dev/null || exit 4\n"
            f"{git} diff --cached --binary --no-ext-diff --no-textconv HEAD > \"$TMPDIR/{PATCH}\"\n")


def test_files(ev: TestsEvaluator) -> list[str]:
    """The files the tests are in (pytest's node ids: FILE::name)."""
    return sorted({t.split("::", 1)[0] for t in (*ev.fail_to_pass, *ev.pass_to_pass) if "::" in t})


def test_script(ev: TestsEvaluator, workdir: str) -> str:
    """In a fresh copy: applies $TMPDIR/polar.patch (exit 5: it does not apply), puts the task's
    test files and conftest.py files back, and runs the tests (their log is the output)."""
    git = "git -c safe.directory='*'"
    files = " ".join(shlex.quote(f) for f in test_files(ev))
    restore = (f"for f in {files}; do {git} cat-file -e \"HEAD:$f\" 2>/dev/null && {git} checkout -q HEAD -- \"$f\"; "
               f"done\n") if files else ""
    tests = " ".join(shlex.quote(t) for t in (*ev.fail_to_pass, *ev.pass_to_pass))
    return (f"cd {shlex.quote(workdir)} || exit 3\n"
            f"{git} apply --binary --whitespace=nowarn \"$TMPDIR/{PATCH}\" || "
            f"{{ echo 'the diff does not apply to the task repository' >&2; exit 5; }}\n"
            f"{restore}"
            # what configures pytest (conftest.py, its ini files): the task's own, none the diff added
            f"{git} ls-files -z -- {RUNNER_FILES} | xargs -0 -r {git} checkout -q HEAD --\n"
            f"{git} ls-files -z --others -- {RUNNER_FILES} | xargs -0 -r rm -f --\n"
            f"echo '>>>>> polar tests start'\n"
            f"{ev.test_command.replace('{tests}', tests)}\n"
            f"echo \">>>>> polar tests exit $?\"\n")


@dataclass
class TestsGrade:
    resolved: bool
    status: str                           # swebench's: RESOLVED_FULL, RESOLVED_PARTIAL, RESOLVED_NO
    tests: dict[str, str] = field(default_factory=dict)   # each listed test: PASSED, FAILED, ... or MISSING
    report: dict = field(default_factory=dict)            # swebench's get_eval_tests_report

    @property
    def reward(self) -> float:
        return 1.0 if self.resolved else 0.0

    def summary(self) -> str:
        bad = [f"{t} {s}" for t, s in self.tests.items() if s not in ("PASSED", "XFAIL")]
        return f"{self.status}: {len(self.tests) - len(bad)} of {len(self.tests)} tests passed" + (
            f"; not passed: {', '.join(bad[:10])}" + (" ..." if len(bad) > 10 else "") if bad else "")


def grade(log: str, ev: TestsEvaluator) -> TestsGrade:
    """The log of test_script's tests, graded: resolved when every listed test passed."""
    try:
        from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS
        from swebench.harness.grading import get_eval_tests_report, get_resolution_status, test_passed
        from swebench.harness.log_parsers.python import parse_log_pytest
    except ImportError as e:
        raise GradingUnavailable(f"the tests evaluator grades with the swebench package, which is not installed "
                                 f"here ({e}): pip install 'polar-mitm[swe]'") from None
    status_map = parse_log_pytest(log, None)   # the pytest parser reads no test spec
    report = get_eval_tests_report(status_map, {FAIL_TO_PASS: list(ev.fail_to_pass),
                                                PASS_TO_PASS: list(ev.pass_to_pass)})
    tests = {t: status_map.get(t, "MISSING") for t in (*ev.fail_to_pass, *ev.pass_to_pass)}
    every = all(test_passed(t, status_map) for t in tests)
    return TestsGrade(resolved=every and get_resolution_status(report) == "RESOLVED_FULL",
                      status=get_resolution_status(report) if every else "RESOLVED_NO", tests=tests, report=report)
