"""TaskRequest: what a task is, checked once where it comes in (HTTP, Python, JSONL)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
from dataclasses import dataclass, field
from typing import Any

from .. import session_ids
from ..trainer_input import REWARD_COVERS
from . import mcp
from .image_fit import check_task
from .judge import parse_judge
from .limits import parse_limits
from .harnesses import DEFAULT as DEFAULT_HARNESS
from .harnesses import HARNESSES as _REGISTRY

HARNESSES = tuple(_REGISTRY)
ON_FAILURE = ("zero", "drop")


class TaskError(ValueError):
    """A TaskRequest that cannot run; the message says which field and why."""


class TaskExists(TaskError):
    """The same task (the same spec) is there already: a rerun resumes it (HTTP 409)."""


class TaskChanged(TaskError):
    """A task of that id is there already with another spec (HTTP 422): the stored one keeps
    its sessions and rewards, so a changed one needs a new task_id (or a new database)."""

    def __init__(self, task_id: str, changes: list[str]):
        self.task_id, self.changes = task_id, changes
        super().__init__(f"task {task_id} already exists with another spec ({'; '.join(changes)}); "
                         f"give the changed task a new task_id, or use a new database")


def _seconds(value, what: str, task_id: str) -> float:
    """A positive, finite number of seconds, or a TaskError that names the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TaskError(f"{task_id}: {what} must be a positive number of seconds, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class Workspace:
    """A directory copied per session, or a git repo checked out at a commit."""
    path: str | None = None
    git: str | None = None
    commit: str | None = None


@dataclass(frozen=True)
class Evaluator:
    """Run in a fresh sandbox that sees the finished workspace read-only (runtime.py,
    EvaluationSandbox): the reward is the float on its last output line, or 1.0/0.0 from its
    exit status when that line is not a number."""
    command: str
    timeout: float = 120.0
    # What else of the session's it reads, read-only: "~/PATH" in its HOME, or (in an image)
    # an absolute path of its root. Nothing else of the session's HOME, TMPDIR or layer.
    reads: tuple[str, ...] = ()


@dataclass(frozen=True)
class TestsEvaluator:
    """Graded by the task's tests, as SWE-bench grades: the session's diff of its workspace is
    applied to a fresh copy of the task's environment (the image again, eval_prepare, the
    workspace as the task gave it), where the fail_to_pass and pass_to_pass tests run. 1.0
    when every one passes, else 0.0; an empty diff scores 0. The verdict is the report our
    pytest runner writes (grading.py); log_parser "swebench" reads test_command's log instead."""
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...] = ()
    # log_parser "swebench" only: {tests}: the test names, shell-quoted; run in the workdir.
    # -rA: pytest's summary lines, which the log parser reads. None: SWEBENCH_COMMAND
    test_command: str | None = None
    log_parser: str = "report"
    timeout: float = 900.0
    exclude: tuple[str, ...] = ()       # more paths (globs) left out of the diff
    plugins: tuple[str, ...] = ()       # pytest plugins (module names) the run loads with -p; no other is
    kind: str = "tests"
    __test__ = False                    # not a test class, to pytest (tests import it)


# report: our runner's own (grading.py; "pytest", the former name, means it too); swebench:
# SWE-bench's pytest log parser over test_command's output, which the code under test can forge
LOG_PARSERS = ("report", "pytest", "swebench")
SWEBENCH_COMMAND = "python3 -m pytest -rA -p no:cacheprovider {tests}"


@dataclass(frozen=True)
class Action:
    """One step that makes a session's environment, run in INIT (prepare) or before grading
    (eval_prepare): a shell line run in the workdir, or a node path copied in."""
    run: str | None = None
    copy: str | None = None             # a file or directory on the node
    to: str | None = None               # where in the session (relative: to the workdir)
    timeout: float = 600.0


