"""A weight sync's figures, one type for both sides: the gateway builds a SyncReport
(policy_gate.py, its swap's SwapSeconds from backend_client.py) and answers it as JSON; the
loop reads each node's back through SyncReport.from_json and takes the slowest node's figures
(SyncFigures) for its columns. A step renamed on one side is then a type error on the other,
not a column that silently turns NULL. Plain dataclasses, no mitmproxy: the loop imports it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Literal, Mapping

SwapStep = Literal["wake", "prefetch", "pause", "reload", "reset", "resume"]


@dataclass
class SwapSeconds:
    """The swap's own split: seconds per step (None: the step did not run; a colocated sync
    wakes, an ordinary one does not)."""
    wake_s: float | None = None
    reload_s: float | None = None
    reset_s: float | None = None
    prefetch_s: float | None = None    # a pull's fetch into vLLM's workers, before the pause
    pause_s: float | None = None       # in flight: /pause?mode=keep answered
    resume_s: float | None = None

    def add(self, step: SwapStep, seconds: float) -> None:
        name = _STEP_FIELDS[step]
        setattr(self, name, (getattr(self, name) or 0.0) + seconds)


_STEP_FIELDS: dict[SwapStep, str] = {"wake": "wake_s", "reload": "reload_s", "reset": "reset_s",
                                     "prefetch": "prefetch_s", "pause": "pause_s", "resume": "resume_s"}


@dataclass
class SyncReport:
    """What one gateway did in a sync (or a sleep: no steps)."""
    version: int
    checkpoint: str | None
    held: int          # calls that arrived during the sync and waited for it
    drained: int       # calls in flight when it began, let finish first
    drain_s: float
    swap_s: float
    total_s: float
    steps: SwapSeconds | None = None
    mode: str = "drain"        # drain (hold, drain, swap) | inflight (pause, swap, resume)
    # seconds vLLM generated nothing for the sync: the pause (in flight), or the swap (drain;
    # while it drains, the engine runs the calls in flight only)
    stall_s: float | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: object) -> "SyncReport | None":
        """A gateway's answer as the loop gets it (a node's report's detail); None where the
        node did not sync (it served the target already: a string says so)."""
        if not isinstance(d, Mapping):
            return None
        known = {f.name for f in fields(cls)}
        steps = d.get("steps")
        return cls(**{k: v for k, v in d.items() if k in known and k != "steps"},
                   steps=SwapSeconds(**{k: v for k, v in steps.items() if k in _STEP_FIELDS.values()})
                   if isinstance(steps, Mapping) else None)


@dataclass(frozen=True)
class SyncFigures:
    """The loop's figures of one sync across nodes: each the slowest node's (the loop waits
    for it); None where no node gave it."""
    drain_s: float | None = None
    drained: int | None = None
    held: int | None = None
    wake_s: float | None = None
    reload_s: float | None = None
    reset_s: float | None = None
    stall_s: float | None = None
    mode: str | None = None


def slowest(reports: Iterable[SyncReport | None]) -> SyncFigures:
    got = [r for r in reports if r is not None]

    def top(values: Iterable[Any]) -> Any:
        numbers = [v for v in values if isinstance(v, (int, float))]
        return max(numbers) if numbers else None

    steps = [r.steps for r in got if r.steps is not None]
    return SyncFigures(drain_s=top(r.drain_s for r in got), drained=top(r.drained for r in got),
                       held=top(r.held for r in got), wake_s=top(s.wake_s for s in steps),
                       reload_s=top(s.reload_s for s in steps), reset_s=top(s.reset_s for s in steps),
                       stall_s=top(r.stall_s for r in got), mode=next((r.mode for r in got), None))
