"""Weight syncs through the gateway, as an addon: `POST /_polar/sync` with the control
token (`polar_control_token`; empty: no syncs) and `{"checkpoint": DIR, "version": N}`
holds new model calls, lets those in flight finish, has vLLM reload DIR in place, resets
its prefix cache, sets version N and releases the held calls (policy_gate.py). Every call
is recorded with the integer version that sampled it; it starts at polar_policy_version.
`POST /_polar/sleep {"level": 1|2}` (one GPU shared with the trainer) holds and drains the
same way, then puts vLLM to sleep; calls stay held until the next sync wakes it."""

from __future__ import annotations

import hmac
import logging
from dataclasses import asdict

import orjson
from mitmproxy import ctx, exceptions, http

from polar_mitm.adapters.chat import AdapterError
from polar_mitm.adapters.detect import split_path

from .backend_client import BackendClient
from .policy_gate import PolicyGate

log = logging.getLogger("polar")

SYNC_PATH = "/_polar/sync"
SLEEP_PATH = "/_polar/sleep"
_JSON = {"content-type": "application/json"}


class WeightSync:
    def __init__(self, backend_client: BackendClient):
        self.backend = backend_client
        self.gate = PolicyGate()
        self.syncs = 0

    def load(self, loader):
        loader.add_option("polar_policy_version", str, "0",
                          "Policy version of the weights the backend serves at start (an "
                          "integer); each sync through /_polar/sync sets the next.")
        loader.add_option("polar_control_token", str, "",
                          "Bearer token that /_polar/sync requires (empty: syncs are off). "
                          "Harnesses reach the proxy too: keep it secret from them.")

    def configure(self, updated):
        if "polar_policy_version" in updated:
            try:
                version = int(ctx.options.polar_policy_version)
            except ValueError:
                raise exceptions.OptionsError("polar_policy_version: expected an integer, got "
                                              f"{ctx.options.polar_policy_version!r}") from None
            if self.syncs == 0:   # a sync's version is not undone by a later --set
                self.gate.version = version

    async def request(self, flow: http.HTTPFlow):
        path = split_path(flow.request.path)[0] if flow.response is None else None
        if path not in (SYNC_PATH, SLEEP_PATH):
            return
        req = flow.request
        token = ctx.options.polar_control_token
        given = req.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not token or not hmac.compare_digest(given.encode(), token.encode()):
            flow.response = _error(403, "syncs need the proxy's control token (polar_control_token)")
        elif req.method != "POST":
            flow.response = _error(405, f"POST {SYNC_PATH} {{\"checkpoint\": DIR, \"version\": N}} or "
                                        f"POST {SLEEP_PATH} {{\"level\": 1|2}}")
        elif path == SLEEP_PATH:
            flow.response = await self._sleep(req)
        else:
            flow.response = await self._sync(req)

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
        return http.Response.make(200, orjson.dumps(asdict(report)), _JSON)

    async def _sync(self, req: http.Request) -> http.Response:
        try:
            body = orjson.loads(req.content or b"{}")
            checkpoint, version = body["checkpoint"], body["version"]
            if not isinstance(checkpoint, str) or not isinstance(version, int) or isinstance(version, bool):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return _error(400, 'expected {"checkpoint": "DIR", "version": INTEGER}')
        try:
            report = await self.gate.sync(lambda wake: self.backend.swap_weights(checkpoint, version, wake),
                                          version, checkpoint)
        except AdapterError as e:
            log.error("polar: the weight sync to version %d failed: %s", version, e)
            return _error(502, f"the weight sync failed; version {self.gate.version} still serves: {e}")
        self.syncs += 1
        log.info("polar: policy version %d from %s (held %d calls, drained %d in %.2fs, swap %.2fs)",
                 version, checkpoint, report.held, report.drained, report.drain_s, report.swap_s)
        return http.Response.make(200, orjson.dumps(asdict(report)), _JSON)


def _error(status: int, message: str) -> http.Response:
    return http.Response.make(status, orjson.dumps({"error": {"message": message}}), _JSON)
