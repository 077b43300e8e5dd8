"""The stand-in for vLLM's HTTP API, for tests and scripts that do not need the real server
(everything that checks real tokens runs against it: the vllm_backend fixture). One class,
FakeVLLM; its `mode` says how it answers /v1/chat/completions:

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
              so turn N's prompt extends turn N-1's as a real tokenizer's would; answer() (and
              prompt_ids, tokenize) may be overridden: the benchmarks' realistic traffic
              (scripts/workload.py) and the tests' own templates do.

Every mode answers through vLLM's token route too (token_route=True, as vLLM with
--enable-scale-out): /v1/chat/completions/render, /inference/v1/generate (the same completion,
sampled token by token: each token labelled with the weight version in force then, in
weight_versions spans; /pause?mode=keep holds a request at its next token and /resume lets it
go on, its later tokens the new weights', with logprob_under's logprobs) and
/v1/chat/completions/derender. token_route=False answers them 403, as vLLM without the flag.

Every mode has vLLM's other endpoints: GET /v1/models (with max_model_len), POST /tokenize,
and the dev-mode ones a weight sync uses (/sleep, /wake_up, /is_sleeping, /collective_rpc
reload_weights, /reset_prefix_cache, /update_weight_version, GET /weight_info; 404 with
dev_mode=False); GET /_fake/counts says how many requests each path had. What it was asked
is kept (keep=False: only counted, for long benchmarks): bodies, tokenized, control, served,
reloads.

respond() is the whole answer to a request; the transport is the caller's choice. By default
the stand-in serves from a thread of the caller's process: down() closes its port and up()
opens the same one again (a backend that goes away and comes back); restart() is that with
the state a new vLLM process starts with; outage(seconds, how) is an outage in a thread (its
port closed, or 503s), cutting the calls it holds then too. listen=False opens no port: a
benchmark serves respond() from an asyncio server in a process of its own
(scripts/workload.py serve)."""

from __future__ import annotations

import itertools
import socket
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson

SHELL_TOOLS = ("Bash", "bash", "run_shell_command", "exec_command", "shell_command", "shell", "local_shell")
MARKER = "polar-tool-ok"
COMMAND = f"echo {MARKER} > polar_proof.txt && cat polar_proof.txt"
MODES = ("ok", "500", "badjson", "odd", "context", "scripted")
ASLEEP = b'{"error":{"message":"asleep","type":"InternalServerError"}}'
NOT_FOUND = b'{"detail":"Not Found"}'
CONTEXT_ERROR = b'{"error":{"message":"This model\'s maximum context length is 8192 tokens","type":"BadRequestError"}}'
SCALE_OUT_DISABLED = (b'{"error":{"message":"Scale-out endpoints are disabled. Restart vllm serve with '
                      b'--enable-scale-out to enable them.","type":"PermissionDeniedError","code":403}}')


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


class _Server(ThreadingHTTPServer):
    # a backlog for bursts of new connections (the token route's three requests a call at 64
    # clients); socketserver's default of 5 drops the rest under load
    request_queue_size = 256


class Dropped(Exception):
    """The request is not answered: its connection is dropped (an outage that refuses)."""


