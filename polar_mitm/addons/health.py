"""The health check, as an addon: launchers poll /_polar/health to know that the addon is
loaded and answering, and it says how recording goes. The only place it is answered."""

from __future__ import annotations

from typing import Any

import orjson
from mitmproxy import ctx, http

from polar_mitm.adapters.detect import split_path

from . import sessions
from .model_calls import ModelCalls
from .policy_gate import PolicyGate
from .recorder import Recorder
from .relay import StreamRelay

HEALTH_PATH = "/_polar/health"
_JSON = {"content-type": "application/json"}


class Health:
    def __init__(self, recorder: Recorder, model_calls: ModelCalls, relay: StreamRelay, gate: PolicyGate):
        self.recorder, self.model_calls, self.relay, self.gate = recorder, model_calls, relay, gate

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or split_path(flow.request.path)[0] != HEALTH_PATH:
            return
        flow.response = http.Response.make(200, orjson.dumps(self.report()), _JSON)
        # mitmdump prints the URL of every flow: a ?key= secret must not reach its log.
        flow.request.path = sessions.redact_query(flow.request.path)

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
                # the version sampling new calls; holding: a weight sync is under way
                "policy": self.gate.state()}
