"""Local answers: everything that is not a model call (telemetry, feature flags, model lists,
token counts, WebSocket attempts) is answered here at once, so harness runs never hang on
it, and none of it is forwarded. (The health check is the Health addon's.)"""

from __future__ import annotations

from typing import Any

import orjson
from mitmproxy import http

from polar_mitm import adapters
from polar_mitm.adapters import backend
from polar_mitm.adapters.chat import AdapterError
from polar_mitm.adapters.detect import is_count_tokens, split_path

from . import sessions
from .backend_client import BackendClient
from .bodies import is_websocket
from .http_json import JSON_HEADERS
from .model_calls import ModelCalls, read_body
from .relay import META


class LocalAnswers:
    def __init__(self, backend_client: BackendClient, model_calls: ModelCalls):
        self.backend, self.model_calls = backend_client, model_calls

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or META in flow.metadata:
            return
        try:
            await self._answer(flow)
        finally:
            # mitmdump prints the URL of every flow: a ?key= secret must not reach its log.
            flow.request.path = sessions.redact_query(flow.request.path)

    async def _answer(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        path, _ = split_path(req.path)
        if is_websocket(req):
            # Codex tries Responses-over-WebSocket first and falls back to HTTPS on 404.
            flow.response = http.Response.make(404, b'{"error": "websocket transport not offered"}', JSON_HEADERS)
        elif req.method == "POST" and is_count_tokens(path):
            body, _ = read_body(req, self.model_calls.max_body)
            flow.response = await self._count_tokens(req, body) if isinstance(body, dict) \
                else http.Response.make(400, b'{"error": "request body must be a JSON object"}', JSON_HEADERS)
        elif req.method == "GET" and path.endswith("/models"):
            flow.response = http.Response.make(200, orjson.dumps(await self._model_list(path)), JSON_HEADERS)
        elif req.method in ("HEAD", "OPTIONS"):
            flow.response = http.Response.make(200, b"")
        elif req.method == "GET":
            flow.response = http.Response.make(404, b'{"error": "not found"}', JSON_HEADERS)
        else:
            flow.response = http.Response.make(204, b"")

    async def _model_list(self, path: str) -> dict[str, Any]:
        try:
            name = await self.backend.served()
        except AdapterError:
            name = "unavailable"
        if "/backend-api/codex/" in path:
            return {"models": []}  # Codex falls back to its built-in model metadata
        if "/v1beta/" in path:
            return {"models": [{"name": f"models/{name}", "displayName": name,
                                "supportedGenerationMethods": ["generateContent"]}]}
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "polar-mitm"}]}

    async def _count_tokens(self, req: http.Request, body: dict[str, Any]) -> http.Response:
        style = "google" if ":countTokens" in req.path else "anthropic"
        adapter = adapters.adapter(style)
        try:
            if style == "google":
                normalized = adapter.to_chat(body.get("generateContentRequest") or body,
                                             req.path.replace(":countTokens", ":generateContent"))
            else:
                normalized = adapter.to_chat({"max_tokens": 1, **body})
            served = await self.backend.served()
            count = await self.backend.tokenize(backend.to_backend(normalized, served))
        except AdapterError as e:   # the backend's failures included, as the client's error
            status = adapter.OVERLOADED_STATUS if e.kind == "overloaded" else e.status
            return http.Response.make(status, orjson.dumps(adapter.error(status, str(e), e.kind)), JSON_HEADERS)
        answer = {"totalTokens": count} if style == "google" else {"input_tokens": count}
        return http.Response.make(200, orjson.dumps(answer), JSON_HEADERS)
