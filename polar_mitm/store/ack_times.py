"""When this process acknowledged its calls: the total_ms of each, from the call's start to
its durable append, which the loader stores with the call's row."""

from __future__ import annotations

import threading
from typing import Iterable


class AckTimes:
    """The total_ms of calls this process acknowledged, by call_id: the proxy's log thread
    stamps them at the durable append, its loader thread takes them as it loads their lines
    (and gives back what a failed load took). Two threads, so every access holds the lock."""

    LIMIT = 100_000   # a bound: stamps never taken (their lines loaded elsewhere) do not pile up

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms: dict[str, float] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._ms)

    def stamp(self, stamps: Iterable[tuple[str, float]]) -> None:
        with self._lock:
            if len(self._ms) > self.LIMIT:
                self._ms.clear()
            self._ms.update(stamps)

    def take(self, call_id: str | None) -> float | None:
        if call_id is None:
            return None
        with self._lock:
            return self._ms.pop(call_id, None)

    def give_back(self, taken: dict[str, float] | None) -> None:
        if taken:
            with self._lock:
                self._ms.update(taken)   # the retry stamps them again
