"""A small HTTP server on 127.0.0.1 that answers any provider style with the adapters'
output, so the official SDKs can be pointed at it. The "model" is a callable the test
scripts: normalized request -> normalized result."""

from __future__ import annotations

from typing import Callable

import orjson

from polar_mitm.adapters import AdapterError, adapter, detect, stream_content_type
from polar_mitm.adapters.chat import stable_id
from support.http_stub import Reply, Request, StubServer


def make_result(text: str = "", tool_calls: list[dict] | None = None, *, reasoning=None,
                finish_reason: str | None = None, prompt_tokens: int = 11,
                completion_tokens: int = 7, seed: str = "r") -> dict:
    calls = [{"id": c.get("id") or stable_id("call_", seed, i), "name": c["name"],
              "arguments": c.get("arguments", "{}"), "kind": c.get("kind", "function")}
             for i, c in enumerate(tool_calls or [])]
    return {"id": stable_id("chatcmpl-", seed), "created": 1760000000, "model": "served",
            "text": text, "reasoning": reasoning, "tool_calls": calls,
            "finish_reason": finish_reason or ("tool_calls" if calls else "stop"),
            "stop_sequence": None,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}


ANSWER = "It printed hi."


def tool_then_text(tool_call: Callable[[dict], dict], reasoning: tuple[str, str] | None = None
                   ) -> Callable[[dict], dict]:
    """A model for the SDK round trips: it calls a tool (tool_call(request): make_result's
    tool call) until a tool result is in the history, then answers ANSWER; reasoning: what it
    thinks before the call and before the answer."""
    def respond(req: dict) -> dict:
        seed = len(req["messages"])
        if req["tools"] and not any(m["role"] == "tool" for m in req["messages"]):
            return make_result(tool_calls=[tool_call(req)], reasoning=reasoning and reasoning[0], seed=seed)
        return make_result(ANSWER, reasoning=reasoning and reasoning[1], seed=seed)
    return respond


class ProviderServer(StubServer):
    def __init__(self, responder: Callable[[dict], dict] | None = None):
        self.responder = responder or (lambda req: make_result("Hello from the proxy."))
        self.requests: list[dict] = []      # normalized requests, in arrival order
        self.raw: list[dict] = []           # {"path", "headers", "body"} as received
        super().__init__(self._answer)

    def _answer(self, request: Request) -> Reply:
        if request.method != "POST":
            return Reply(404, b'{"error": "not found"}')
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            body = None
        style = detect("POST", request.path, request.headers, body)
        self.raw.append({"path": request.path, "headers": request.headers, "body": body})
        if style is None:
            return Reply(404, b'{"error": "unknown path"}')
        mod = adapter(style)
        try:
            if not isinstance(body, dict):
                raise AdapterError("request body must be a JSON object")
            req = mod.to_chat(body, request.path)
        except AdapterError as e:
            return Reply(e.status, orjson.dumps(mod.error(e.status, str(e), e.kind)))
        self.requests.append(req)
        result = self.responder(req)
        if req["stream"]:
            return Reply(200, b"".join(mod.stream(result, req)), stream_content_type(req))
        return Reply(200, orjson.dumps(mod.from_chat(result, req)))
