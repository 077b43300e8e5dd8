"""Calls in flight to the backend, per session (polar_session_max_inflight).

A session that fires many calls at once (a harness's sub-agents do, and so can a policy that
learned to flood) would take the backend's batch from its siblings. At most `cap` of one
session's calls are at the backend at once; the others WAIT their turn, first come first
served, rather than fail: a harness sees a slower answer, not an error. Each session has its
own queue, so a sibling's calls never wait behind a flood.

A wait is bounded (the backend's timeout): past it the call fails. Whose failure that is
depends on the session's calls ahead of it: if one of them finished during the wait, the
backend was serving and the session kept it busy (`session_busy`, the policy's); if none did,
the backend is stuck (`timeout`, the backend's: released)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from polar_mitm.adapters.chat import AdapterError

from .backend_client import BackendTimeout

DEFAULT_MAX_INFLIGHT = 4


class SessionBusy(AdapterError):
    """The session's own calls held every one of its slots for the whole wait. The harness
    gets a 429 (it may retry later); the record says session_busy (the policy's)."""
    status, kind = 429, "session_busy"
    answer_kind = "rate_limit"      # the provider's error shape a harness knows


@dataclass
class _Queue:
    busy: int = 0                                                  # its calls at the backend
    waiting: deque[asyncio.Future[None]] = field(default_factory=deque)
    users: int = 0                                                 # at the backend or waiting
    finished: int = 0                                              # calls that left the backend


class SessionSlots:
    def __init__(self, cap: int = DEFAULT_MAX_INFLIGHT):
        self.cap = cap                      # 0: no cap
        self._queues: dict[str, _Queue] = {}
        self.peak_waiting = 0               # the most calls of one session that waited at once

    def in_flight(self, session_id: str) -> int:
        q = self._queues.get(session_id)
        return q.busy if q else 0

    @contextlib.asynccontextmanager
    async def slot(self, session_id: str, timeout: float) -> AsyncIterator[None]:
        """Holds one of the session's slots (waits for one, at most `timeout` seconds)."""
        cap = self.cap
        if cap <= 0:
            yield
            return
        q = self._queues.setdefault(session_id, _Queue())
        q.users += 1
        try:
            await self._acquire(q, cap, timeout)
            try:
                yield
            finally:
                q.finished += 1
                self._release(q)
        finally:
            q.users -= 1
            if q.users == 0 and self._queues.get(session_id) is q:
                del self._queues[session_id]

    async def _acquire(self, q: _Queue, cap: int, timeout: float) -> None:
        if q.busy < cap and not q.waiting:
            q.busy += 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        q.waiting.append(turn)
        self.peak_waiting = max(self.peak_waiting, len(q.waiting))
        finished = q.finished
        try:
            async with asyncio.timeout(timeout):
                await turn           # a call that leaves hands its slot over (busy unchanged)
        except BaseException as e:   # out of time, or the flow was cancelled
            if turn.done() and not turn.cancelled():
                self._release(q)     # handed over as it gave up: on to the next
            else:
                turn.cancel()
                with contextlib.suppress(ValueError):
                    q.waiting.remove(turn)
            if isinstance(e, TimeoutError):
                if q.finished > finished:
                    raise SessionBusy(f"this session had {cap} calls at the model backend for {timeout:g}s "
                                      f"(polar_session_max_inflight): this one waited its turn in vain") from None
                raise BackendTimeout(f"the model backend finished none of this session's calls within "
                                     f"{timeout:g}s while this one waited") from None
            raise

    @staticmethod
    def _release(q: _Queue) -> None:
        while q.waiting:
            turn = q.waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        q.busy -= 1
