"""A stand-in for vLLM's chat endpoint, for the failure tests only (slow, 5xx, bad JSON).
Everything that checks tokens runs against the real vLLM server.

Like vLLM (before it clamped), it refuses prompt tokens + max_tokens above max_model_len;
a "token" here is 4 bytes of the messages' JSON, and /tokenize counts the same way."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson


class FakeVLLM:
    def __init__(self, mode: str = "ok", delay: float = 0.0, max_model_len: int = 4096,
                 reload_delay: float = 0.0, dev_mode: bool = True):
        self.mode, self.delay, self.max_model_len = mode, delay, max_model_len
        self.bodies: list[dict] = []
        self.tokenized: list[dict] = []   # /tokenize bodies
        # weights as vLLM's dev-mode endpoints change them: the answer says which served it
        self.weights, self.reload_delay, self.dev_mode = "base", reload_delay, dev_mode
        self.served: list[tuple[float, float, str, str]] = []   # (start, end, weights then, weights after)
        self.reloads: list[tuple[float, float, str]] = []       # (start, end, weights path)
        self.lock = threading.Lock()
        self.reloading = False
        self.control: list[str] = []      # dev-mode calls, in order (path with query)
        self.sleeping: set[str] = set()   # what sleeps: "weights", "kv_cache"
        self.served_asleep = 0            # generation asked while asleep (must stay 0)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as separate writes

            def log_message(self, *a):
                pass

            def _send(self, status, body: bytes):
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/is_sleeping":
                    self._send(200, orjson.dumps({"is_sleeping": bool(fake.sleeping)}))
                elif self.path == "/v1/models":
                    self._send(200, orjson.dumps({"object": "list", "data": [
                        {"id": "fake-model", "max_model_len": fake.max_model_len}]}))
                else:
                    self._send(404, b'{"detail":"Not Found"}')

            def do_POST(self):
                body = orjson.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                route, _, query = self.path.partition("?")
                if route in ("/sleep", "/wake_up"):
                    if not fake.dev_mode:
                        return self._send(404, b'{"detail":"Not Found"}')
                    fake.control.append(self.path)
                    tags = [t.partition("=")[2] for t in query.split("&") if t.startswith("tags=")]
                    if route == "/sleep":
                        fake.sleeping = {"weights", "kv_cache"}
                        if "level=2" in query:
                            fake.weights = None     # discarded: only a reload brings them back
                    else:
                        fake.sleeping -= set(tags or ("weights", "kv_cache"))
                    return self._send(200, b"{}")
                if self.path in ("/collective_rpc", "/reset_prefix_cache", "/update_weight_version"):
                    if not fake.dev_mode:
                        return self._send(404, b'{"detail":"Not Found"}')
                    fake.control.append(self.path)
                    if "weights" in fake.sleeping:
                        return self._send(500, b'{"detail":"the weights sleep"}')
                    if self.path == "/collective_rpc":
                        t0 = time.monotonic()
                        fake.reloading = True
                        time.sleep(fake.reload_delay)
                        fake.weights = body["kwargs"]["weights_path"]
                        fake.reloading = False
                        fake.reloads.append((t0, time.monotonic(), fake.weights))
                    return self._send(200, b'{"results": [null]}')
                if self.path == "/tokenize":
                    fake.tokenized.append(body)
                    n = fake.prompt_tokens(body["messages"])
                    return self._send(200, orjson.dumps({"count": n, "max_model_len": fake.max_model_len,
                                                         "tokens": list(range(n))}))
                fake.bodies.append(body)
                if fake.sleeping or fake.weights is None:
                    fake.served_asleep += 1
                    return self._send(500, b'{"error":{"message":"asleep","type":"InternalServerError"}}')
                t0, weights = time.monotonic(), fake.weights
                time.sleep(fake.delay)
                with fake.lock:
                    fake.served.append((t0, time.monotonic(), weights, fake.weights))
                n, wanted = fake.prompt_tokens(body["messages"]), body.get("max_tokens")
                if fake.mode == "ok" and wanted is not None and n + wanted > fake.max_model_len:
                    self._send(400, orjson.dumps({"error": {
                        "message": f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. "
                                   f"This model's maximum context length is {fake.max_model_len} tokens "
                                   f"and your request has {n} input tokens ({wanted} > "
                                   f"{fake.max_model_len} - {n}).",
                        "type": "BadRequestError", "param": None, "code": 400}}))
                elif fake.mode == "500":
                    self._send(500, b'{"error":{"message":"engine crashed","type":"InternalServerError"}}')
                elif fake.mode == "badjson":
                    self._send(200, b'{"choices": [')
                elif fake.mode == "odd":  # valid JSON, not a completion
                    self._send(200, b'{"choices": [{"message": null}]}')
                elif fake.mode == "context":
                    self._send(400, b'{"error":{"message":"This model\'s maximum context length is 8192 tokens","type":"BadRequestError"}}')
                else:
                    self._send(200, orjson.dumps({
                        "id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": "fake-model",
                        "prompt_token_ids": [1, 2, 3],
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok" if weights == "base" else f"ok {weights}"},
                                     "finish_reason": "stop", "token_ids": [7, 2],
                                     "logprobs": {"content": [{"token": "ok", "logprob": -0.5},
                                                              {"token": "</s>", "logprob": -0.1}]}}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}))

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    @staticmethod
    def prompt_tokens(messages) -> int:
        return len(orjson.dumps(messages)) // 4 + 3

    def __enter__(self):
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._httpd.shutdown()
        self._httpd.server_close()
