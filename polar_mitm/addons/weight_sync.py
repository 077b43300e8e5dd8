"""Weight syncs through the gateway, as an addon: `POST /_polar/sync` with the control
token (control.py; none: no syncs) and `{"checkpoint": DIR, "version": N}` (or a `pull` of
the trainer's weights over HTTP) swaps vLLM's weights and tags them polar-vN. In flight
(polar_sync_mode, where calls take the token route: backend_client.py): vLLM pauses its
requests where they are, loads, tags and resumes, and each token records the version that
sampled it. In drain mode: new calls are held, those in flight finish, vLLM reloads and resets
its prefix cache, the held calls go (policy_gate.py). Versions start at polar_policy_version. `POST /_polar/sleep {"level": 1|2}` (one GPU shared with the trainer)
holds and drains the same way, then puts vLLM to sleep; calls stay held until the next sync
wakes it.

The version watch: vLLM can change under the gateway (restarted: back on its command line's
weights). Every polar_version_check seconds, off the calls' path, the gateway reads vLLM's
tag (/weight_info) over a connection of its own that it keeps open; so does every sync
before it swaps, and `POST /_polar/verify` (a node, when a session ends). A tag that is not
the one the gateway set means the gateway lost track: calls record version None (never
trained) and the epoch goes up (a node releases the sessions that ran across it); where the
gateway knows the checkpoint of its version it reloads it at once (a re-sync: held, drained,
reloaded, tagged) and vouches again.

The kept connection is what makes a restart exact rather than seen up to a poll late: a
server process takes its connections with it, so the watch sees the end of that one the
moment the old process dies, before a new one can answer any call; calls in flight then, and
after, record None until the tag is read back. (A close for another reason costs those calls
their version too, and the next check vouches again: the tag is still the gateway's.)"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from mitmproxy import ctx, http

from polar_mitm.adapters.chat import AdapterError
from polar_mitm.adapters.detect import split_path

from . import option_values
from .backend_client import BackendClient, NoWeightInfo, WeightSource, untagged, weight_tag
from .backend_http import BackendHTTP
from .control import Control
from .http_json import JSON_HEADERS
from .policy_gate import PolicyGate
from .sync_report import SwapSeconds

log = logging.getLogger("polar")

SYNC_PATH = "/_polar/sync"
SYNC_MODES = ("auto", "inflight", "drain")
OWNERS = ("gateway", "external")
SLEEP_PATH = "/_polar/sleep"
VERIFY_PATH = "/_polar/verify"


class VersionWatch:
    """Whether vLLM still serves what the gateway set: its tag read back, off the calls' path."""

    def __init__(self, backend_client: BackendClient, gate: PolicyGate):
        self.backend, self.gate = backend_client, gate
        self.state = "unchecked"       # ok | lost | unavailable (no /weight_info) | error
        self.error: str | None = None
        self.checked_at: float | None = None     # wall clock of the last check that read a tag
        self.checks = self.resyncs = 0
        # The tag the gateway set (a sync, or at start where it knows what vLLM serves); None:
        # it set none yet, and the first tag read is taken as what serves its version.
        self.expected: str | None = None
        self.connection_ends = 0          # the kept connection ended (a restart, or a close)
        self._kept: BackendHTTP | None = None   # the watch's own connection to the backend
        self._kept_base = ""
        self._lock: asyncio.Lock | None = None
        self._resyncing = False
        self.external = False             # polar_weights_owner=external: never loads, only reads tags

    def report(self) -> dict:
        return {"state": self.state, "error": self.error, "checked_at": self.checked_at, "checks": self.checks,
                "resyncs": self.resyncs, "connection_ends": self.connection_ends}

    async def check(self, kept: bool = False) -> str:
        """Read vLLM's tag now (kept: over the watch's own connection); a foreign one loses
        the gateway's version (and re-syncs it where its checkpoint is known). Returns the
        state."""
        async with self.lock():
            if self.gate.asleep or self.state == "unavailable":
                return self.state
            try:
                tag = await self.backend.weight_version(self._kept_client() if kept else None)
            except NoWeightInfo as e:
                self.state, self.error = "unavailable", str(e)
                log.warning("polar: %s: the gateway cannot tell a restarted backend; versions are as synced", e)
                return self.state
            except AdapterError as e:      # down, slow: a restart shows once it answers again
                self.state, self.error = "error", str(e)
                return self.state
            self.checks += 1
            self.checked_at = time.time()
            if self.external:
                return self._owned_elsewhere(tag)
            if self.expected is None:
                # The first tag read: an untagged vLLM (a fresh process nobody synced: vLLM
                # says "default") is tagged as the version the gateway starts with, so that a
                # restart shows; one a sync tagged (maybe another gateway's) is taken as it is.
                if untagged(tag):
                    try:
                        await self._tag_as_served()
                    except AdapterError as e:
                        self.state, self.error = "error", str(e)
                        return self.state
                    tag = self.expected
                else:
                    self.expected = tag
                    self.gate.engine_tagged = True
            expected = self.expected
            if tag == expected:
                if not self.gate.verified and self.gate.suspect:
                    self.gate.vouch()     # only its connection had ended: the weights are still its own
                self.state, self.error = ("ok" if self.gate.verified else "lost"), None
            else:
                self.state, self.error = "lost", f"the backend's weights are tagged {tag!r}, not {expected!r}"
                if self.gate.lost():
                    log.error("polar: version %d is no longer served (%s): calls record no version until a sync",
                              self.gate.version, self.error)
                if self.gate.checkpoint is None and untagged(tag):
                    await self._readopt(tag)
        if not self.gate.verified and self.gate.checkpoint and not self.gate.asleep and not self._resyncing:
            await self._resync()
        return self.state

    def _owned_elsewhere(self, tag: str | None) -> str:
        """polar_weights_owner=external: the backend's owner (a Ray replica actor, shared by
        several gateways) loads and tags its weights itself, so any tag of a sync (polar-vN)
        is served as that version, exactly per token; an untagged one is a restarted backend
        its owner has not loaded yet: lost, until a tag shows."""
        if untagged(tag):
            self.state, self.error = "lost", f"the backend's weights are untagged ({tag!r}): restarted, not loaded yet"
            if self.gate.lost():
                log.error("polar: %s: calls record no version until its owner loads one", self.error)
            return self.state
        self.expected = tag
        self.gate.engine_tagged = True
        if not self.gate.verified:
            self.gate.vouch()
        self.state, self.error = "ok", None
        return self.state

    async def _readopt(self, tag: str | None) -> None:
        """A gateway that never synced (nor was told its checkpoint) took an untagged vLLM
        as its start version; a restarted one, untagged again, is taken the same way: tagged,
        and vouched for from now on. The calls across the restart stay unknown (the loss
        above), and polar_policy_checkpoint would have it reload its weights instead."""
        try:
            await self._tag_as_served()
        except AdapterError as e:
            self.error = f"{self.error}; tagging it failed: {e}"
            return
        self.gate.vouch()
        self.state, self.error = "ok", None
        log.warning("polar: the backend came back untagged (%r): what it serves is taken as version %d again, as "
                    "at start (polar_policy_checkpoint would have it reloaded instead)", tag, self.gate.version)

    async def _tag_as_served(self) -> None:
        """Tags what vLLM serves now as the gateway's version (AdapterError where it cannot)."""
        await self.backend.set_weight_version(self.gate.version)
        self.expected = weight_tag(self.gate.version)
        self.gate.engine_tagged = True

    async def swap(self, source: WeightSource, version: int, wake: bool, inflight: bool = False) -> SwapSeconds:
        """vLLM loads source, tagged as version: the tag the watch expects from then on."""
        steps = await self.backend.swap_weights(source, version, wake, inflight)
        self.expected = weight_tag(version)
        self.gate.engine_tagged = True
        return steps

    def lock(self) -> asyncio.Lock:
        """Held by a check, and by a sync's swap: a check never reads a tag half-way through one."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _resync(self) -> None:
        version, checkpoint = self.gate.version, self.gate.checkpoint
        if checkpoint is None:
            return
        self._resyncing = True
        try:
            inflight = self.backend.route == "generate"
            await self.gate.sync(lambda wake: self.swap(WeightSource(checkpoint), version, wake, inflight and not wake),
                                 version, checkpoint, inflight)
        except AdapterError as e:
            log.error("polar: re-syncing version %d from %s failed (tried again at the next check): %s",
                      version, checkpoint, e)
            return
        finally:
            self._resyncing = False
        self.resyncs += 1
        self.state, self.error = "ok", None
        log.warning("polar: the backend serves version %d again (reloaded %s)", version, checkpoint)

    def _kept_client(self) -> BackendHTTP:
        """A client of its own with one kept-alive connection (rebuilt if polar_backend changes)."""
        if self._kept is None or self._kept.closed or self._kept_base != self.backend.base:
            self.close()
            self._kept = BackendHTTP(self.backend.base, timeout=10, connect_timeout=5, max_idle=1)
            self._kept_base = self.backend.base
        return self._kept

    async def _connection_ended(self, timeout: float) -> bool:
        """Waits up to timeout; True as soon as the kept connection ends (EOF: the server
        closed it, or its process died)."""
        idle = self._kept._idle if self._kept is not None else []
        if not idle:                      # none kept (the server closes after each answer)
            await asyncio.sleep(timeout)
            return False
        reader, writer = idle[0]
        try:
            await asyncio.wait_for(reader.read(1), timeout)
        except TimeoutError:
            return False
        except (OSError, asyncio.IncompleteReadError):
            pass
        idle.clear()
        writer.close()
        return True

    def _lost_connection(self) -> None:
        self.connection_ends += 1
        if self.expected is not None and self.state == "ok" and self.gate.lost(sure=False):
            # the next check tells a restart (a foreign tag) from a close (its own)
            log.warning("polar: the backend closed the version watch's connection (a restart?): calls record "
                        "no version until its weights' tag is read back")

    async def run(self, every: float) -> None:
        while True:
            try:
                if await self._connection_ended(every):
                    self._lost_connection()
                await self.check(kept=True)
            except asyncio.CancelledError:
                raise
            except Exception:   # a watch that dies quietly would vouch for nothing
                log.exception("polar: the version check failed")
                await asyncio.sleep(every)

    def close(self) -> None:
        if self._kept is not None:
            kept, self._kept = self._kept, None
            try:
                asyncio.get_running_loop().create_task(kept.aclose())
            except RuntimeError:
                kept.closed = True


class WeightSync:
    def __init__(self, backend_client: BackendClient, control: Control | None = None):
        self.backend = backend_client
        self.control = control or Control()
        self.gate = PolicyGate()
        self.watch = VersionWatch(backend_client, self.gate)
        self.syncs = 0
        self.check_every = 1.0
        self.mode_wanted = "auto"      # polar_sync_mode
        self._task: asyncio.Task | None = None

    def load(self, loader):
        loader.add_option("polar_policy_version", str, "0",
                          "Policy version of the weights the backend serves at start (an "
                          "integer); each sync through /_polar/sync sets the next.")
        loader.add_option("polar_policy_checkpoint", str, "",
                          "The weights the backend serves at start (a directory): with it, "
                          "the gateway reloads them itself when the backend restarts.")
        loader.add_option("polar_sync_mode", str, "auto",
                          "How a sync swaps vLLM's weights: inflight (vLLM pauses the calls it "
                          "runs, reloads, tags, resumes: nothing drains, each token keeps the "
                          "version that sampled it; needs the token route), drain (hold new "
                          "calls, let those in flight finish, reload), or auto (inflight where "
                          "calls take the token route).", choices=SYNC_MODES)
        loader.add_option("polar_weights_owner", str, "gateway",
                          "Who loads the backend's weights: gateway (a sync swaps them) or "
                          "external (the backend's owner, e.g. a Ray replica actor that several "
                          "gateways share, swaps and tags them; a sync only adopts the version "
                          "number, and every token's version is the engine's own tag).",
                          choices=OWNERS)
        loader.add_option("polar_version_check", str, "1",
                          "Seconds between checks that the backend still serves the version "
                          "the gateway set (vLLM's /weight_info; 0: off).")

    def configure(self, updated):
        if "polar_policy_version" in updated:
            version = option_values.integer("polar_policy_version", ctx.options.polar_policy_version)
            if self.syncs == 0:   # a sync's version is not undone by a later --set
                self.gate.version = version
        if "polar_policy_checkpoint" in updated and self.syncs == 0:
            self.gate.checkpoint = ctx.options.polar_policy_checkpoint or None
        if "polar_sync_mode" in updated:
            self.mode_wanted = ctx.options.polar_sync_mode
        if "polar_weights_owner" in updated:
            self.watch.external = ctx.options.polar_weights_owner == "external"
        if "polar_version_check" in updated:
            self.check_every = option_values.seconds("polar_version_check", ctx.options.polar_version_check)

    async def running(self) -> None:
        if not self.check_every:
            return
        self._task = asyncio.get_running_loop().create_task(self.watch.run(self.check_every))

    def done(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.watch.close()

    async def request(self, flow: http.HTTPFlow):
        path = split_path(flow.request.path)[0] if flow.response is None else None
        if path not in (SYNC_PATH, SLEEP_PATH, VERIFY_PATH):
            return
        req = flow.request
        if not self.control.authorized(flow):
            flow.response = _error(403, "this needs the proxy's control token")
        elif req.method != "POST":
            flow.response = _error(405, f"POST {SYNC_PATH} {{\"checkpoint\": DIR, \"version\": N}}, "
                                        f"POST {SLEEP_PATH} {{\"level\": 1|2}} or POST {VERIFY_PATH}")
        elif path == SLEEP_PATH:
            flow.response = await self._sleep(req)
        elif path == VERIFY_PATH:
            flow.response = await self._verify()
        else:
            flow.response = await self._sync(req)

    async def _verify(self) -> http.Response:
        """A fresh check of vLLM's tag, and the gate's epoch: a node compares it with the one
        it read when a session started."""
        state = await self.watch.check()
        body = {"state": state, "verified": self.gate.verified, "epoch": self.gate.epoch,
                "losses": self.gate.losses, "version": self.gate.version, "error": self.watch.error}
        return http.Response.make(200, orjson.dumps(body), JSON_HEADERS)

    async def _sleep(self, req: http.Request) -> http.Response:
        try:
            level = orjson.loads(req.content or b"{}").get("level", 1)
            if level not in (1, 2):
                raise TypeError
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            return _error(400, 'expected {"level": 1 or 2}')
        try:
            report = await self.gate.sleep(lambda: self.backend.sleep(level))
        except AdapterError as e:
            log.error("polar: putting the backend to sleep failed: %s", e)
            return _error(502, f"the backend did not sleep; version {self.gate.version} still serves: {e}")
        log.info("polar: the backend sleeps (level %d); calls are held until the next sync", level)
        return http.Response.make(200, orjson.dumps(report.as_json()), JSON_HEADERS)

    async def sync_mode(self) -> str:
        """inflight or drain, for the next sync: in flight only where the engine labels every
        token (the token route; asked of the backend if no call decided it yet)."""
        if self.mode_wanted == "drain":
            return "drain"
        route = self.backend.route or await self.backend.probe_route()
        if route != "generate" and self.mode_wanted == "inflight":
            log.warning("polar: polar_sync_mode=inflight needs the token route (%s): this sync drains",
                        self.backend.route_note)
        return "inflight" if route == "generate" else "drain"

    async def _sync(self, req: http.Request) -> http.Response:
        try:
            source, version = _sync_request(req.content)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return _error(400, 'expected {"checkpoint": "DIR", "version": INTEGER} or {"pull": {"url": URL, '
                               '"sha256": HEX}, "version": INTEGER, "checkpoint": DIR or null}')
        checkpoint = source.checkpoint
        if self.watch.external:
            return await self._adopt(version, checkpoint)
        try:
            inflight = await self.sync_mode() == "inflight"
            # a pull is fetched into vLLM's workers first, while calls go on: nothing is held for it
            prefetch_s = await self.backend.prefetch(source) if source.pull_url else None
        except AdapterError as e:
            log.error("polar: the weight sync to version %d failed before it began: %s", version, e)
            return _error(502, f"the weight sync failed; version {self.gate.version} still serves: {e}")

        async def swap(wake: bool):
            async with self.watch.lock():
                return await checked_swap(wake)

        async def checked_swap(wake: bool):
            # What served the calls since the last check: a foreign tag here loses them too.
            expected = self.watch.expected
            if not wake and expected is not None and self.watch.state != "unavailable":
                try:
                    tag = await self.backend.weight_version()
                except AdapterError:
                    tag = expected        # down or without the endpoint: the watch says so on its own
                if tag != expected and self.gate.lost():
                    log.error("polar: before the sync, the backend's weights were tagged %r, not %r", tag, expected)
            return await self.watch.swap(source, version, wake, inflight and not wake)   # asleep: nothing runs
        try:
            report = await self.gate.sync(swap, version, checkpoint, inflight)
        except AdapterError as e:
            log.error("polar: the weight sync to version %d failed: %s", version, e)
            return _error(502, f"the weight sync failed; version {self.gate.version} still serves: {e}")
        self.syncs += 1
        if report.steps is not None:
            report.steps.prefetch_s = prefetch_s
        log.info("polar: policy version %d from %s, %s (held %d calls, drained %d in %.2fs, swap %.2fs, "
                 "stall %.2fs)", version, source.pull_url and "a pull" or checkpoint, report.mode, report.held,
                 report.drained, report.drain_s, report.swap_s, report.stall_s or 0.0)
        return http.Response.make(200, orjson.dumps(report.as_json()), JSON_HEADERS)

    async def _adopt(self, version: int, checkpoint: str | None) -> http.Response:
        """polar_weights_owner=external: the backend's owner swapped its weights already; the
        gateway takes the version (a call's starting version from now on) and reads the tag
        back. Nothing is held: each token's version is the engine's own."""
        async def adopt(wake: bool) -> SwapSeconds:
            async with self.watch.lock():
                self.gate.version = version
            return SwapSeconds()
        report = await self.gate.sync(adopt, version, checkpoint, inflight=True)
        self.syncs += 1
        state = await self.watch.check()
        log.info("polar: policy version %d adopted (the backend's owner loads it; its tag: %s)", version, state)
        return http.Response.make(200, orjson.dumps(report.as_json()), JSON_HEADERS)


def _sync_request(content: bytes | None) -> tuple[WeightSource, int]:
    """A sync's body: the version, and its weights from a checkpoint folder or a pull (then
    the folder, if any, is what a re-sync reloads). Raises on anything else."""
    body = orjson.loads(content or b"{}")
    version, checkpoint, pull = body["version"], body.get("checkpoint"), body.get("pull")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise TypeError
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise TypeError
    if pull is None:
        if not checkpoint:
            raise KeyError("checkpoint")
        return WeightSource(checkpoint), version
    url, sha = pull["url"], pull["sha256"].lower() if isinstance(pull["sha256"], str) else None
    if not (isinstance(url, str) and url.startswith(("http://", "https://")) and isinstance(sha, str)
            and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise ValueError
    return WeightSource(checkpoint, url, sha), version


def _error(status: int, message: str) -> http.Response:
    return http.Response.make(status, orjson.dumps({"error": {"message": message}}), JSON_HEADERS)
