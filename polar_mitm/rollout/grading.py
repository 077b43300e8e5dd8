"""The tests evaluator's parts (spec.TestsEvaluator): the shell that takes a session's diff,
the shell that grades it in a fresh sandbox, and the verdict read back from the runner's own
report. The grade trusts only what pytest's runner decided, computed where the patch cannot
reach; never what the code under test prints.

The diff: the session's sandbox runs `git diff` and its STDOUT is the diff (a node-made log
file, at most DIFF_LIMIT bytes, read without following links); no file the session can
place is ever read. It fails as the session's doing (.git removed or broken: 0.0).

The grading sandbox is fresh (the image again, prepare then eval_prepare, the workspace as
the task gave it). The node writes into its TMPDIR (a directory the node made, which the
patch cannot reach) the patch, the runner (pytest_verdict.py) and its config, and makes the
verdict's directory under a random name chosen after the diff was taken. In the sandbox, with
the image's `python3 -I` (the workdir never on sys.path ahead of the installed packages):
`prepare` saves what pytest reads as configuration before the patch is applied; the patch is
applied; `restore` puts every configuration file back as the task has it (conftest.py at every
level, pytest.ini, .pytest.ini, pytest.toml, .pytest.toml, tox.ini, setup.cfg, pyproject.toml,
*.pth, *.egg-info, *.dist-info, sitecustomize, the listed test files and their packages'
__init__.py; new ones removed) and refuses (0.0) a diff that adds a symbolic link or a module
that shadows the standard library or an installed package (pytest, _pytest, pluggy, ...) on a
directory the run puts on sys.path; `run` runs pytest with the configuration pinned (-c the
task's ini, --rootdir), no plugin autoloading, only the task's `plugins` and ours, which is
registered before any conftest.py or test module (and so before any code under test) is
imported. It records every phase of each listed test from pytest's CallInfo, and checks that
what runs and reports tests is still what it was before the code under test was imported.

The verdict (TestsGrade): 1.0 only when every listed test PASSED (XFAIL, XPASS, SKIPPED,
ERROR, MISSING never count), the report is there, untampered, and pytest's exit status is 0
and the same in the report and for the process.

What the runner cannot close, and a second run would not either: the code under test runs in
the test process, with that process's every power. A subprocess per listed test, with the
report written by a plugin loaded before the code under test, is no more independent: the
test's assertions run in the same process as the code they check, and anything that process
can write (its report, its exit status) that code can write too. What is closed: replacing
what runs and reports tests (pytest's runner, CallInfo, TestReport, the test function, the hook
implementations and pluggy's call path, the import system, builtins.__import__), tracing or
profiling, the garbage collector's object lists, registering plugins, and naming the verdict's
directory by any path (an audit hook, which cannot be removed, flags each); processes it starts
are ended before the report is written. What remains: code that edits the runner's own records
in memory without those (through frames, closures or ctypes), a thread of its own that
writes over the report in the instants between its writing and the process's exit, and a
test that its own result can satisfy without the fix (an object equal to everything). Those
take an attack on this runner by name, which held-out review should look for in transcripts.

`test_command` names a custom command, which cannot be trusted to produce our report: it is
used only with `log_parser: "swebench"` (SWE-bench's pytest log parser), where the log is read
only up to pytest's own final summary line, a listed test passes only as PASSED, and the
command's exit status must agree (0 iff every listed test passed). That mode is forgeable by
design (the code under test writes the log); the default is the report.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .safe_read import UnsafePath, read_regular
from .spec import SWEBENCH_COMMAND, TestsEvaluator

PATCH = "polar.patch"            # in the grading sandbox's TMPDIR (written by the node)
RUNNER = Path(__file__).with_name("pytest_verdict.py")
RUNNER_NAME = "polar-verdict.py"
CONFIG_NAME = "polar-grade.json"
STATE_DIR = "polar-state"
VERDICT_PREFIX = "polar-verdict-"
REPORT = "report.json"
DIFF_LIMIT = 10 << 20            # a larger diff is the policy's failure (0.0)
SIGPIPE_EXIT = 141               # git diff, its output cut at the limit
REPORT_LIMIT = 4 << 20
LOG_LIMIT = 16 << 20             # the swebench parser's log: its tail
DIFF_LOG = "diff"                # the diff's log (logs/diff.log): the diff itself

# exit codes of the scripts
NO_REPO, ADD_FAILED = 3, 4
DOES_NOT_APPLY, REFUSED, GRADER_BROKEN = 5, 6, 7

# Left out of the diff: the harnesses' own files, installs, caches (as the seed's harness does)
EXCLUDED = (".git", ".claude", ".codex", ".gemini", ".qwen", ".pi", ".mcp.json", ".polar", "node_modules",
            ".venv", "venv", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", ".ruff_cache", "trajectories")


class GradingUnavailable(RuntimeError):
    """The grader's own environment cannot grade (the swebench package missing, the image
    without python3 or pytest, the grading sandbox did not start): no one's score."""


