"""The mitmproxy addon: model calls of any harness go to vLLM and come back in the
harness's own API format; every call is recorded in DuckDB before it is answered.

Thin glue: the adapters translate, the store writes, this file moves bytes between them.
Everything is answered from here (connection_strategy=lazy, upstream_cert=false), so
nothing a harness sends ever reaches the outside."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import time
import uuid
import zlib

import httpx
import orjson
import zstandard
from mitmproxy import ctx, exceptions, http
from mitmproxy.proxy import commands, events, layer, mode_specs
from mitmproxy.proxy.layers import DNSLayer, RawQuicLayer, TCPLayer, UDPLayer
from mitmproxy.utils import human

from polar_mitm import adapters
from polar_mitm.adapters import backend
from polar_mitm.adapters.chat import AdapterError
from polar_mitm.adapters.detect import is_count_tokens, split_path
from polar_mitm.store import CallWriter

from . import sessions

log = logging.getLogger("polar")

_JSON = {"content-type": "application/json"}
HEALTH_PATH = "/_polar/health"


class BackendUnavailable(AdapterError):
    status, kind = 503, "overloaded"


class BackendTimeout(AdapterError):
    status, kind = 504, "timeout"


class BodyTooLarge(AdapterError):
    status, kind = 413, "too_large"


def parse_overrides(text: str) -> dict:
    """--set polar_sampling=temperature=1.0,max_tokens=512"""
    out = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise exceptions.OptionsError(f"polar_sampling: expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = orjson.loads(value)
        except orjson.JSONDecodeError:
            out[key.strip()] = value
    return out


class PolarGateway:
    def __init__(self):
        self.writer: CallWriter | None = None
        self.client: httpx.AsyncClient | None = None
        self.overrides: dict = {}
        self._proxy_users: dict[str, str] = {}   # client connection id -> proxy-auth user
        self._served_model: str | None = None
        self._max_model_len: int | None = None   # from the backend's model list
        self._model_listed = False
        self._policy: tuple[float, str | None] = (0.0, None)
        self._slots: asyncio.Semaphore | None = None
        self._filters: dict[str, re.Pattern | None] = {}  # polar_model_hosts/_paths
        self.max_body = 64 * 1024 * 1024   # polar_max_body, in bytes
        # session -> (request text length, prompt tokens) of its last call: bounds the next prompt
        self._prompt_sizes: dict[str, tuple[int, int]] = {}
        self.calls = 0

    # ---- lifecycle ---------------------------------------------------------------------

    def load(self, loader):
        # httpx logs every backend request at INFO, httpcore at DEBUG (mitmproxy's log handler
        # builds every record): noise in mitmdump's log, and CPU under load.
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
        loader.add_option("polar_db", str, "rollouts.duckdb", "DuckDB file the calls are written to.")
        loader.add_option("polar_backend", str, "http://127.0.0.1:8000",
                          "Base URL of the vLLM OpenAI-compatible server.")
        loader.add_option("polar_served_model", str, "",
                          "Model name to ask the backend for (empty: the first one it serves).")
        loader.add_option("polar_session_key", str, "auto",
                          "How calls are attributed to sessions: auto (proxy user, then API "
                          "key, then client), proxy-user, api-key, client.",
                          choices=sessions.SCHEMES)
        # Plain strings, not Sequence[str]: mitmproxy 11 rejects repeated --set of a script's
        # sequence option ("Received multiple values"), and a failed addon load would let
        # traffic through to the real hosts.
        loader.add_option("polar_sampling", str, "",
                          "Sampling overrides sent to the backend, comma-separated KEY=VALUE "
                          "(JSON values), e.g. temperature=1.0,max_tokens=512; max_tokens "
                          "caps the harness's own value.")
        loader.add_option("polar_model_hosts", str, "",
                          "Regex of hosts whose API calls are model calls (empty: any host).")
        loader.add_option("polar_model_paths", str, "",
                          "Regex of request paths that may be model calls (empty: any path "
                          "the adapters recognise); other paths are answered locally.")
        loader.add_option("polar_backend_timeout", int, 600, "Seconds to wait for the backend.")
        loader.add_option("polar_max_concurrency", int, 0,
                          "Calls in flight to the backend at once (0: unlimited).")
        loader.add_option("polar_policy_version", str, "",
                          "Policy tag recorded when the backend reports no weight version.")
        loader.add_option("polar_max_body", str, "64m",
                          "Largest request body, as sent and once decompressed (e.g. 64m); "
                          "larger ones get a 413. Also caps mitmproxy's body_size_limit.")

    def configure(self, updated):
        # First, so that an invalid option below cannot leave a passthrough on.
        self._close_to_outside(updated)
        if "polar_max_body" in updated:
            try:
                limit = human.parse_size(ctx.options.polar_max_body)
            except ValueError:
                limit = None
            if not limit or limit <= 0:
                raise exceptions.OptionsError(
                    f"polar_max_body: expected a size like 64m, got {ctx.options.polar_max_body!r}")
            self.max_body = limit
        if ("polar_max_body" in updated or "body_size_limit" in updated) and "body_size_limit" in ctx.options:
            # mitmproxy stops reading a larger body itself (its own 413), so memory stays bounded.
            current = human.parse_size(ctx.options.body_size_limit)
            if current is None or current > self.max_body:
                ctx.options.body_size_limit = str(self.max_body)
        if "polar_sampling" in updated:
            self.overrides = parse_overrides(ctx.options.polar_sampling)
        for name in ("polar_model_hosts", "polar_model_paths"):
            if name in updated:
                try:
                    value = getattr(ctx.options, name)
                    self._filters[name] = re.compile(value) if value else None
                except re.error as e:
                    raise exceptions.OptionsError(f"{name}: {e}") from None
        if "polar_backend_timeout" in updated and ctx.options.polar_backend_timeout <= 0:
            raise exceptions.OptionsError("polar_backend_timeout must be > 0")
        if "polar_db" in updated and self.writer and self.writer.db_path != ctx.options.polar_db:
            self.writer.close()
            self.writer = None
        if "polar_served_model" in updated or "polar_backend" in updated:
            self._served_model = ctx.options.polar_served_model or None
            self._model_listed = False
        if {"polar_backend_timeout", "polar_max_concurrency"} & set(updated):
            self._drop_client()   # rebuilt with the new limits on the next call

    def _close_to_outside(self, updated):
        """Every answer is made here: never connect to the real hosts. Forced rather than
        refused, since a script whose configure fails stays loaded with these unset."""
        # rawtcp stays: it tells non-HTTP apart, and next_layer closes what it would relay.
        forced = {"connection_strategy": "lazy", "upstream_cert": False,
                  "stream_large_bodies": None,  # a streamed body goes to the server before `request`
                  "ignore_hosts": [], "allow_hosts": [], "tcp_hosts": [], "udp_hosts": []}
        for name, value in forced.items():
            if name in updated and getattr(ctx.options, name) != value:
                if name not in ("connection_strategy", "upstream_cert"):
                    log.warning("polar: %s would pass traffic to the outside; ignored", name)
                setattr(ctx.options, name, value)
        if "mode" in updated:
            for spec in ctx.options.mode:
                mode = mode_specs.ProxyMode.parse(spec)
                if not (isinstance(mode, (mode_specs.RegularMode, mode_specs.Socks5Mode))
                        or isinstance(mode, mode_specs.ReverseMode) and mode.scheme in ("http", "https")):
                    raise exceptions.OptionsError(
                        f"mode {spec}: polar-mitm answers HTTP itself and relays nothing; "
                        f"use regular, socks5 or reverse:http(s)://")

    def running(self):
        self._ensure_writer()

    def done(self):
        self._drop_client()
        if self.writer:
            self.writer.close()
            self.writer = None

    def _drop_client(self) -> None:
        client, self.client, self._slots = self.client, None, None
        if client is not None:
            try:
                asyncio.get_running_loop().create_task(client.aclose())
            except RuntimeError:   # no loop any more: its sockets go with the process
                pass

    def _ensure_writer(self) -> CallWriter:
        if self.writer is None:
            self.writer = CallWriter(ctx.options.polar_db).start()
        return self.writer

    def _http(self) -> httpx.AsyncClient:
        if self.client is None:
            limit = ctx.options.polar_max_concurrency or None
            self.client = httpx.AsyncClient(
                timeout=httpx.Timeout(ctx.options.polar_backend_timeout, connect=10),
                limits=httpx.Limits(max_connections=limit, max_keepalive_connections=32),
                trust_env=False)  # the backend is never reached through a proxy
            if ctx.options.polar_max_concurrency:
                self._slots = asyncio.Semaphore(ctx.options.polar_max_concurrency)
        return self.client

    # ---- hooks -------------------------------------------------------------------------

    def http_connect(self, flow: http.HTTPFlow):
        # In regular mode the proxy-auth user rides on CONNECT, not on the inner requests.
        user = sessions.proxy_user(flow.request.headers.get("proxy-authorization"))
        if user:
            self._proxy_users[flow.client_conn.id] = user

    def client_disconnected(self, client):
        self._proxy_users.pop(client.id, None)

    def next_layer(self, nextlayer: layer.NextLayer):
        """The fail-closed backstop: whatever the options say, a raw TCP/UDP/DNS/QUIC relay
        (passthrough, non-HTTP after CONNECT or inside TLS) is replaced by a local close."""
        if nextlayer.layer is None:
            # Scripts run before mitmproxy's own next_layer addon: decide with it, then check.
            builtin = ctx.master.addons.get("nextlayer")
            if builtin is None:
                return
            builtin.next_layer(nextlayer)
        child = nextlayer.layer
        while child is not None:
            if isinstance(child, (TCPLayer, UDPLayer, DNSLayer, RawQuicLayer)):
                log.info("polar: refused a %s connection to %s (nothing is relayed)",
                         type(child).__name__, nextlayer.context.server.address)
                nextlayer.layer = _Refused(nextlayer.context)
                return
            child = getattr(child, "child_layer", None)

    def server_connect(self, data):
        # The last line: mitmproxy itself never connects anywhere (the backend is reached with
        # httpx), so any server connection it would open, lookup included, is cancelled here.
        data.server.error = "polar-mitm relays nothing to the outside"

    async def error(self, flow: http.HTTPFlow):
        # mitmproxy stopped reading a body over body_size_limit and answered 413 itself.
        if (flow.response is None and flow.error and "body_size_limit" in flow.error.msg
                and self._may_be_model_call(flow.request)):
            style = adapters.detect(flow.request.method, flow.request.path, dict(flow.request.headers))
            if style:
                await self._model_call(flow, style, BodyTooLarge(
                    f"request body is larger than polar_max_body ({self.max_body} bytes)"))
                flow.response = None   # the client got mitmproxy's answer, not this one

    async def request(self, flow: http.HTTPFlow):
        if flow.response is not None:
            return
        try:
            await self._route(flow)
        except Exception:  # a bug must never let the request through to the real host
            log.exception("polar: unexpected error")
            if flow.response is None:
                flow.response = http.Response.make(  # Python's text stays in the log
                    500, orjson.dumps({"error": {"message": "polar-mitm internal error",
                                                 "type": "api_error"}}), _JSON)
        finally:
            # mitmdump prints the URL of every flow: a ?key= secret must not reach its log.
            flow.request.path = sessions.redact_query(flow.request.path)

    async def _route(self, flow: http.HTTPFlow):
        req = flow.request
        body, text = None, None
        if req.method == "POST":
            try:
                raw = _decoded_body(req, self.max_body) or b"null"
                text = raw.decode("utf-8", errors="replace")
                body = orjson.loads(raw)
            except AdapterError as e:  # too large or undecodable: answered as a failed call
                body = e
            except orjson.JSONDecodeError:
                body = None
        style = None
        if self._may_be_model_call(req) and not is_count_tokens(req.path):
            style = adapters.detect(req.method, req.path, dict(req.headers), body)
        if style and not _is_websocket(req):
            await self._model_call(flow, style, body, text)
        else:
            await self._local_answer(flow, body)

    # ---- model calls -------------------------------------------------------------------

    async def _model_call(self, flow: http.HTTPFlow, style: str, body, text: str | None = None):
        t0 = time.perf_counter()
        mod = adapters.adapter(style)
        req = flow.request
        session = self._session(flow, split_path(req.path)[1])
        record = {"call_id": str(uuid.uuid4()), "style": style, "method": req.method,
                  "path": sessions.redact_query(req.path), "started_at": time.time(),
                  # The harness's bytes as sent: the conversation is stored once, and its
                  # normalized form is what the pure adapters make of it.
                  "request_text": (f"<request body not kept: {body}>" if isinstance(body, AdapterError)
                                   else text if text is not None else ""),
                  "queue_ms": 0.0, "backend_ms": 0.0}
        try:
            status, content, headers = await self._serve(mod, body, req.path, record,
                                                         session["session_id"])
        except Exception as e:  # recorded like any failure; the harness gets its own error shape
            if not isinstance(e, AdapterError):
                log.exception("polar: unexpected error in a model call")
            status, kind = (e.status, e.kind) if isinstance(e, AdapterError) else (500, "backend_error")
            if kind == "overloaded":
                status = _overloaded_status(mod)
            # A bug's Python text goes to the log and the record, not to the harness.
            message = (str(e) or type(e).__name__) if isinstance(e, AdapterError) \
                else "polar-mitm internal error"
            answer = mod.error(status, message, kind)
            content, headers = orjson.dumps(answer), dict(_JSON)
            record.update(status_code=status, response_json=answer, error=str(e)[:2000] or repr(e),
                          error_kind=kind)
            if "prompt_token_ids" not in record:   # rejected before any tokens: keep a bounded head
                record["request_text"] = _bounded(record["request_text"])
        record["_t0"] = t0   # the writer stamps total_ms at the durable append the harness waits for
        try:
            await asyncio.wrap_future(self._ensure_writer().submit(session, record))
        except Exception as e:  # not recorded -> not acknowledged: the harness retries
            log.error("polar: could not record call: %s", e)
            status = _overloaded_status(mod)
            content = orjson.dumps(mod.error(status, f"recording failed: {e}", "overloaded"))
            headers = dict(_JSON)
        self.calls += 1
        flow.response = http.Response.make(status, content, headers)

    async def _serve(self, mod, body, path: str, record: dict,
                     session_id: str = "") -> tuple[int, bytes, dict]:
        """Translate, complete on the backend, answer in the client's format; fills record."""
        if isinstance(body, AdapterError):  # the body could not be read (too large, bad encoding)
            raise body
        if not isinstance(body, dict):
            raise AdapterError("request body must be a JSON object")
        if not _depth_ok(body):
            raise AdapterError(f"request body is nested deeper than {MAX_BODY_DEPTH} levels")
        normalized = mod.to_chat(body, path)
        record.update(stream=normalized["stream"], requested_model=normalized["model"],
                      dropped=normalized["dropped"])
        served = await self._served()
        backend_body = backend.to_backend(normalized, served, self.overrides, self._max_model_len)
        await self._fit_max_tokens(backend_body, session_id, len(record["request_text"]))
        # What vLLM got besides the conversation (sampling, max_tokens as fitted, template flags).
        record.update(served_model=served, backend_params={
            k: v for k, v in backend_body.items() if k not in ("messages", "tools")})
        q0 = time.perf_counter()
        if self._slots:
            await self._slots.acquire()
        try:
            b0 = time.perf_counter()
            record["queue_ms"] = (b0 - q0) * 1000
            (resp_json, prompt_ids), policy = await asyncio.gather(
                self._complete(backend_body), self._policy_version())
            record["backend_ms"] = (time.perf_counter() - b0) * 1000
        finally:
            if self._slots:
                self._slots.release()
        result, tokens = backend.from_backend(resp_json, normalized)
        answer = mod.from_chat(result, normalized)
        self._prompt_sizes[session_id] = (len(record["request_text"]), result["usage"]["prompt_tokens"])
        if len(self._prompt_sizes) > 10_000:
            self._prompt_sizes.pop(next(iter(self._prompt_sizes)))
        record.update(status_code=200, response_json=answer,
                      prompt_token_ids=prompt_ids or b"[]", token_ids=tokens["token_ids"],
                      logprobs=tokens["logprobs"], finish_reason=result["finish_reason"],
                      prompt_tokens=result["usage"]["prompt_tokens"],
                      completion_tokens=result["usage"]["completion_tokens"],
                      usage_json=result["usage"], policy_version=tokens["policy_version"] or policy)
        if normalized["stream"]:
            return 200, b"".join(mod.stream(result, normalized)), {
                "content-type": adapters.stream_content_type(normalized), "cache-control": "no-cache"}
        return 200, orjson.dumps(answer), dict(_JSON)

    async def _complete(self, backend_body: dict) -> tuple[dict, bytes | None]:
        """vLLM's answer, and its prompt token ids as JSON text."""
        url = ctx.options.polar_backend.rstrip("/") + "/v1/chat/completions"
        try:
            resp = await self._http().post(url, content=orjson.dumps(backend_body),
                                           headers=_JSON)
        except httpx.TimeoutException:
            raise BackendTimeout(f"the model backend did not answer within "
                                 f"{ctx.options.polar_backend_timeout}s") from None
        except httpx.HTTPError as e:
            raise BackendUnavailable(f"the model backend is unavailable: {type(e).__name__}") from None
        if resp.status_code != 200:
            raise backend.backend_error(resp.status_code, resp.content)
        try:
            return backend.parse_completion(resp.content)
        except orjson.JSONDecodeError:
            raise backend.BackendError("the model backend answered with invalid JSON") from None

    async def _fit_max_tokens(self, body: dict, session_id: str, text_len: int) -> None:
        """Caps max_tokens at what the context leaves after the prompt: some vLLM versions
        refuse more (Claude Code asks for 64000). A token is at least one byte of the
        harness's request text, and a session's prompt grows by at most the bytes its text
        grows by, so the backend counts the prompt only when its size could matter."""
        limit, wanted = self._max_model_len, body.get("max_tokens")
        if not limit or not isinstance(wanted, int):
            return
        bound = text_len
        if session_id in self._prompt_sizes:
            last_len, last_tokens = self._prompt_sizes[session_id]
            bound = min(bound, last_tokens + max(0, text_len - last_len))
        # an image is a short URL or base64 that renders to many tokens
        if wanted + bound + TEMPLATE_SLACK <= limit and not _has_image(body):
            return
        try:
            count = await self._tokenize(body)
        except (AdapterError, httpx.HTTPError, ValueError) as e:  # the completion call will say more
            log.warning("polar: could not count prompt tokens, max_tokens left at %s: %s", wanted, e)
            return
        body["max_tokens"] = max(1, min(wanted, limit - count))

    async def _tokenize(self, backend_body: dict) -> int:
        """The prompt's token count from vLLM's /tokenize, rendered as the completion will be."""
        keys = ("model", "messages", "tools", "add_generation_prompt", "continue_final_message")
        tok = {k: backend_body[k] for k in keys if k in backend_body}
        resp = await self._http().post(ctx.options.polar_backend.rstrip("/") + "/tokenize",
                                       content=orjson.dumps(tok), headers=_JSON)
        if resp.status_code != 200:
            raise backend.backend_error(resp.status_code, resp.content)
        return int(orjson.loads(resp.content).get("count", 0))

    async def _served(self) -> str:
        if self._model_listed:
            return self._served_model
        url = ctx.options.polar_backend.rstrip("/") + "/v1/models"
        try:
            resp = await self._http().get(url, timeout=10)
            models = resp.json()["data"]
            wanted = self._served_model or models[0]["id"]
            entry = next((m for m in models if m["id"] == wanted), models[0])
            self._max_model_len = entry.get("max_model_len")
            self._served_model = wanted
            self._model_listed = True
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            raise BackendUnavailable("the model backend is unavailable (no model list)") from None
        return self._served_model

    async def _policy_version(self) -> str | None:
        """The backend's weight version (vLLM dev-mode /weight_info), refreshed each second."""
        fetched_at, value = self._policy
        if time.monotonic() - fetched_at < 1.0:
            return value
        value = ctx.options.polar_policy_version or None
        try:
            resp = await self._http().get(ctx.options.polar_backend.rstrip("/") + "/weight_info",
                                          timeout=2)
            if resp.status_code == 200:
                reported = resp.json().get("weight_version")
                value = str(reported) if reported is not None else value
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        self._policy = (time.monotonic(), value)
        return value

    def _session(self, flow: http.HTTPFlow, query: str) -> dict:
        user = self._proxy_users.get(flow.client_conn.id) or sessions.proxy_user(
            flow.request.headers.get("proxy-authorization"))
        return sessions.attribute(headers=dict(flow.request.headers), query=query,
                                  proxy_auth_user=user,
                                  client_host=flow.client_conn.peername[0] if flow.client_conn.peername else "unknown",
                                  salt=self._ensure_writer().salt,
                                  scheme=ctx.options.polar_session_key)

    def _may_be_model_call(self, req: http.Request) -> bool:
        hosts, paths = self._filters.get("polar_model_hosts"), self._filters.get("polar_model_paths")
        return ((hosts is None or bool(hosts.search(req.pretty_host)))
                and (paths is None or bool(paths.search(split_path(req.path)[0]))))

    # ---- everything else ---------------------------------------------------------------

    async def _local_answer(self, flow: http.HTTPFlow, body):
        """Telemetry, feature flags, model lists, WebSocket attempts: answered at once so
        harness runs never hang, and never forwarded."""
        req = flow.request
        path, _ = split_path(req.path)
        if path == HEALTH_PATH:  # launchers check that the addon is loaded and answering
            flow.response = http.Response.make(200, orjson.dumps(
                {"polar": "ok", "db": ctx.options.polar_db, "calls": self.calls}), _JSON)
        elif _is_websocket(req):
            # Codex tries Responses-over-WebSocket first and falls back to HTTPS on 404.
            flow.response = http.Response.make(404, b'{"error": "websocket transport not offered"}', _JSON)
        elif req.method == "POST" and is_count_tokens(path) and isinstance(body, dict):
            flow.response = await self._count_tokens(req, body)
        elif req.method == "GET" and path.endswith("/models"):
            flow.response = http.Response.make(200, orjson.dumps(await self._model_list(path)), _JSON)
        elif req.method in ("HEAD", "OPTIONS"):
            flow.response = http.Response.make(200, b"")
        elif req.method == "GET":
            flow.response = http.Response.make(404, b'{"error": "not found"}', _JSON)
        else:
            flow.response = http.Response.make(204, b"")

    async def _model_list(self, path: str) -> dict:
        try:
            name = await self._served()
        except AdapterError:
            name = "unavailable"
        if "/backend-api/codex/" in path:
            return {"models": []}  # Codex falls back to its built-in model metadata
        if "/v1beta/" in path:
            return {"models": [{"name": f"models/{name}", "displayName": name,
                                "supportedGenerationMethods": ["generateContent"]}]}
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "polar-mitm"}]}

    async def _count_tokens(self, req: http.Request, body: dict) -> http.Response:
        style = "google" if ":countTokens" in req.path else "anthropic"
        mod = adapters.adapter(style)
        try:
            if style == "google":
                normalized = mod.to_chat(body.get("generateContentRequest") or body,
                                         req.path.replace(":countTokens", ":generateContent"))
            else:
                normalized = mod.to_chat({"max_tokens": 1, **body})
            served = await self._served()
            count = await self._tokenize(backend.to_backend(normalized, served))
        except AdapterError as e:
            return http.Response.make(e.status, orjson.dumps(mod.error(e.status, str(e), e.kind)), _JSON)
        except httpx.HTTPError:
            status = _overloaded_status(mod)
            return http.Response.make(status, orjson.dumps(
                mod.error(status, "the model backend is unavailable", "overloaded")), _JSON)
        answer = {"totalTokens": count} if style == "google" else {"input_tokens": count}
        return http.Response.make(200, orjson.dumps(answer), _JSON)