@dataclass(frozen=True)
class RuntimeSpec:
    """The environment image a task's sessions run in: its root filesystem (read-only, shared
    by sessions; each session writes to a layer of its own) under the node's sandbox."""
    image: str                          # an OCI layout, oci:/oci-archive:/docker-archive: path, or a registry name
    workdir: str | None = None          # the session's working directory (default: the image's, else /workspace)
    env: dict = field(default_factory=dict)
    prepare: tuple[Action, ...] = ()
    eval_prepare: tuple[Action, ...] = ()
    network: str = "proxy"              # proxy: the model proxy only, as every session; none: not even that
    engine: str = "bwrap"


NETWORKS = ("proxy", "none")
ENGINES = ("bwrap",)


@dataclass(frozen=True)
class TaskRequest:
    task_id: str
    instruction: str
    harness: str = DEFAULT_HARNESS
    workspace: Workspace = field(default_factory=Workspace)
    num_samples: int = 1
    timeout: float = 600.0              # seconds for one harness run
    evaluator: Evaluator | TestsEvaluator | None = None
    priority: int = 0                   # higher runs first
    callback_url: str | None = None
    metadata: dict = field(default_factory=dict)
    early_stop: int | None = None       # cancel the stragglers once this many sessions finished
    command: str | None = None          # the `command` harness: a shell line run in the workspace
    # A session whose harness exits non-zero (or whose evaluation fails): "zero" scores it 0,
    # so its group keeps its size and GRPO's baseline stays unbiased; "drop" leaves it out.
    on_failure: str = "zero"
    # Which calls the session's reward covers: "all", or "main" (its main loop: the calls to
    # the model it uses most; a router's or a title call's other model is left out).
    reward_covers: str = "all"
    runtime: RuntimeSpec | None = None  # an environment image (None: the node's own system, read-only)
    # Tools for the harness, in each CLI's own config (mcp.py): {"NAME": {"command", "args",
    # "env"} | {"url"}}, and skills {"NAME": "/dir/with/SKILL.md"}; kept as given, checked here
    mcp_servers: dict = field(default_factory=dict)
    skills: dict = field(default_factory=dict)
    # A judge's score on top of the evaluator's outcome (judge.py: reward = outcome +
    # weight * score / max_score, or score / max_score with no evaluator); kept as given
    judge: dict | None = None
    # The group trains only when at least this fraction of its samples ended with a reward of
    # their own (done and scored); below it the group is reported and left out.
    min_complete_fraction: float = 0.0
    # What each session may use (limits.py: memory, pids, cpus, nofile, disk, log), over the
    # node's own limits; its canonical values (bytes, counts), only those the task sets
    limits: dict = field(default_factory=dict)
    # The rollout server's own (ship_files, shipped_files.py): each local path the task names
    # -> the sha256 of its packed copy, which nodes fetch. Never part of what makes two specs
    # of a task differ (spec_changes), never given by a client.
    files: dict = field(default_factory=dict)

    def session_ids(self) -> list[str]:
        return [session_ids.make(self.task_id, i) for i in range(self.num_samples)]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if isinstance(self.evaluator, Evaluator) and not self.evaluator.reads:
            del d["evaluator"]["reads"]      # as a stored spec from before evaluator.reads reads
        if not self.files:
            del d["files"]                   # as a spec from before shipped files (and a client's)
        return d


