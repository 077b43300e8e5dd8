"""The health check, as an addon: launchers poll /_polar/health to know that the addon is
loaded and answering, and it says how recording goes. The only place it is answered. Where
the gateway has a control token (a node's), only its holder reads it: sessions reach this
proxy too, and the figures (calls, versions, refusals) are nothing of theirs."""

from __future__ import annotations

from typing import Any

import orjson
from mitmproxy import ctx, http

from polar_mitm.adapters.detect import split_path

from . import sessions
from .control import Control
from .http_json import JSON_HEADERS
from .model_calls import ModelCalls
from .policy_gate import PolicyGate
from .recorder import Recorder
from .relay import StreamRelay
from .weight_sync import VersionWatch

HEALTH_PATH = "/_polar/health"
HEALTH_TOKEN_NEEDED = "the health check needs the proxy's control token"


class Health:
    def __init__(self, recorder: Recorder, model_calls: ModelCalls, relay: StreamRelay, gate: PolicyGate,
                 control: Control | None = None, watch: VersionWatch | None = None):
        self.recorder, self.model_calls, self.relay, self.gate = recorder, model_calls, relay, gate
        self.control, self.watch = control or Control(), watch

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or split_path(flow.request.path)[0] != HEALTH_PATH:
            return
        if self.control.token and not self.control.authorized(flow):
            flow.response = http.Response.make(403, orjson.dumps(
                {"error": {"message": HEALTH_TOKEN_NEEDED}}), JSON_HEADERS)
        else:
            flow.response = http.Response.make(200, orjson.dumps(self.report()), JSON_HEADERS)
        # mitmdump prints the URL of every flow: a ?key= secret must not reach its log.
        flow.request.path = sessions.redact_query(flow.request.path)

    def _route(self) -> dict[str, Any]:
        client = self.model_calls.backend
        wanted = ctx.options.polar_sync_mode
        mode = ("drain" if wanted == "drain" or client.route == "chat"
                else "inflight" if client.route == "generate" else f"{wanted} (once the route is known)")
        return {"route": client.route, "wanted": client.route_wanted, "why": client.route_note, "sync_mode": mode}

    def report(self) -> dict[str, Any]:
        writer = self.recorder.writer   # as it is: a health check never opens the database
        loader = writer.health() if writer else None
        # "ok" only while calls also reach the database; a loader that keeps failing is
        # "degraded" (calls are still acknowledged: they wait, durable, in the log)
        status = "degraded" if loader and loader["state"] == "failing" else "ok"
        return {"polar": status, "db": ctx.options.polar_db, "calls": self.model_calls.calls,
                "streams_kept_alive": self.relay.handed_over,
                # the loader's bulk loads into DuckDB, and those that failed (to be retried)
                "loads": writer.loads if writer else 0,
                "load_errors": writer.load_errors if writer else 0,
                # acknowledged calls still only in the call log (readers get them on asking)
                "log_pending": writer.pending_lines if writer else 0,
                "loader": loader,
                # the version sampling new calls; holding: a weight sync is under way;
                # verified: vLLM still serves it (version_check says how that was last seen)
                "policy": self.gate.state(),
                "version_check": self.watch.report() if self.watch else None,
                # how calls reach vLLM: generate (the engine labels every token's version) or
                # chat (the gateway's version); and how syncs swap weights, as things stand
                "backend_route": self._route(),
                # calls that named a session without its credential: refused, stored nowhere
                "refused_calls": self.control.refused, "session_auth": self.control.session_auth}