class _Refused(layer.Layer):
    """Stands in for a relay layer: closes the client connection and opens nothing."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)


def _overloaded_status(mod) -> int:
    # Anthropic clients retry 529 (overloaded); the other providers use 503.
    return getattr(mod, "OVERLOADED_STATUS", 503)


def _has_image(body: dict) -> bool:
    return any(isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in body["messages"])


def _is_websocket(req: http.Request) -> bool:
    return req.headers.get("upgrade", "").lower() == "websocket"


# Bytes a chat template adds around the messages (roles, tool instructions); the messages'
# JSON is otherwise longer than their rendered text.
TEMPLATE_SLACK = 4096

MAX_BODY_DEPTH = 200   # orjson writes 254 levels at most; no real request comes near


def _depth_ok(value, limit: int = MAX_BODY_DEPTH) -> bool:
    """Iteratively, so a hostile body cannot exhaust the stack."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return False
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return True


def _decoded_body(req: http.Request, limit: int) -> bytes:
    """The body as its content-encoding says, never more than limit bytes, decompressed a
    piece at a time: mitmproxy's get_content() would expand a gzip bomb whole."""
    data = req.raw_content or b""
    codings = [c.strip().lower() for c in req.headers.get("content-encoding", "").split(",")]
    for coding in reversed([c for c in codings if c and c != "identity"]):
        if len(data) > limit:
            break
        try:
            if coding in ("gzip", "x-gzip", "deflate"):
                data = _inflate(data, coding, limit)
            elif coding == "zstd":
                reader = zstandard.ZstdDecompressor(max_window_size=1 << 25).stream_reader(io.BytesIO(data),
                                                                     read_across_frames=True)
                out = bytearray()
                while chunk := reader.read(min(1 << 20, limit + 1 - len(out))):
                    out += chunk
                    if len(out) > limit:
                        raise BodyTooLarge(f"request body is larger than polar_max_body ({limit} bytes)")
                data = bytes(out)
            else:  # br has no bounded decoder here; no harness compresses requests with it
                raise AdapterError(f"content-encoding {coding!r} is not accepted for requests",
                                   status=415)
        except (zlib.error, zstandard.ZstdError) as e:
            raise AdapterError(f"the request body is not valid {coding}: {e}") from None
    if len(data) > limit:
        raise BodyTooLarge(f"request body is larger than polar_max_body ({limit} bytes)")
    return data


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    # deflate comes zlib-wrapped or raw (as mitmproxy accepts); gzip may have several members
    if coding == "deflate":
        wbits = 15 if len(data) > 1 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0 else -15
    else:
        wbits = 31
    out, d = bytearray(), zlib.decompressobj(wbits)
    while True:
        out += d.decompress(data, limit + 1 - len(out))   # at most what would still fit, plus one
        if len(out) > limit:
            raise BodyTooLarge(f"request body is larger than polar_max_body ({limit} bytes)")
        data = d.unconsumed_tail
        if not data and d.eof and d.unused_data and wbits == 31:
            data, d = d.unused_data, zlib.decompressobj(wbits)
        elif not data:
            break
    if not d.eof:
        raise zlib.error("truncated stream")
    return bytes(out)


REJECTED_TEXT_CHARS = 1 << 20


def _bounded(text: str) -> str:
    """A call rejected before the model saw it keeps the first MiB of its body: enough to
    see what was wrong, while a huge bad body cannot grow the database by its size."""
    if len(text) <= REJECTED_TEXT_CHARS:
        return text
    return text[:REJECTED_TEXT_CHARS] + f"\n<{len(text) - REJECTED_TEXT_CHARS} more characters not kept>"


addons = [PolarGateway()]
