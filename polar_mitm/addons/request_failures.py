"""Whose failure is a call that the backend answered with an error: the request's (the
policy's) or the backend's.

A node releases a session whose calls failed because of the backend (it runs again, unscored):
the backend's failures are not the policy's. But a policy that can make the backend fail (a
prompt that crashes vLLM's tool parser, a request it answers 500) would then have its bad
samples taken out of its group. So a call that the backend ANSWERED with an error (a 4xx or
5xx other than 429 and 503, or a 200 that is no completion) is the request's failure,
`request_failed`, scored like any of the policy's failures, when the backend was healthy at
that moment:

- a health probe right after the failure (/health, else /v1/models where there is none; a
  short timeout) finds it answering, and
- another call succeeded at the backend from the failed call's start until `window` seconds
  after its failure (on this gateway; any session's: a call of the same session counts too).
  With none yet, the verdict waits for one, up to the window's end, as long as other calls
  are at the backend (each of them either succeeds or fails too).

Anything else stays the backend's (error_kind backend_error: released): a probe that fails,
or no call served around it (a backend that fails every request looks the same from one
call; so does a failure with nothing else at the backend then, which nothing vouches for). Connection errors, timeouts, 503 and 429 are never candidates: the backend said it
could not serve. What the probe saw and how many calls succeeded go into the call's error
text, for SQL (`error LIKE '%backend probe:%'`).

Probes are shared: failures in one burst wait on the same probe."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Awaitable, Callable, NamedTuple

REQUEST_FAILED = "request_failed"   # call_records.error_kind of a call whose request the backend failed
PROBE_TIMEOUT_S = 3.0
DEFAULT_WINDOW_S = 30.0
MAX_REMEMBERED = 4096               # successes kept (a window's worth on any real gateway)

Probe = Callable[[float], Awaitable[tuple[bool, str]]]   # timeout -> (healthy, what it saw)


class Verdict(NamedTuple):
    request_failed: bool     # True: the policy's failure; False: the backend's
    note: str                # what the probe saw and which calls succeeded, for the record


class BackendWitness:
    """The times calls succeeded at the backend (served()), and the verdict on a failure."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, probe_timeout: float = PROBE_TIMEOUT_S):
        self.window_s, self.probe_timeout = window_s, probe_timeout
        self._successes: deque[float] = deque(maxlen=MAX_REMEMBERED)   # monotonic times, in order
        self.at_backend = 0      # calls sent and not answered yet
        self._waiters: list[asyncio.Future[None]] = []
        self._probe: asyncio.Task[tuple[bool, str]] | None = None
        self._probe_started = 0.0
        self.probes = 0          # probes made (the tests count them)

    def sent(self) -> None:
        """A call went to the backend."""
        self.at_backend += 1

    def returned(self, ok: bool) -> None:
        """A call sent came back: ok, it succeeded at the backend now."""
        self.at_backend -= 1
        if ok:
            self._successes.append(time.monotonic())
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def successes_since(self, since: float) -> int:
        n = 0
        for t in reversed(self._successes):
            if t < since:
                break
            n += 1
        return n

    async def judge(self, probe: Probe, started: float, failed: float) -> Verdict:
        """The verdict on a call sent at `started` that failed at `failed` (monotonic)."""
        healthy, seen = await self._probed(probe, failed)
        if not healthy:
            return Verdict(False, f"backend probe: {seen}: the backend's failure")
        deadline = failed + self.window_s
        n = self.successes_since(started)
        while n == 0 and self.at_backend > 0 and (left := deadline - time.monotonic()) > 0:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                break
            n = self.successes_since(started)
        if n:
            return Verdict(True, f"backend probe: {seen}; {n} other call(s) succeeded at the backend since this "
                                 f"one started: the request's failure ({REQUEST_FAILED})")
        return Verdict(False, f"backend probe: {seen}; no other call succeeded at the backend since this one "
                              f"started (window {self.window_s:g}s): the backend's failure")

    async def _probed(self, probe: Probe, failed: float) -> tuple[bool, str]:
        """A probe whose answer comes after the failure: one in flight is shared, and one done
        serves only the failures before it started."""
        task = self._probe
        if task is None or (task.done() and self._probe_started < failed):
            self.probes += 1
            self._probe_started = time.monotonic()
            task = self._probe = asyncio.ensure_future(self._run(probe))
        return await asyncio.shield(task)

    async def _run(self, probe: Probe) -> tuple[bool, str]:
        t0 = time.monotonic()
        try:
            healthy, seen = await asyncio.wait_for(probe(self.probe_timeout), self.probe_timeout + 1.0)
        except TimeoutError:
            return False, f"no answer within {self.probe_timeout:g}s"
        except Exception as e:   # the probe's own errors are answers too: not healthy
            return False, f"{type(e).__name__}: {e}"[:300]
        return healthy, f"{seen} in {(time.monotonic() - t0) * 1000:.0f} ms"
