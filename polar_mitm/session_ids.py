"""The session-id rule, in one place: TASK~SAMPLE names sample SAMPLE of TASK's GRPO group,
and a rollout retry of it is TASK~SAMPLE.rN (N >= 2: a new name, so that no two attempts
share calls). A task id never holds "~" or "/"; the loop names each iteration's copy of a
task TASK@RUN.I (held-out tasks TASK@RUN.I.eval). Pure string functions, imported by the
proxy's addons, the store and the rollout server and node alike."""

from __future__ import annotations

import re
from typing import Collection, NamedTuple

TASK_SEPARATOR = "~"
RETRY_MARK = ".r"
RUN_SEPARATOR = "@"
TASK_ID_MAX = 120
TASK_ID_RULE = f"1-{TASK_ID_MAX} characters of letters, digits and ._+=@:- (no '~')"
_TASK_ID = re.compile(r"^[A-Za-z0-9._+=@:-]{1,%d}$" % TASK_ID_MAX)   # no "~" (it separates TASK~i), no "/"


class SessionName(NamedTuple):
    task_id: str
    sample: int
    attempt: int          # 1: the first attempt (TASK~SAMPLE), N: TASK~SAMPLE.rN


def valid_task_id(task_id: object) -> bool:
    return isinstance(task_id, str) and bool(_TASK_ID.match(task_id))


def make(task_id: str, sample: int, attempt: int = 1) -> str:
    """TASK~SAMPLE, or TASK~SAMPLE.rN for attempt N >= 2."""
    base = f"{task_id}{TASK_SEPARATOR}{sample}"
    return base if attempt <= 1 else f"{base}{RETRY_MARK}{attempt}"


def parse(session_id: str) -> SessionName | None:
    """(task, sample, attempt) of TASK~SAMPLE[.rN]; None for any other id."""
    task, sep, tail = session_id.rpartition(TASK_SEPARATOR)
    if not sep or not task:
        return None
    sample, dot, attempt = tail.partition(RETRY_MARK)
    if not sample.isdigit() or (dot and not attempt.isdigit()):
        return None
    return SessionName(task, int(sample), int(attempt) if dot else 1)


def task_of(session_id: str) -> str | None:
    """TASK of TASK~SAMPLE (None for a session outside any group)."""
    task, sep, _ = session_id.rpartition(TASK_SEPARATOR)
    return task if sep and task else None


def sample_of(session_id: str) -> str:
    """SAMPLE of TASK~SAMPLE[.rN], as written ("" for an id outside any group)."""
    name = parse(session_id)
    return str(name.sample) if name else ""


def attempt_of(session_id: str) -> tuple[str, int]:
    """("TASK~SAMPLE", attempt) of TASK~SAMPLE[.rN]; any other id is its own first attempt."""
    head, dot, tail = session_id.rpartition(RETRY_MARK)
    if dot and tail.isdigit() and TASK_SEPARATOR in head:
        return head, int(tail)
    return session_id, 1


def latest_attempts(session_ids: Collection[str]) -> set[str]:
    """Of these sessions, each sample's latest attempt: when a retry (TASK~i.r2) and the
    attempt it replaced (TASK~i, rewarded before its node was declared lost) both have
    rewards, the latest counts, so a group never holds more rewarded sessions than samples."""
    latest: dict[str, int] = {}
    for sid in session_ids:
        sample, attempt = attempt_of(sid)
        latest[sample] = max(latest.get(sample, 0), attempt)
    return {sid for sid in session_ids if attempt_of(sid)[1] == latest[attempt_of(sid)[0]]}


def file_safe(session_id: str) -> str:
    """The id as part of a file name: no "/" (a path) nor "~" (a home directory to a shell)."""
    return session_id.replace("/", "_").replace(TASK_SEPARATOR, "-")


def run_task_id(task_id: str, run_id: str, iteration: int, held_out: bool = False) -> str:
    """The loop's copy of a task for one iteration of run RUN: TASK@RUN.I (TASK@RUN.I.eval)."""
    return f"{task_id}{RUN_SEPARATOR}{run_id}.{iteration}" + (".eval" if held_out else "")


def task_of_run(task_id: str) -> str:
    """TASK of TASK@RUN.I (a task id without a run is its own)."""
    return task_id.rsplit(RUN_SEPARATOR, 1)[0]


class RunTask(NamedTuple):
    task: str            # TASK
    run_id: str
    iteration: int
    held_out: bool


def parse_run_task(task_id: str) -> RunTask | None:
    """TASK@RUN.I (held out: TASK@RUN.I.eval) split, run_task_id's inverse; None for a task
    id that names no run."""
    task, sep, rest = task_id.rpartition(RUN_SEPARATOR)
    if not sep:
        return None
    held_out = rest.endswith(".eval")
    run_id, dot, it = rest.removesuffix(".eval").rpartition(".")
    if not dot or not run_id or not it.isdigit():
        return None
    return RunTask(task, run_id, int(it), held_out)