def diff_limit(log_cap: int | None) -> int:
    """The largest diff graded: DIFF_LIMIT, or less where the sandbox keeps less of a run's
    output (limits.Limits.log: past it a log keeps its tail, which is no patch)."""
    return min(DIFF_LIMIT, log_cap - 1) if log_cap else DIFF_LIMIT


def diff_script(workdir: str, base: str | None, exclude: tuple[str, ...] = (), limit: int = DIFF_LIMIT,
                binary: bool = True) -> str:
    """Prints the session's diff of its workdir against `base` (its task's commit; None: its
    HEAD) to STDOUT, at most `limit` + 1 bytes (more: too large), and nothing else. Run in
    the session's evaluation sandbox (runtime.EvaluationSandbox: its workspace read-only, the
    image without the session's layer): the session's repository lends its objects alone;
    the index and the config (hooks, an fsmonitor, filters) are a fresh repository's, so the
    diff is git's, not a program of the session's. Exit NO_REPO: no git repository with that
    commit there; ADD_FAILED: git could not read the workspace; SIGPIPE_EXIT: cut at the
    limit. binary False: a judge's diff (binary files named, not encoded)."""
    specs = " ".join(shlex.quote(f":(exclude,glob)**/{p}") + " " + shlex.quote(f":(exclude,glob)**/{p}/**")
                     for p in (*EXCLUDED, *exclude))
    head = shlex.quote(base) if base else '"$(git --git-dir="$w/.git" rev-parse --verify -q "HEAD^{commit}")"'
    return (f"w={shlex.quote(workdir)}\n"
            f"cd \"$w\" 2>/dev/null && [ -d .git/objects ] || exit {NO_REPO}\n"
            "exec 2>/dev/null\n"
            "export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_TERMINAL_PROMPT=0\n"
            f"base={head}\n"
            f"[ -n \"$base\" ] || exit {NO_REPO}\n"
            "g=\"$TMPDIR/grade.git\"\n"
            "git init -q --bare \"$g\" || exit 2\n"
            "printf '%s\\n' \"$w/.git/objects\" > \"$g/objects/info/alternates\"\n"
            "export GIT_DIR=\"$g\" GIT_WORK_TREE=\"$w\" GIT_INDEX_FILE=\"$TMPDIR/grade.index\"\n"
            f"git read-tree \"$base\" || exit {NO_REPO}\n"
            f"git -c core.quotepath=off add -A -- . {specs} >/dev/null || exit {ADD_FAILED}\n"
            "exec 3>&1\n"
            # git diff's own exit status, through fd 4, past the pipe that caps its output
            f"st=$( {{ {{ git diff --cached {'--binary ' if binary else ''}--no-color --no-ext-diff --no-textconv "
            "\"$base\"; echo $? >&4; } | "
            f"head -c {limit + 1} >&3; }} 4>&1 )\n"
            "exit ${st:-1}\n")


def diff_failure(exit_code: int | None) -> str | None:
    """Why taking the diff failed where the session's workspace is the cause (its .git, its
    files); None where the grader's own sandbox failed (no shell, no git, bwrap's own)."""
    if exit_code == NO_REPO:
        return "the workspace is no longer a git repository with its commit (.git removed or broken)"
    if exit_code == ADD_FAILED:
        return "git could not read the workspace (a file it cannot read, or a broken .git)"
    if exit_code is not None and exit_code >= 128:   # git's fatal errors, a signal (a limit)
        return f"git diff failed in the workspace (exit {exit_code})"
    return None


def test_files(ev: TestsEvaluator) -> list[str]:
    """The files the tests are in (pytest's node ids: FILE::name)."""
    return sorted({t.split("::", 1)[0] for t in (*ev.fail_to_pass, *ev.pass_to_pass) if "::" in t})