class FakeVLLM:
    def __init__(self, mode: str = "ok", delay: float = 0.0, max_model_len: int | None = None,
                 reload_delay: float = 0.0, dev_mode: bool = True, model: str | None = None,
                 keep: bool = True, listen: bool = True, token_route: bool = True):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        self.mode, self.delay, self.keep = mode, delay, keep
        self.max_model_len = max_model_len or (262144 if mode == "scripted" else 4096)
        self.model = model or ("scripted" if mode == "scripted" else "fake-model")
        self.bodies: list[dict] = []
        self.tokenized: list[dict] = []   # /tokenize bodies
        self.counts: dict[str, int] = {}  # requests by path (and "connections opened", by the transport)
        # weights as vLLM's dev-mode endpoints change them: the answer says which served it
        self.weights: str | None = "base"
        self.reload_delay, self.dev_mode = reload_delay, dev_mode
        # set by a test that needs a reload to last until something happened (then .set())
        self.reload_gate: threading.Event | None = None
        self.served: list[tuple[float, float, str | None, str | None]] = []   # (start, end, weights then, after)
        self.reloads: list[tuple[float, float, str]] = []       # (start, end, weights path)
        self.lock = threading.Lock()
        self.reloading = False
        self.control: list[str] = []      # dev-mode calls, in order (path with query)
        self.rpcs: list[tuple[str, dict]] = []   # /collective_rpc (method, kwargs), in order
        # fetch_pulls: a pull's URL is fetched and its sha256 checked, as the worker extension does
        self.fetch_pulls = False
        self.pulled: list[tuple[str, int]] = []  # (sha256, bytes) of the blobs it fetched
        self.sleeping: set[str] = set()   # what sleeps: "weights", "kv_cache"
        self.weight_version: str | None = "default"   # /update_weight_version's tag (vLLM starts with "default")
        self.restarts = 0
        self.ranks: list[tuple[str, str]] = []   # (path, X-data-parallel-rank) of requests that named one
        self._conns: set = set()          # open client connections: they end with the "process"
        self.served_asleep = 0            # generation asked while asleep (must stay 0)
        self._ids = itertools.count(1)
        # vLLM's token route (--enable-scale-out): render -> /inference/v1/generate -> derender;
        # without it those answer 403, as vLLM 0.32 does without the flag
        self.token_route = token_route
        self._rendered: dict[str, dict] = {}      # request_id -> the chat body it was rendered from
        self._generated: dict[str, dict] = {}     # request_id -> the chat completion it sampled
        self._answers: dict[str, tuple[int, bytes]] = {}   # request_id -> the completion render made
        self.unpaused = threading.Event()         # /pause?mode=keep clears it: tokens wait
        self.unpaused.set()
        # an outage in progress: "refuse" (connections dropped, the port closed) or "503"
        self.failing: str | None = None
        self.outages: list[tuple[float, float, str]] = []   # (start, end, how), monotonic seconds
        self._handler = self._make_handler()
        self._httpd: ThreadingHTTPServer | None = None
        self._serving = False
        self.port: int | None = None
        self.url = ""
        if listen:
            self._bind(0)
            assert self._httpd is not None
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

    def tokenize(self, body: dict) -> dict:
        """/tokenize's answer: the messages' token count (prompt_tokens) and the context length."""
        n = self.prompt_tokens(body.get("messages") or [])
        return {"count": n, "max_model_len": self.max_model_len,
                "tokens": [] if self.mode == "scripted" else list(range(n))}

    def completion(self, body: dict, msg: dict, out_ids: list[int], prompt: list[int],
                   logprob: float = -0.1) -> dict:
        """vLLM's chat.completion with its token fields: `msg` sampled as out_ids (each at
        `logprob`) after the prompt's ids."""
        return {"id": f"chatcmpl-{next(self._ids)}", "object": "chat.completion", "created": 1,
                "model": body.get("model", self.model), "prompt_token_ids": prompt,
                "choices": [{"index": 0, "message": msg,
                             "finish_reason": "tool_calls" if msg.get("tool_calls") else "stop",
                             "token_ids": out_ids,
                             "logprobs": {"content": [{"token": "x", "logprob": logprob} for _ in out_ids]}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out_ids),
                          "total_tokens": len(prompt) + len(out_ids)}}

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
        return self.completion(body, msg, list(text.encode())[:64] + [0], self.prompt_ids(messages))

    def _completion(self, body: dict, weights) -> tuple[int, bytes]:
        if self.mode == "scripted":
            return 200, orjson.dumps(self.answer(body))
        if (too_long := self._too_long(body)) is not None:
            return too_long
        if self.mode == "500":
            return 500, b'{"error":{"message":"engine crashed","type":"InternalServerError"}}'
        if self.mode == "badjson":
            return 200, b'{"choices": ['
        if self.mode == "odd":  # valid JSON, not a completion
            return 200, b'{"choices": [{"message": null}]}'
        if self.mode == "context":
            return 400, CONTEXT_ERROR
        return 200, orjson.dumps({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": self.model,
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok" if weights == "base" else f"ok {weights}"},
                         "finish_reason": "stop", "token_ids": [7, 2],
                         "logprobs": {"content": [{"token": "ok", "logprob": -0.5},
                                                  {"token": "</s>", "logprob": -0.1}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

    def _too_long(self, body: dict) -> tuple[int, bytes] | None:
        """The "ok" mode's refusal of prompt + max_tokens past max_model_len (None: it fits)."""
        n, wanted = self.prompt_tokens(body.get("messages") or []), body.get("max_tokens")
        if self.mode == "ok" and wanted is not None and n + wanted > self.max_model_len:
            return 400, orjson.dumps({"error": {
                "message": f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. "
                           f"This model's maximum context length is {self.max_model_len} tokens "
                           f"and your request has {n} input tokens ({wanted} > "
                           f"{self.max_model_len} - {n}).",
                "type": "BadRequestError", "param": None, "code": 400}})
        return None

    # ---- a request ---------------------------------------------------------------------

    def respond(self, method: str, path: str, raw: bytes) -> tuple[int, bytes]:
        """The answer to one request: (status, JSON body). It blocks while it "generates"
        (delay) or reloads (reload_delay); raises Dropped where the connection is dropped."""
        route, _, query = path.partition("?")
        with self.lock:
            self.counts[route] = self.counts.get(route, 0) + 1
        if (busy := self._outage()) is not None:
            return busy
        if method == "GET":
            return self._get(route)
        try:
            body = orjson.loads(raw or b"{}")
        except orjson.JSONDecodeError:
            return 400, b'{"error":{"message":"invalid JSON","type":"BadRequestError"}}'
        if route in ("/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version"):
            return self._dev_call(route, path, query, body) if self.dev_mode else (404, NOT_FOUND)
        if route in ("/pause", "/resume"):
            return self._pause(route, path, query) if self.dev_mode else (404, NOT_FOUND)
        if route == "/tokenize":
            if self.keep:
                self.tokenized.append(body)
            return 200, orjson.dumps(self.tokenize(body))
        if route in TOKEN_ROUTES:
            if not self.token_route:
                return 403, SCALE_OUT_DISABLED
            return TOKEN_ROUTES[route](self, body)
        return self._generate(body)

    # ---- the token route ---------------------------------------------------------------

    @staticmethod
    def logprob_under(weights: str | None, logprob: float) -> float:
        """A token's logprob under `weights`: the answer's own under "base", shifted by an
        amount of each checkpoint's own otherwise (what a re-score under them gives)."""
        return logprob if weights in (None, "base") else logprob - 0.1 * (1 + zlib.crc32(weights.encode()) % 9)

    def _render(self, body: dict) -> tuple[int, bytes]:
        """/v1/chat/completions/render: the prompt's ids (the ones the completion records) and
        the sampling params; the chat body is kept for generate under the request id."""
        # the completion is made once, here (answer() and _completion() may be overridden:
        # each is asked once a call), and generate samples what it said; a request's own error
        # (its context) is refused as it is rendered, the engine's comes from generate
        status, content = self._completion(body, self.weights or "base")
        if status == 400:
            return status, content
        try:
            prompt = orjson.loads(content).get("prompt_token_ids") or [1]
        except (orjson.JSONDecodeError, AttributeError):    # badjson, odd: they fail at generate
            prompt = [1, 2, 3]
        rid = f"chatcmpl-fake-{next(self._ids)}"
        with self.lock:
            self._rendered[rid] = body
            self._answers[rid] = (status, content)
        sampling = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed")
                    if k in body}
        return 200, orjson.dumps({"request_id": rid, "token_ids": prompt, "features": None,
                                  "sampling_params": {**sampling, "logprobs": 0}, "model": body.get("model"),
                                  "output_mode": "tokens", "stream": False})

    def _token_generate(self, req: dict) -> tuple[int, bytes]:
        """/inference/v1/generate: the completion sampled token by token, each labelled with
        the weight version in force when it was sampled (a /pause?mode=keep holds the request
        at its next token; its later tokens are the new weights', as vLLM's engine does)."""
        rid = req.get("request_id")
        with self.lock:
            body = self._rendered.pop(rid, None)
        if body is None:
            return 400, b'{"error":{"message":"unknown request_id (render it first)","type":"BadRequestError"}}'
        if (refused := self._asked(body)) is not None:
            return refused
        t0, weights = time.monotonic(), self.weights
        with self.lock:
            made = self._answers.pop(rid, None)
        status, content = made if made is not None else self._completion(body, weights)
        if self.mode == "ok" and status == 200:      # "ok <weights>": the weights generate starts with
            chat = orjson.loads(content)
            chat["choices"][0]["message"]["content"] = "ok" if weights == "base" else f"ok {weights}"
            content = orjson.dumps(chat)
        if status != 200 or self.mode in ("badjson", "odd"):     # the engine's failure, after its time
            if self.delay:
                time.sleep(self.delay)
            return status, content
        chat = orjson.loads(content)
        choice = chat["choices"][0]
        ids = choice["token_ids"]
        base = [t["logprob"] for t in choice["logprobs"]["content"]]
        labels: list[str | None] = []
        logprobs = []
        for j in range(len(ids)):
            self.unpaused.wait(60)
            labels.append(self.weight_version)
            logprobs.append(self.logprob_under(self.weights, base[j]))
            if self.delay:
                time.sleep(self.delay / len(ids))
            if (busy := self._outage()) is not None:
                return busy
        if self.keep:
            with self.lock:
                self.served.append((t0, time.monotonic(), weights, self.weights))
        spans: list[dict] = []
        for j, label in enumerate(labels):
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = j + 1
            else:
                spans.append({"version": label, "start": j, "end": j + 1})
        with self.lock:
            self._generated[f"generate-tokens-{rid}"] = chat
        return 200, orjson.dumps({
            "request_id": f"generate-tokens-{rid}", "model": chat.get("model"), "created": 1,
            "usage": chat.get("usage"), "output_mode": "tokens", "prompt_token_ids": None,
            "choices": [{"index": 0, "finish_reason": "length" if choice["finish_reason"] == "length" else "stop",
                         "stop_reason": None, "token_ids": ids, "weight_versions": spans,
                         "logprobs": {"content": [{"token_id": t, "logprob": lp, "rank": 1}
                                                  for t, lp in zip(ids, logprobs)]}}]})

    def _derender(self, req: dict) -> tuple[int, bytes]:
        """/v1/chat/completions/derender: the message of the completion that was sampled."""
        generated = req.get("generate_response") or {}
        with self.lock:
            chat = self._generated.pop(generated.get("request_id"), None)
        if chat is None:
            return 400, b'{"error":{"message":"unknown generate_response","type":"BadRequestError"}}'
        choice = chat["choices"][0]
        return 200, orjson.dumps({"id": chat["id"], "object": "chat.completion", "created": 1, "model": chat["model"],
                                  "choices": [{"index": 0, "message": choice["message"], "logprobs": None,
                                               "finish_reason": choice["finish_reason"]}],
                                  "usage": chat.get("usage")})

    def _pause(self, route: str, path: str, query: str) -> tuple[int, bytes]:
        """/pause?mode=keep (requests wait at their next token) and /resume."""
        self.control.append(path)
        if route == "/pause":
            self.unpaused.clear()
            return 200, b'{"status":"paused"}'
        self.unpaused.set()
        return 200, b'{"status":"resumed"}'

    def _outage(self) -> tuple[int, bytes] | None:
        """During an outage: the connection dropped (refuse) or a 503, as a crashed or
        overloaded vLLM would."""
        if self.failing == "refuse":
            raise Dropped
        if self.failing == "503":
            return 503, b'{"error":{"message":"the engine is not ready","type":"ServiceUnavailable"}}'
        return None

    def _get(self, route: str) -> tuple[int, bytes]:
        if route == "/is_sleeping":
            return 200, orjson.dumps({"is_sleeping": bool(self.sleeping)})
        if route == "/weight_info" and self.dev_mode:
            return 200, orjson.dumps({"weight_version": self.weight_version})
        if route == "/v1/models":
            return 200, orjson.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm", "root": self.model,
                 "parent": None, "max_model_len": self.max_model_len, "permission": []}]})
        if route == "/_fake/counts":
            with self.lock:
                return 200, orjson.dumps(self.counts)
        return 404, NOT_FOUND

    def _dev_call(self, route: str, path: str, query: str, body: dict) -> tuple[int, bytes]:
        """vLLM's dev-mode endpoints: sleep and wake, and what a weight sync calls."""
        self.control.append(path)
        if route in ("/sleep", "/wake_up"):
            tags = [t.partition("=")[2] for t in query.split("&") if t.startswith("tags=")]
            if route == "/sleep":
                self.sleeping = {"weights", "kv_cache"}
                if "level=2" in query:
                    self.weights = None     # discarded: only a reload brings them back
            else:
                self.sleeping -= set(tags or ("weights", "kv_cache"))
            return 200, b"{}"
        if "weights" in self.sleeping:
            return 500, b'{"detail":"the weights sleep"}'
        if route == "/update_weight_version":
            self.weight_version = body.get("new_version")
        if route == "/collective_rpc":
            method, kwargs = body.get("method"), body.get("kwargs") or {}
            self.rpcs.append((method, kwargs))
            if method in ("polar_prefetch_weights", "polar_pull_weights") and self.fetch_pulls:
                if (failed := self._fetch(kwargs)) is not None:
                    return 500, orjson.dumps({"error": {"message": failed}})
            if method == "polar_prefetch_weights":     # the worker extension's (vllm_ext/weight_pull.py)
                return 200, b'{"results": [{"state": "ready"}]}'
            t0 = time.monotonic()
            self.reloading = True
            time.sleep(self.reload_delay)
            if self.reload_gate is not None:
                self.reload_gate.wait(30)
            self.weights = kwargs["url"] if method == "polar_pull_weights" else kwargs["weights_path"]
            self.reloading = False
            self.reloads.append((t0, time.monotonic(), self.weights))
        return 200, b'{"results": [null]}'

    def _fetch(self, kwargs: dict) -> str | None:
        """A pull's blob fetched and checked (None), or why it failed."""
        import hashlib
        import urllib.request

        try:
            with urllib.request.urlopen(kwargs["url"], timeout=30) as r:
                blob = r.read()
        except OSError as e:
            return f"the pull failed: {e}"
        if hashlib.sha256(blob).hexdigest() != kwargs["sha256"]:
            return "the pulled weights' sha256 does not match"
        self.pulled.append((kwargs["sha256"], len(blob)))
        return None

    def _asked(self, body: dict) -> tuple[int, bytes] | None:
        """A generation asked for (kept): refused while the weights sleep or are gone."""
        if self.keep:
            self.bodies.append(body)
        if self.sleeping or self.weights is None:
            self.served_asleep += 1
            return 500, ASLEEP
        return None

    def _generate(self, body: dict) -> tuple[int, bytes]:
        """A completion (any other POST path), by the weights it holds when it starts."""
        if (refused := self._asked(body)) is not None:
            return refused
        t0, weights = time.monotonic(), self.weights
        if self.delay:
            time.sleep(self.delay)
        if (busy := self._outage()) is not None:     # the outage began while it generated: lost with it
            return busy
        if self.keep:
            with self.lock:
                self.served.append((t0, time.monotonic(), weights, self.weights))
        return self._completion(body, weights)

    # ---- the server (a thread of this process) -------------------------------------------

    def _make_handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as separate writes

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

            def log_message(self, *a):
                pass

            def _answer(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else b""
                rank = self.headers.get("x-data-parallel-rank")
                if rank is not None:     # vLLM's data parallelism: the engine a request is pinned to
                    with fake.lock:
                        fake.ranks.append((self.path.partition("?")[0], rank))
                try:
                    status, body = fake.respond(method, self.path, raw)
                except Dropped:
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the proxy gave up on this call (its harness timed out)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

        return Handler

    def _bind(self, port: int) -> None:
        self._httpd = _Server(("127.0.0.1", port), self._handler)
        self._httpd.daemon_threads = True

    def up(self) -> "FakeVLLM":
        """Serves (again, on the same port after down())."""
        if self.port is None:
            raise RuntimeError("made with listen=False: its transport is the caller's")
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
            self.restarted_state()
            self.restarts += 1
        self.up()

    def __enter__(self):
        return self.up()

    def restarted_state(self) -> None:
        """What a new vLLM process starts with (restart() sets it)."""
        self.weights, self.weight_version, self.sleeping = "base", "default", set()
        self.unpaused.set()

    def __exit__(self, *exc):
        self.down()


TOKEN_ROUTES = {"/v1/chat/completions/render": FakeVLLM._render,
                "/inference/v1/generate": FakeVLLM._token_generate,
                "/v1/chat/completions/derender": FakeVLLM._derender}
