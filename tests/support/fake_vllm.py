"""The stand-in for vLLM's HTTP API, for tests and scripts that do not need the real server
(everything that checks real tokens runs against it: the vllm_backend fixture). One class,
FakeVLLM, in a thread of the caller's process; its `mode` says how it answers
/v1/chat/completions:

  "ok"        "ok" (or "ok <weights>" after a reload), three prompt ids, two generated ids.
              Like vLLM (before it clamped), it refuses prompt tokens + max_tokens above
              max_model_len; a "token" here is 4 bytes of the messages' JSON, and /tokenize
              counts the same way.
  "500", "badjson", "odd", "context"
              a broken backend: an engine error, JSON cut short, valid JSON that is no
              completion, a context-length 400.
  "scripted"  for the harness CLIs, whose prompts are longer than SmolLM2's context: the
              first turn that offers tools gets a call of the harness's own shell tool
              (picked from the advertised tools, arguments built from its schema), later
              turns get text, and JSON-schema requests (Gemini's router, Claude's title) get
              an object that fits the schema. Token ids are the bytes of the messages' JSON,
              so turn N's prompt extends turn N-1's as a real tokenizer's would; answer() may
              be overridden.

Every mode has vLLM's other endpoints: GET /v1/models (with max_model_len), POST /tokenize,
and the dev-mode ones a weight sync uses (/sleep, /wake_up, /is_sleeping, /collective_rpc
reload_weights, /reset_prefix_cache, /update_weight_version, GET /weight_info; 404 with
dev_mode=False). What it was asked is kept: bodies, tokenized, control, served, reloads.
down() closes its port and up() opens the same one again (a backend that goes away and comes
back); restart() is that with the state a new vLLM process starts with; outage(seconds, how)
is an outage in a thread (its port closed, or 503s), cutting the calls it holds then too."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson

SHELL_TOOLS = ("Bash", "bash", "run_shell_command", "exec_command", "shell_command", "shell", "local_shell")
MARKER = "polar-tool-ok"
COMMAND = f"echo {MARKER} > polar_proof.txt && cat polar_proof.txt"
MODES = ("ok", "500", "badjson", "odd", "context", "scripted")


def _fit(schema: dict):
    """A value that satisfies a (simple) JSON schema; upper-case Google types too."""
    t = str(schema.get("type", "object")).lower()
    if "enum" in schema:
        return schema["enum"][0]
    if t == "object":
        props = schema.get("properties") or {}
        return {k: _fit(v) for k, v in props.items()}
    return {"string": "ok", "integer": 1, "number": 1, "boolean": True, "array": []}.get(t, "ok")


def _args(schema: dict) -> dict:
    props = (schema or {}).get("properties") or {}
    out = {}
    for name in (schema or {}).get("required") or []:
        out[name] = _fit(props.get(name) or {})
    key = "cmd" if "cmd" in props else "command"
    out[key] = COMMAND
    return out


class FakeVLLM:
    def __init__(self, mode: str = "ok", delay: float = 0.0, max_model_len: int | None = None,
                 reload_delay: float = 0.0, dev_mode: bool = True):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        self.mode, self.delay = mode, delay
        self.max_model_len = max_model_len or (262144 if mode == "scripted" else 4096)
        self.model = "scripted" if mode == "scripted" else "fake-model"
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
        self.weight_version: str | None = "default"   # /update_weight_version's tag (vLLM starts with "default")
        self.restarts = 0
        self._conns: set = set()          # open client connections: they end with the "process"
        self.served_asleep = 0            # generation asked while asleep (must stay 0)
        self._ids = itertools.count(1)
        # an outage in progress: "refuse" (connections dropped, the port closed) or "503"
        self.failing: str | None = None
        self.outages: list[tuple[float, float, str]] = []   # (start, end, how), monotonic seconds
        self._handler = self._make_handler()
        self._httpd: ThreadingHTTPServer | None = None
        self._serving = False
        self._bind(0)
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    # ---- answers -------------------------------------------------------------------------

    def prompt_tokens(self, messages) -> int:
        """What /tokenize counts for these messages (and what max_model_len is checked on)."""
        if self.mode == "scripted":
            return len(self.prompt_ids(messages))
        return len(orjson.dumps(messages)) // 4 + 3

    @staticmethod
    def prompt_ids(messages) -> list[int]:
        """The scripted mode's prompt token ids: the bytes of the messages' JSON."""
        return list(orjson.dumps(messages))

    def answer(self, body: dict) -> dict:
        """The scripted mode's completion for a request body."""
        messages = body.get("messages") or []
        tools = {t["function"]["name"]: t["function"] for t in body.get("tools") or []}
        shell = next((n for n in SHELL_TOOLS if n in tools), None)
        had_result = any(m.get("role") == "tool" for m in messages)
        rf = body.get("response_format") or {}
        msg: dict = {"role": "assistant", "content": None}
        if rf.get("type") == "json_schema":
            msg["content"] = orjson.dumps(_fit(rf["json_schema"].get("schema") or {})).decode()
        elif shell and not had_result:
            args = _args(tools[shell].get("parameters") or {})
            msg["tool_calls"] = [{"id": f"call_{next(self._ids)}", "type": "function",
                                  "function": {"name": shell, "arguments": orjson.dumps(args).decode()}}]
        else:
            msg["content"] = "Done: the command printed " + (MARKER if had_result else "nothing") + "."
        text = msg["content"] or orjson.dumps(msg.get("tool_calls")).decode()
        out_ids = list(text.encode())[:64] + [0]
        prompt = self.prompt_ids(messages)
        return {"id": f"chatcmpl-{next(self._ids)}", "object": "chat.completion", "created": 1,
                "model": body.get("model", self.model), "prompt_token_ids": prompt,
                "choices": [{"index": 0, "message": msg,
                             "finish_reason": "tool_calls" if msg.get("tool_calls") else "stop",
                             "token_ids": out_ids,
                             "logprobs": {"content": [{"token": "x", "logprob": -0.1} for _ in out_ids]}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out_ids),
                          "total_tokens": len(prompt) + len(out_ids)}}

    def _completion(self, body: dict, weights) -> tuple[int, bytes]:
        if self.mode == "scripted":
            return 200, orjson.dumps(self.answer(body))
        n, wanted = self.prompt_tokens(body["messages"]), body.get("max_tokens")
        if self.mode == "ok" and wanted is not None and n + wanted > self.max_model_len:
            return 400, orjson.dumps({"error": {
                "message": f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. "
                           f"This model's maximum context length is {self.max_model_len} tokens "
                           f"and your request has {n} input tokens ({wanted} > "
                           f"{self.max_model_len} - {n}).",
                "type": "BadRequestError", "param": None, "code": 400}})
        if self.mode == "500":
            return 500, b'{"error":{"message":"engine crashed","type":"InternalServerError"}}'
        if self.mode == "badjson":
            return 200, b'{"choices": ['
        if self.mode == "odd":  # valid JSON, not a completion
            return 200, b'{"choices": [{"message": null}]}'
        if self.mode == "context":
            return 400, b'{"error":{"message":"This model\'s maximum context length is 8192 tokens","type":"BadRequestError"}}'
        return 200, orjson.dumps({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": self.model,
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok" if weights == "base" else f"ok {weights}"},
                         "finish_reason": "stop", "token_ids": [7, 2],
                         "logprobs": {"content": [{"token": "ok", "logprob": -0.5},
                                                  {"token": "</s>", "logprob": -0.1}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

    # ---- the server ----------------------------------------------------------------------

    def _make_handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                with fake.lock:
                    fake._conns.add(self.connection)

            def finish(self):
                with fake.lock:
                    fake._conns.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass
            disable_nagle_algorithm = True  # headers and body go out as separate writes

            def log_message(self, *a):
                pass

            def _send(self, status, body: bytes):
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the proxy gave up on this call (its harness timed out)

            def _failing(self) -> bool:
                """During an outage: the connection dropped (refuse) or a 503, as a crashed
                or overloaded vLLM would; True when it answered so."""
                if fake.failing == "refuse":
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return True
                if fake.failing == "503":
                    self._send(503, b'{"error":{"message":"the engine is not ready","type":"ServiceUnavailable"}}')
                    return True
                return False

            def do_GET(self):
                if self._failing():
                    return
                if self.path == "/is_sleeping":
                    self._send(200, orjson.dumps({"is_sleeping": bool(fake.sleeping)}))
                elif self.path == "/weight_info" and fake.dev_mode:
                    self._send(200, orjson.dumps({"weight_version": fake.weight_version}))
                elif self.path == "/v1/models":
                    self._send(200, orjson.dumps({"object": "list", "data": [
                        {"id": fake.model, "max_model_len": fake.max_model_len}]}))
                else:
                    self._send(404, b'{"detail":"Not Found"}')

            def do_POST(self):
                body = orjson.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                if self._failing():
                    return
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
                    if self.path == "/update_weight_version":
                        fake.weight_version = body.get("new_version")
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
                    n = fake.prompt_tokens(body.get("messages") or [])
                    tokens = [] if fake.mode == "scripted" else list(range(n))
                    return self._send(200, orjson.dumps({"count": n, "max_model_len": fake.max_model_len,
                                                         "tokens": tokens}))
                fake.bodies.append(body)
                if fake.sleeping or fake.weights is None:
                    fake.served_asleep += 1
                    return self._send(500, b'{"error":{"message":"asleep","type":"InternalServerError"}}')
                t0, weights = time.monotonic(), fake.weights
                time.sleep(fake.delay)
                if self._failing():     # the outage began while it generated: lost with it
                    return
                with fake.lock:
                    fake.served.append((t0, time.monotonic(), weights, fake.weights))
                self._send(*fake._completion(body, weights))

        return Handler

    def _bind(self, port: int) -> None:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler)
        self._httpd.daemon_threads = True

    def up(self) -> "FakeVLLM":
        """Serves (again, on the same port after down())."""
        if self._httpd is None:
            self._bind(self.port)
        if not self._serving:
            httpd = self._httpd
            threading.Thread(target=lambda: httpd.serve_forever(poll_interval=0.05), daemon=True).start()
            self._serving = True
        return self

    def outage(self, seconds: float, how: str = "refuse") -> threading.Thread:
        """The backend is unavailable for `seconds`, then serves again, in a thread (returned:
        join it to wait for the end). how: "refuse" closes its port and drops the connections
        open to it (a killed server: connection refused); "503" answers every request 503 (up,
        but not serving). Either way the completions it is generating then are lost. The window
        is kept in self.outages."""
        if how not in ("refuse", "503"):
            raise ValueError(f"unknown outage {how!r}: refuse or 503")

        def run():
            t0 = time.monotonic()
            self.failing = how
            if how == "refuse":
                self.down()
            time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
            if how == "refuse":
                self.up()
            self.failing = None
            self.outages.append((t0, time.monotonic(), how))

        t = threading.Thread(target=run, name="fake-vllm-outage", daemon=True)
        t.start()
        return t

    def down(self) -> None:
        """Stops serving and closes the port: connections are refused until up()."""
        if self._httpd is not None:
            if self._serving:
                self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd, self._serving = None, False
        with self.lock:      # a server that goes away takes its connections with it
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def restart(self, pause: float = 0.0) -> None:
        """Like a restarted vLLM: down, then up on the same port serving its start-up weights
        ("base"), untagged, awake."""
        self.down()
        time.sleep(pause)
        with self.lock:
            self.weights, self.weight_version, self.sleeping = "base", "default", set()
            self.restarts += 1
        self.up()

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
