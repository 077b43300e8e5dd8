"""The tests' small HTTP stand-ins (a callback receiver, a judge's model, a provider) share
this server: a free port of 127.0.0.1, served from threads of the test's process, each
request handed to `answer` whole. (The vLLM stand-in, fake_vllm.py, has its own: it closes
and reopens its port.)"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, NamedTuple


class Request(NamedTuple):
    method: str
    path: str                  # with its query
    headers: dict[str, str]    # as sent
    body: bytes


class Reply(NamedTuple):
    status: int
    body: bytes = b""
    content_type: str = "application/json"


class StubServer:
    """Answers every GET and POST with answer(request); close() (or the end of a `with`)
    stops it."""

    def __init__(self, answer: Callable[[Request], Reply]):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as separate writes

            def log_message(self, *args):
                pass

            def _answer(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                reply = answer(Request(method, self.path, dict(self.headers), raw))
                self.send_response(reply.status)
                self.send_header("content-type", reply.content_type)
                self.send_header("content-length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