@dataclass(frozen=True)
class GradingRun:
    """The files one grading run's TMPDIR holds, and its verdict's random name."""
    tmp: Path                    # the grading sandbox's TMPDIR (node-made; the same path inside)
    token: str

    @property
    def verdict_dir(self) -> str:
        return VERDICT_PREFIX + self.token

    @classmethod
    def make(cls, tmp: Path, ev: TestsEvaluator, workdir: str, patch: bytes, pidns: bool) -> "GradingRun":
        """Writes the patch, the runner and its config into tmp, and makes the verdict's
        directory: all before the sandbox runs anything."""
        run = cls(tmp=tmp, token=secrets.token_hex(16))
        (tmp / PATCH).write_bytes(patch)
        (tmp / RUNNER_NAME).write_bytes(RUNNER.read_bytes())
        (tmp / STATE_DIR).mkdir(mode=0o700)
        (tmp / run.verdict_dir).mkdir(mode=0o700)
        cfg = {"workdir": workdir, "tests": [*ev.fail_to_pass, *ev.pass_to_pass], "plugins": list(ev.plugins),
               "state": str(tmp / STATE_DIR), "report_dir": str(tmp / run.verdict_dir), "token": run.verdict_dir,
               "pidns": pidns}
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg))
        return run

    def identity(self) -> tuple[int, int]:
        st = os.lstat(self.tmp / self.verdict_dir)
        return st.st_dev, st.st_ino

    def started(self) -> bool:
        """Did the runner's `prepare` run (the sandbox started, the image has python3 and
        pytest)? The patch cannot write here, and no code of the session's ran before it."""
        try:
            read_regular(self.tmp, f"{STATE_DIR}/tree.json", limit=1)
            return True
        except UnsafePath:
            return False

    def refused(self) -> list[str]:
        try:
            data = read_regular(self.tmp, f"{STATE_DIR}/refused.json", limit=1 << 16).data
            why = json.loads(data)
            return [str(x) for x in why][:10] if isinstance(why, list) else []
        except (UnsafePath, ValueError):
            return []

    def report(self) -> bytes | None:
        try:
            rb = read_regular(self.tmp, f"{self.verdict_dir}/{REPORT}", limit=REPORT_LIMIT)
        except UnsafePath:
            return None
        return None if rb.truncated else rb.data


def read_log(logs: Path, name: str) -> bytes:
    """A run's log (logs/NAME.log, a file the node made): its last LOG_LIMIT bytes."""
    try:
        return read_regular(logs, f"{name}.log", LOG_LIMIT, tail=True).data
    except UnsafePath:
        return b""


def grade_script(ev: TestsEvaluator, workdir: str, tmp: Path) -> str:
    """In the fresh grading sandbox: the runner's prepare, the patch, its restore, then the
    tests (the runner's run; with log_parser swebench the task's test_command)."""
    runner = f"python3 -I {shlex.quote(str(tmp / RUNNER_NAME))}"
    cfg = shlex.quote(str(tmp / CONFIG_NAME))
    git = "git -c safe.directory='*' -c core.hooksPath=/dev/null"
    if ev.log_parser == "swebench":
        tests = " ".join(shlex.quote(t) for t in (*ev.fail_to_pass, *ev.pass_to_pass))
        command = ev.test_command or SWEBENCH_COMMAND
        last = f"exec /bin/sh -c {shlex.quote(command.replace('{tests}', tests))}\n"
    else:
        last = f"exec {runner} run {cfg}\n"
    return (f"cd {shlex.quote(workdir)} || exit {GRADER_BROKEN}\n"
            f"{runner} prepare {cfg} || exit {GRADER_BROKEN}\n"
            f"{git} apply --binary --whitespace=nowarn {shlex.quote(str(tmp / PATCH))} || "
            f"{{ echo 'polar: the diff does not apply to the task repository' >&2; exit {DOES_NOT_APPLY}; }}\n"
            f"{runner} restore {cfg} || exit {REFUSED}\n"
            f"{last}")


