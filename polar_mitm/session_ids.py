"""The session-id rule, in one place: TASK~SAMPLE names sample SAMPLE of TASK's GRPO group,
and a rollout retry of it is TASK~SAMPLE.rN. Pure string functions, imported by the proxy's
addons and by the store alike."""

from __future__ import annotations

TASK_SEPARATOR = "~"


def task_of(session_id: str) -> str | None:
    """TASK of TASK~SAMPLE (None for a session outside any group)."""
    task, sep, _ = session_id.rpartition(TASK_SEPARATOR)
    return task if sep and task else None


def attempt_of(session_id: str) -> tuple[str, int]:
    """("TASK~SAMPLE", attempt) of TASK~SAMPLE[.rN]; any other id is its own first attempt."""
    head, dot, tail = session_id.rpartition(".r")
    if dot and tail.isdigit() and TASK_SEPARATOR in head:
        return head, int(tail)
    return session_id, 1