def parse_task(data: Any, *, harness: str | None = None, samples: int | None = None,
               stored: bool = False) -> TaskRequest:
    """A TaskRequest from JSON-shaped data; harness/samples fill in what a task leaves out.
    stored: a spec read back from a database (task_from_json), which may predate the checks
    for an empty command or evaluator: it is read as it was accepted then.
    The fields are checked in a fixed order, so a task with several mistakes always reports
    the same one first."""
    d = _task_fields(data, harness, samples)
    task_id, instruction = _task_id_and_instruction(d)
    h, command = _harness_and_command(d, task_id, stored)
    n = _num_samples(d.get("num_samples", 1), task_id)
    timeout = _seconds(d.get("timeout", 600.0), "timeout", task_id)
    workspace = _workspace(d.get("workspace") or {}, task_id)
    evaluator = _evaluator(d.get("evaluator"), task_id, stored)
    early = _early_stop(d.get("early_stop"), n, task_id)
    priority = _priority(d.get("priority", 0), task_id)
    url = _callback_url(d.get("callback_url"), task_id)
    meta = _metadata(d.get("metadata") or {}, task_id)
    on_failure = _one_of(d.get("on_failure", "zero"), ON_FAILURE, "on_failure", task_id)
    covers = _one_of(d.get("reward_covers", "all"), REWARD_COVERS, "reward_covers", task_id)
    runtime = _runtime(d["runtime"], task_id) if d.get("runtime") is not None else None
    if runtime is not None and runtime.network == "none" and h != "command" and not stored:
        raise TaskError(f"{task_id}: runtime.network \"none\" leaves a session no route, not even to the model, "
                        f"which the {h} harness calls: use harness \"command\", or network \"proxy\"")
    # the tests are run in a fresh copy of the task's repository, so there has to be one
    if isinstance(evaluator, TestsEvaluator) and not (runtime or workspace.path or workspace.git):
        raise TaskError(f"{task_id}: the tests evaluator needs the task's repository: a workspace, or a runtime "
                        "image that holds it")
    if isinstance(evaluator, Evaluator) and runtime is None and any(r.startswith("/") for r in evaluator.reads):
        raise TaskError(f"{task_id}: evaluator.reads names absolute paths, which only a task with a runtime image "
                        "has (without one, name paths in the session's HOME: \"~/PATH\")")
    fraction = _fraction(d.get("min_complete_fraction", 0.0), task_id)
    servers, skills = _tools(d, h, task_id)
    judge = _judge(d.get("judge"), task_id)
    limits = _limits(d.get("limits"), task_id)
    files = _files(d.get("files"), task_id, stored)
    return TaskRequest(task_id=task_id, instruction=instruction, harness=h,
                       workspace=workspace, num_samples=n, timeout=timeout,
                       evaluator=evaluator, priority=priority, callback_url=url, metadata=meta,
                       early_stop=early, command=command, on_failure=on_failure,
                       reward_covers=covers, runtime=runtime, min_complete_fraction=float(fraction),
                       mcp_servers=servers, skills=skills, judge=judge, limits=limits, files=files)