@dataclass
class TestsGrade:
    resolved: bool
    status: str                           # RESOLVED_FULL or RESOLVED_NO
    tests: dict[str, str] = field(default_factory=dict)   # each listed test: PASSED, FAILED, ... or MISSING
    reason: str | None = None             # why not resolved, when it is not
    report: dict = field(default_factory=dict)            # swebench's get_eval_tests_report (swebench mode)

    @property
    def reward(self) -> float:
        return 1.0 if self.resolved else 0.0

    def summary(self) -> str:
        bad = [f"{t} {s}" for t, s in self.tests.items() if s != "PASSED"]
        head = self.reason or f"{len(self.tests) - len(bad)} of {len(self.tests)} tests passed"
        return f"{self.status}: {head}" + (
            f"; not passed: {', '.join(bad[:10])}" + (" ..." if len(bad) > 10 else "") if bad else "")


def _listed(ev: TestsEvaluator) -> list[str]:
    return list(dict.fromkeys((*ev.fail_to_pass, *ev.pass_to_pass)))


def _not_resolved(ev: TestsEvaluator, reason: str, tests: dict[str, str] | None = None) -> TestsGrade:
    return TestsGrade(False, "RESOLVED_NO", tests or {t: "MISSING" for t in _listed(ev)}, reason)


def grade_report(raw: bytes | None, exit_code: int | None, ev: TestsEvaluator) -> TestsGrade:
    """The runner's report (read back by the node), with the process's exit status."""
    if raw is None:
        return _not_resolved(ev, f"the test run left no report: its process died or exited early (exit {exit_code})")
    try:
        rep = json.loads(raw)
        tests, status = rep["tests"], rep["exitstatus"]
        if not isinstance(tests, dict) or not isinstance(status, int):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return _not_resolved(ev, "the test run's report is not the runner's")
    listed = {t: str(tests.get(t, "MISSING")) for t in _listed(ev)}
    tampered = [str(x) for x in rep.get("tampered") or []]
    if tampered:
        return _not_resolved(ev, "the code under test tampered with the test run: " + "; ".join(tampered[:3]),
                             {t: "TAMPERED" for t in listed})
    if status != exit_code:
        return _not_resolved(ev, f"the test process exited {exit_code}, its report says pytest exited {status}",
                             listed)
    every = all(s == "PASSED" for s in listed.values())
    if every and status != 0:
        return _not_resolved(ev, f"pytest exited {status} though the listed tests passed", listed)
    return TestsGrade(every, "RESOLVED_FULL" if every else "RESOLVED_NO", listed)


# pytest's own final line: "==== 1 failed, 1 passed in 0.02s ====" (also "no tests ran in ...")
SUMMARY_LINE = re.compile(r"^=+ .*\bin [0-9.]+s\b.* =+$")
SHORT_SUMMARY = re.compile(r"^=+ short test summary info =+$")


def grade_log(log: str, exit_code: int | None, ev: TestsEvaluator) -> TestsGrade:
    """log_parser "swebench": the log of the task's test_command, read with SWE-bench's pytest
    log parser from pytest's last "short test summary info" to its final summary line only;
    every listed test must be PASSED, and the exit status 0 exactly then."""
    try:
        from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS
        from swebench.harness.grading import get_eval_tests_report, get_resolution_status
        from swebench.harness.log_parsers.python import parse_log_pytest
    except ImportError as e:
        raise GradingUnavailable(f"log_parser swebench grades with the swebench package, which is not installed "
                                 f"here ({e}): pip install 'polar-mitm[swe]'") from None
    lines = log.splitlines()
    end = max((i for i, ln in enumerate(lines) if SUMMARY_LINE.match(ln)), default=None)
    if end is None:
        return _not_resolved(ev, "the log has no pytest summary line")
    start = max((i for i, ln in enumerate(lines[:end]) if SHORT_SUMMARY.match(ln)), default=end)
    status_map = parse_log_pytest("\n".join(lines[start:end]), None)   # the pytest parser reads no test spec
    report = get_eval_tests_report(status_map, {FAIL_TO_PASS: list(ev.fail_to_pass),
                                                PASS_TO_PASS: list(ev.pass_to_pass)})
    tests = {t: status_map.get(t, "MISSING") for t in _listed(ev)}
    every = all(s == "PASSED" for s in tests.values())
    if every != (exit_code == 0):
        return TestsGrade(False, "RESOLVED_NO", tests, f"the test command exited {exit_code}, which its log's "
                          f"results contradict", report)
    resolved = every and get_resolution_status(report) == "RESOLVED_FULL"
    return TestsGrade(resolved, "RESOLVED_FULL" if resolved else "RESOLVED_NO", tests, None, report)
