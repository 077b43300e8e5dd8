"""Which policy sampled each call, exactly: the gateway's side of a weight sync.

A call enters the gate before it reaches the backend and leaves it once answered; it is
tagged with the version in force when it entered. A sync (1) holds new calls (they wait, they
are not refused: a streaming client gets keepalives meanwhile), (2) lets the calls in flight
finish, (3) swaps the weights (vLLM reloads the checkpoint in place and resets its prefix
cache), (4) sets the new version, and (5) releases the held calls. So no call straddles a
sync, and the version is the gateway's own. An in-flight sync (the token route, where vLLM
labels every token itself) skips (2): vLLM pauses the calls in flight where they are, and new
calls are held only while the swap runs.

The backend can still change under the gateway (a restart puts vLLM back on the weights of its
command line). Whoever notices (weight_sync.VersionWatch) calls lost(): the version is then
unverified and every call records None ("unknown", never trained) until a sync or a re-sync
sets it again; a call in flight when it was lost records None too, and the epoch counts the
losses, so a node can tell whether any came during one of its sessions. Pure asyncio: no
mitmproxy here."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from .sync_report import SwapSeconds, SyncReport

# vLLM's weight label for policy version N (backend_client.weight_tag): "polar-vN"
TAG_PREFIX = "polar-v"


@dataclass
class Ticket:
    """A call's pass through the gate: the version that samples it, None where the gateway
    cannot vouch for it (read it once the call is answered: a loss during the call clears it)."""
    version: int | None
    epoch: int
    # no tag of the gateway's was on vLLM's weights when the call entered: a token the engine
    # labelled with vLLM's own "default" is the start version's (version_of_tag)
    untagged_is_start: bool = False


class PolicyGate:
    def __init__(self, version: int = 0, checkpoint: str | None = None):
        self.version = version
        self.checkpoint = checkpoint
        self.in_flight = 0
        self.held = 0
        self._open: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._syncing: asyncio.Lock | None = None
        self.asleep = False     # the backend sleeps (colocated with the trainer): calls are held
        self.verified = True    # the backend serves `version` as far as the gateway knows
        self.epoch = 0          # times the gateway lost track of what the backend serves
        self.losses = 0         # of those, the ones where it served something else for sure
        self.suspect = False    # lost only on a suspicion (its connection ended): not for sure yet
        # a tag of the gateway's is on vLLM's weights (set, or read back): from then on an
        # untagged token was sampled by weights nobody synced (a restarted vLLM)
        self.engine_tagged = False

    def _events(self) -> tuple[asyncio.Event, asyncio.Event, asyncio.Lock]:
        if self._open is None or self._idle is None or self._syncing is None:   # made on the loop that uses them
            self._open, self._idle, self._syncing = asyncio.Event(), asyncio.Event(), asyncio.Lock()
            self._open.set()
            self._idle.set()
        return self._open, self._idle, self._syncing

    def state(self) -> dict:
        holding = self._open is not None and not self._open.is_set()
        return {"version": self.version, "checkpoint": self.checkpoint, "holding": holding,
                "held": self.held, "in_flight": self.in_flight, "asleep": self.asleep,
                "verified": self.verified, "epoch": self.epoch, "losses": self.losses}

    def lost(self, sure: bool = True) -> bool:
        """The backend no longer serves what the gateway set (it restarted, someone else
        synced it), or may not (sure=False: its process may have died): calls record None
        until the next sync or vouch(). True the first time."""
        first = self.verified
        if first:
            self.verified = False
            self.epoch += 1
        if sure and (first or self.suspect):
            self.losses += 1
        self.suspect = not sure and (first or self.suspect)
        return first

    def vouch(self) -> None:
        """The backend is seen to serve `version` again (its tag read back): later calls
        record it. The epoch stays: calls that ran while it was lost keep None."""
        self.verified, self.suspect = True, False

    def version_of_tag(self, tag: str, ticket: Ticket) -> int | None:
        """The version of the weights vLLM's engine labelled `tag` (a token's, from its
        spans): polar-vN is N. vLLM's own label ("default": the weights of its command line)
        is the version the gateway starts with for a call that entered before the gateway
        tagged the engine (as /v1/chat/completions calls are vouched for from the start);
        after that it is a restarted vLLM: None, never trained."""
        if tag.startswith(TAG_PREFIX) and tag[len(TAG_PREFIX):].isdigit():
            return int(tag[len(TAG_PREFIX):])
        return ticket.version if ticket.untagged_is_start else None

    @asynccontextmanager
    async def call(self) -> AsyncIterator[Ticket]:
        """Around a call's trip to the backend; yields its ticket (the version that samples it)."""
        is_open, idle, _ = self._events()
        if not is_open.is_set():
            self.held += 1
            try:
                while not is_open.is_set():
                    await is_open.wait()
            finally:
                self.held -= 1
        # no await between the check and the count: a sync cannot begin in between
        self.in_flight += 1
        idle.clear()
        ticket = Ticket(self.version if self.verified else None, self.epoch, not self.engine_tagged)
        try:
            yield ticket
        finally:
            if self.epoch != ticket.epoch:      # lost while it ran: who served it is unknown
                ticket.version = None
            self.in_flight -= 1
            if not self.in_flight:
                idle.set()

    async def _while_held(self, work: Callable[[], Awaitable[Any]],
                          drain: bool = True) -> tuple[Any, int, int, float, float]:
        """Hold new calls, let those in flight finish (drain), run work; the gate opens again
        after it (or after its failure) unless the backend sleeps. One at a time. Returns
        (work's result, calls drained, calls held, drain seconds, work seconds)."""
        is_open, idle, syncing = self._events()
        async with syncing:
            t0 = time.monotonic()
            drained = self.in_flight if drain else 0
            is_open.clear()
            try:
                if drain:
                    await idle.wait()
                t1 = time.monotonic()
                held = self.held
                result = await work()
                return result, drained, held, t1 - t0, time.monotonic() - t1
            finally:
                if not self.asleep:
                    is_open.set()

    async def sleep(self, action: Callable[[], Awaitable[None]]) -> SyncReport:
        """Hold, drain, then put the backend to sleep; calls stay held until the next sync
        (which wakes it). If the action fails the gate opens again."""
        async def go() -> int:
            await action()
            self.asleep = True
            return self.held
        held, drained, _, drain_s, sleep_s = await self._while_held(go)
        return SyncReport(self.version, self.checkpoint, held, drained, drain_s, sleep_s, drain_s + sleep_s)

    async def sync(self, swap: Callable[[bool], Awaitable[SwapSeconds | None]], version: int,
                   checkpoint: str | None = None, inflight: bool = False) -> SyncReport:
        """Hold, drain, swap (waking the backend if it sleeps), set the version, release. If
        the swap fails the old version stays in force (and the error is raised), and a
        sleeping backend keeps the calls held. inflight: the engine pauses the calls in
        flight itself and labels each token (the token route): nothing is drained, and new
        calls wait only while the swap runs."""
        async def go() -> SwapSeconds | None:
            try:
                steps = await swap(self.asleep)
            except BaseException as e:
                if not getattr(e, "weights_untouched", False):
                    self.lost()      # half a swap (reloaded, not tagged): what serves is unknown
                raise
            self.version, self.checkpoint, self.asleep, self.verified = version, checkpoint, False, True
            self.engine_tagged = True
            self.suspect = False
            return steps
        inflight = inflight and not self.asleep       # a sleeping engine has nothing in flight
        steps, drained, held, drain_s, swap_s = await self._while_held(go, drain=not inflight)
        stall = swap_s
        if inflight and steps is not None and steps.pause_s is not None:   # pause sent .. resumed
            stall = sum(x or 0.0 for x in (steps.pause_s, steps.reload_s, steps.reset_s, steps.resume_s))
        return SyncReport(version, checkpoint, held, drained, drain_s, swap_s, drain_s + swap_s, steps,
                          "inflight" if inflight else "drain", round(stall, 4))