def _task_fields(data: Any, harness: str | None, samples: int | None) -> dict:
    """The task's fields, none unknown, with the caller's harness/samples where it has none."""
    if not isinstance(data, dict):
        raise TaskError("a task must be a JSON object")
    known = {f.name for f in dataclasses.fields(TaskRequest)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise TaskError(f"unknown task field(s): {', '.join(unknown)}")
    d = dict(data)      # a copy: the caller's data is left as it was
    if harness and "harness" not in d:
        d["harness"] = harness
    if samples and "num_samples" not in d:
        d["num_samples"] = samples
    return d


def _task_id_and_instruction(d: dict) -> tuple[str, str]:
    task_id, instruction = d.get("task_id"), d.get("instruction")
    if not isinstance(task_id, str) or not session_ids.valid_task_id(task_id):
        raise TaskError(f"task_id must be {session_ids.TASK_ID_RULE}")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskError(f"{task_id}: instruction must be a non-empty string")
    return task_id, instruction


def _harness_and_command(d: dict, task_id: str, stored: bool) -> tuple[str, str | None]:
    """The harness, and the shell line the command harness runs (None for the others)."""
    h = d.get("harness", DEFAULT_HARNESS)
    if h not in HARNESSES:
        raise TaskError(f"{task_id}: harness must be one of {', '.join(HARNESSES)}, not {h!r}")
    if h == "command" and not isinstance(d.get("command"), str):
        raise TaskError(f"{task_id}: the command harness needs a 'command' (a shell line)")
    command = d.get("command")
    # a stored spec may predate the empty-command check: it is read as it was accepted
    if command is not None and not stored and (not isinstance(command, str) or not command.strip()):
        raise TaskError(f"{task_id}: command must be a non-empty shell line, not {command!r}")
    return h, command


def _num_samples(n: Any, task_id: str) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
        raise TaskError(f"{task_id}: num_samples must be an integer from 1 to 1024")
    return n


def _workspace(ws: Any, task_id: str) -> Workspace:
    """A path (a directory copied per session), or a git repo and, optionally, its commit."""
    if isinstance(ws, str):
        ws = {"path": ws}
    if not isinstance(ws, dict) or set(ws) - {"path", "git", "commit"}:
        raise TaskError(f"{task_id}: workspace must be a path, or an object with path, or git and commit")
    if ws.get("path") and ws.get("git"):
        raise TaskError(f"{task_id}: workspace takes a path or a git repo, not both")
    if ws.get("commit") and not ws.get("git"):
        raise TaskError(f"{task_id}: workspace.commit needs workspace.git")
    return Workspace(**ws)


def _evaluator(ev: Any, task_id: str, stored: bool) -> Evaluator | TestsEvaluator | None:
    """A shell line (or {command, timeout}), or the tests evaluator ({kind: tests, ...})."""
    if isinstance(ev, str):
        ev = {"command": ev}
    if isinstance(ev, dict) and ev.get("kind") == "tests":
        return _tests_evaluator(ev, task_id)
    if ev is None:
        return None
    if not isinstance(ev, dict) or not isinstance(ev.get("command"), str) or set(ev) - {"command", "timeout", "reads"}:
        raise TaskError(f"{task_id}: evaluator must be a shell line, or an object with command, timeout and reads")
    if not ev["command"].strip() and not stored:   # "" would exit 0: every session scored 1.0
        raise TaskError(f"{task_id}: evaluator must be a non-empty shell line, not {ev['command']!r} "
                        "(a task without an evaluator gives no reward)")
    return Evaluator(command=ev["command"],
                     timeout=_seconds(ev.get("timeout", 120.0), "evaluator.timeout", task_id),
                     reads=_reads(ev.get("reads", []), task_id))


MAX_READS = 32


def _reads(value: Any, task_id: str) -> tuple[str, ...]:
    """evaluator.reads: "~/PATH" (in the session's HOME) or an absolute path (of an image's
    root), each normalized: no "..", not the root itself."""
    reads = _strings(value, "evaluator.reads", task_id)
    if len(reads) > MAX_READS:
        raise TaskError(f"{task_id}: evaluator.reads names {len(reads)} paths, more than {MAX_READS}")
    out = []
    for r in reads:
        home = r.startswith("~/")
        path = r[2:] if home else r
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if not (home or r.startswith("/")) or not parts or ".." in parts or "\0" in r:
            raise TaskError(f"{task_id}: evaluator.reads entries are \"~/PATH\" (in the session's HOME) or an "
                            f"absolute path in its image, below the root and without \"..\", not {r!r}")
        out.append(("~/" if home else "/") + "/".join(parts))
    return tuple(dict.fromkeys(out))


def _early_stop(early: Any, n: int, task_id: str) -> int | None:
    if early is not None and (not isinstance(early, int) or not 1 <= early <= n):
        raise TaskError(f"{task_id}: early_stop must be an integer from 1 to num_samples")
    return early


def _priority(priority: Any, task_id: str) -> int:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TaskError(f"{task_id}: priority must be an integer")
    return priority


def _callback_url(url: Any, task_id: str) -> str | None:
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise TaskError(f"{task_id}: callback_url must be an http(s) URL")
    return url


def _metadata(meta: Any, task_id: str) -> dict:
    if not isinstance(meta, dict):
        raise TaskError(f"{task_id}: metadata must be an object")
    return meta


def _one_of(value: Any, choices: tuple[str, ...], what: str, task_id: str) -> str:
    if value not in choices:
        raise TaskError(f"{task_id}: {what} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _fraction(fraction: Any, task_id: str) -> int | float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise TaskError(f"{task_id}: min_complete_fraction must be a number from 0 to 1, not {fraction!r}")
    return fraction


def _tools(d: dict, harness: str, task_id: str) -> tuple[dict, dict]:
    """The task's MCP servers and skills, each as its JSON; only a harness whose CLI has a
    config for them takes them."""
    try:
        servers = mcp.servers_json(mcp.parse_mcp_servers(d.get("mcp_servers") or None))
        skills = mcp.skills_json(mcp.parse_skills(d.get("skills") or None))
    except ValueError as e:
        raise TaskError(f"{task_id}: {e}") from None
    if servers and harness not in mcp.MCP_FILES:
        raise TaskError(f"{task_id}: the {harness} harness takes no MCP servers "
                        f"(these do: {', '.join(sorted(mcp.MCP_FILES))})")
    if skills and harness not in mcp.SKILL_DIRS:
        raise TaskError(f"{task_id}: the {harness} harness takes no skills "
                        f"(these do: {', '.join(sorted(mcp.SKILL_DIRS))})")
    return servers, skills


def _judge(judge: Any, task_id: str) -> dict | None:
    """The judge as given (checked by judge.parse_judge), a bare rubric as {rubric}."""
    if judge is None:
        return None
    try:
        parse_judge(judge)
    except ValueError as e:
        raise TaskError(f"{task_id}: {e}") from None
    return {"rubric": judge} if isinstance(judge, str) else dict(judge)


def _limits(value: Any, task_id: str) -> dict:
    try:
        return parse_limits(value)
    except ValueError as e:
        raise TaskError(f"{task_id}: {e}") from None


def _files(value: Any, task_id: str, stored: bool) -> dict:
    """The server's map of shipped paths to blobs (a stored spec's); a client gives none."""
    if not value:
        return {}
    if not stored:
        raise TaskError(f"{task_id}: files is the rollout server's own (ship_files packs the task's paths), "
                        "not a task's field")
    if not isinstance(value, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and len(v) == 64
                                              and all(c in "0123456789abcdef" for c in v) for k, v in value.items()):
        raise TaskError(f"{task_id}: files must map paths to sha256 hex digests")
    return dict(value)


def _strings(value, what: str, task_id: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) and x.strip() for x in value):
        raise TaskError(f"{task_id}: {what} must be a list of non-empty strings, not {value!r}"[:300])
    return tuple(value)


def _tests_evaluator(ev: dict, task_id: str) -> TestsEvaluator:
    fields = {f.name for f in dataclasses.fields(TestsEvaluator)}
    if set(ev) - fields:
        raise TaskError(f"{task_id}: unknown tests evaluator field(s): {', '.join(sorted(set(ev) - fields))}")
    f2p = _strings(ev.get("fail_to_pass"), "evaluator.fail_to_pass", task_id)
    if not f2p:   # nothing that must turn green: every diff would pass
        raise TaskError(f"{task_id}: evaluator.fail_to_pass must name at least one test")
    p2p = _strings(ev.get("pass_to_pass", []), "evaluator.pass_to_pass", task_id)
    parser = ev.get("log_parser") or "report"
    if parser not in LOG_PARSERS:
        raise TaskError(f"{task_id}: evaluator.log_parser must be one of {', '.join(LOG_PARSERS)}, not {parser!r}")
    parser = "report" if parser == "pytest" else parser
    cmd = ev.get("test_command")
    if cmd is not None and parser != "swebench":
        # a command of the task's own cannot write the runner's report: only the log parser reads it
        raise TaskError(f"{task_id}: evaluator.test_command is only used with log_parser \"swebench\" (which "
                        f"trusts the command's log); the default runs the tests with the grader's own runner")
    if parser == "swebench":
        cmd = SWEBENCH_COMMAND if cmd is None else cmd
        if not isinstance(cmd, str) or "{tests}" not in cmd:
            raise TaskError(f"{task_id}: evaluator.test_command must be a shell line with {{tests}} where the test "
                            f"names go, not {cmd!r}")
    plugins = _strings(ev.get("plugins", []), "evaluator.plugins", task_id)
    bad = [p for p in plugins if not all(part.isidentifier() for part in p.split("."))]
    if bad:
        raise TaskError(f"{task_id}: evaluator.plugins must be module names (pytest -p NAME), not {bad[0]!r}")
    return TestsEvaluator(fail_to_pass=f2p, pass_to_pass=p2p, test_command=cmd, log_parser=parser,
                          timeout=_seconds(ev.get("timeout", 900.0), "evaluator.timeout", task_id),
                          exclude=_strings(ev.get("exclude", []), "evaluator.exclude", task_id), plugins=plugins)


def _actions(value, what: str, task_id: str) -> tuple[Action, ...]:
    if not isinstance(value, (list, tuple)):
        raise TaskError(f"{task_id}: runtime.{what} must be a list of actions")
    out = []
    for i, a in enumerate(value):
        if isinstance(a, str):
            a = {"run": a}
        where = f"{task_id}: runtime.{what}[{i}]"
        if not isinstance(a, dict) or set(a) - {"run", "copy", "to", "timeout"}:
            raise TaskError(f"{where} must be a shell line, or an object with run, or copy and to (and timeout)")
        if bool(a.get("run")) == bool(a.get("copy")):
            raise TaskError(f"{where} takes run (a shell line) or copy (a node path), one of them")
        if a.get("run") is not None and (not isinstance(a["run"], str) or not a["run"].strip()):
            raise TaskError(f"{where}: run must be a non-empty shell line")
        if a.get("copy") is not None:
            if not isinstance(a["copy"], str) or not os.path.isabs(a["copy"]):
                raise TaskError(f"{where}: copy must be an absolute path on the node")
            if not isinstance(a.get("to"), str) or not a["to"].strip():
                raise TaskError(f"{where}: copy needs to (where in the session)")
        elif a.get("to") is not None:
            raise TaskError(f"{where}: to goes with copy")
        out.append(Action(run=a.get("run"), copy=a.get("copy"), to=a.get("to"),
                          timeout=_seconds(a.get("timeout", 600.0), f"runtime.{what}[{i}].timeout", task_id)))
    return tuple(out)


def _runtime(rt, task_id: str) -> RuntimeSpec:
    if isinstance(rt, str):
        rt = {"image": rt}
    fields = {f.name for f in dataclasses.fields(RuntimeSpec)}
    if not isinstance(rt, dict) or set(rt) - fields:
        extra = sorted(set(rt) - fields) if isinstance(rt, dict) else []
        raise TaskError(f"{task_id}: runtime must be an image reference, or an object with "
                        f"{', '.join(sorted(fields))}" + (f" (unknown: {', '.join(extra)})" if extra else ""))
    image = rt.get("image")
    if not isinstance(image, str) or not image.strip():
        raise TaskError(f"{task_id}: runtime.image must name an image (an OCI layout or archive, or a registry name)")
    workdir = rt.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not os.path.isabs(workdir)
                                or ".." in workdir.split("/") or workdir == "/"):
        raise TaskError(f"{task_id}: runtime.workdir must be an absolute path in the image (not /), "
                        f"not {workdir!r}")
    env = rt.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                                            for k, v in env.items()):
        raise TaskError(f"{task_id}: runtime.env must map variable names to strings")
    network = rt.get("network", "proxy")
    if network not in NETWORKS:
        raise TaskError(f"{task_id}: runtime.network must be one of {', '.join(NETWORKS)}, not {network!r} "
                        "(proxy: the model proxy and nothing else; none: loopback alone, the command harness only)")
    engine = rt.get("engine", "bwrap")
    if engine not in ENGINES:
        raise TaskError(f"{task_id}: runtime.engine must be one of {', '.join(ENGINES)}, not {engine!r} "
                        "(Docker and Podman do not run containers on these machines)")
    return RuntimeSpec(image=image.strip(), workdir=workdir, env=dict(env),
                       prepare=_actions(rt.get("prepare", []), "prepare", task_id),
                       eval_prepare=_actions(rt.get("eval_prepare", []), "eval_prepare", task_id),
                       network=network, engine=engine)


