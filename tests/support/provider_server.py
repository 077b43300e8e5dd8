"""A small HTTP server on 127.0.0.1 that answers any provider style with the adapters'
output, so the official SDKs can be pointed at it. The "model" is a callable the test
scripts: normalized request -> normalized result."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import orjson

from polar_mitm.adapters import AdapterError, adapter, detect, stream_content_type
from polar_mitm.adapters.chat import stable_id


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


class ProviderServer:
    def __init__(self, responder: Callable[[dict], dict] | None = None):
        self.responder = responder or (lambda req: make_result("Hello from the proxy."))
        self.requests: list[dict] = []      # normalized requests, in arrival order
        self.raw: list[dict] = []           # {"path", "headers", "body"} as received
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as separate writes

            def log_message(self, *args):
                pass

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                server._handle(self, raw)

            def do_GET(self):
                self._send(404, b'{"error": "not found"}', "application/json")

            def _send(self, status, body: bytes, ctype: str):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def _handle(self, h, raw: bytes):
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        style = detect("POST", h.path, dict(h.headers), body)
        self.raw.append({"path": h.path, "headers": dict(h.headers), "body": body})
        if style is None:
            h._send(404, b'{"error": "unknown path"}', "application/json")
            return
        mod = adapter(style)
        try:
            if not isinstance(body, dict):
                raise AdapterError("request body must be a JSON object")
            req = mod.to_chat(body, h.path)
        except AdapterError as e:
            h._send(e.status, orjson.dumps(mod.error(e.status, str(e), e.kind)), "application/json")
            return
        self.requests.append(req)
        result = self.responder(req)
        if req["stream"]:
            h._send(200, b"".join(mod.stream(result, req)), stream_content_type(req))
        else:
            h._send(200, orjson.dumps(mod.from_chat(result, req)), "application/json")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._httpd.shutdown()
        self._httpd.server_close()