def task_from_json(spec: dict) -> TaskRequest:
    """Back from TaskRequest.to_json (the stored spec)."""
    return parse_task({k: v for k, v in spec.items() if v is not None}, stored=True)


def spec_changes(old: TaskRequest, new: TaskRequest) -> list[str]:
    """What differs between two specs of one task, field by field ("num_samples 1 -> 3").
    files is left out: the server fills it (a resubmitted task comes without it)."""
    a, b = old.to_json(), new.to_json()
    out = []
    for k in a:
        if k == "files":
            continue
        if a[k] != b[k]:
            va, vb = repr(a[k]), repr(b[k])
            out.append(f"{k} {va[:60]} -> {vb[:60]}" if len(va) + len(vb) < 200 else f"{k} changed")
    return out


def _remote(git: str) -> bool:
    """A URL (https://, ssh://, host:path) rather than a repository on this machine."""
    if "://" in git:
        return not git.startswith("file://")
    head = git.split("/", 1)[0]
    return ":" in head          # scp-like user@host:path


def _git(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    except (OSError, subprocess.SubprocessError):
        return None


def check_workspace(task: TaskRequest) -> None:
    """The task's workspace is there (checked where tasks come in, before any session): a
    directory, or a git repository that has the commit. A remote repository is asked for its
    refs only (its commits cannot be listed); a TaskError names the task and the path. A
    harness its image cannot run is refused here too, where the image is unpacked on this
    machine (image_fit.check_task)."""
    ws, tid = task.workspace, task.task_id
    unfit = check_task(task)
    if unfit:
        raise TaskError(f"{tid}: {unfit}")
    if ws.path:
        if not os.path.isdir(ws.path):
            why = "does not exist" if not os.path.exists(ws.path) else "is not a directory"
            raise TaskError(f"{tid}: workspace {ws.path} {why}")
        if not os.access(ws.path, os.R_OK | os.X_OK):
            raise TaskError(f"{tid}: workspace {ws.path} is not readable")
    if not ws.git:
        return
    local = not _remote(ws.git)
    path = ws.git.removeprefix("file://")
    if local and not os.path.isdir(path):
        raise TaskError(f"{tid}: workspace.git {ws.git} does not exist")
    # what `git clone` will ask: a repository there (not a directory inside one)
    done = _git(["git", "ls-remote", "--heads", ws.git])
    if done is None or done.returncode != 0:
        if local:
            raise TaskError(f"{tid}: workspace.git {ws.git} is not a git repository")
        err = done.stderr.strip().splitlines()[0][:300] if done is not None and done.stderr.strip() else "no answer"
        raise TaskError(f"{tid}: workspace.git {ws.git} cannot be read: {err}")
    if local and ws.commit:
        done = _git(["git", "-C", path, "rev-parse", "--verify", "--quiet", f"{ws.commit}^{{commit}}"])
        if done is None or done.returncode != 0:
            raise TaskError(f"{tid}: workspace.commit {ws.commit} is not a commit of {ws.git}")


MAX_REWARD = 1e6   # an evaluator's reward beyond +-this is a failed evaluation


def parse_reward(output: str, exit_code: int | None) -> float:
    """The evaluator's reward: the float on its last non-empty line, else 1.0/0.0 by exit
    status. nan, inf, or a magnitude past MAX_REWARD there is a failed evaluation
    (TaskError), never a reward."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    if lines:
        try:
            value = float(lines[-1])
        except ValueError:
            value = None
        if value is not None:
            if value != value or abs(value) == float("inf"):
                raise TaskError(f"the evaluator's reward is {lines[-1][:40]!r}, not a finite number")
            if abs(value) > MAX_REWARD:
                raise TaskError(f"the evaluator's reward is {lines[-1][:40]!r}, beyond +-{MAX_REWARD:g} "
                                "(print a score, such as 0 to 1)")
            return value
    return 1.0 if exit_code == 0 else 0.0
