"""Model calls: a harness's API call goes to vLLM and comes back in the harness's own format,
recorded (durably appended to the call log) before it is answered.

Thin glue: the adapters translate, the BackendClient addon talks to vLLM, the Recorder addon
writes. Requests that are not model calls are left to the LocalAnswers addon."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import orjson
from mitmproxy import ctx, exceptions, http
from mitmproxy.addonmanager import Loader
from mitmproxy.utils import human

from polar_mitm import adapters
from polar_mitm.adapters import Adapter, backend
from polar_mitm.adapters.chat import AdapterError, ChatRequest
from polar_mitm.adapters.detect import is_count_tokens, split_path
from polar_mitm.store import SessionInfo

from . import option_values, sessions
from .backend_client import BackendClient, Completion
from .bodies import BodyTooLarge, decoded_body, depth_ok, has_image, header_dict, is_websocket, MAX_BODY_DEPTH
from .call_outcome import Answer, Dispatch, Failed, Outcome, RequestFacts, Served, Waits, call_record
from .control import Control
from .http_json import JSON_HEADERS, internal_error
from .policy_gate import PolicyGate, Ticket
from .proxy_users import ProxyUsers
from .recorder import Recorder
from .relay import StreamRelay
from .request_failures import DEFAULT_WINDOW_S, REQUEST_FAILED, BackendWitness
from .session_slots import DEFAULT_MAX_INFLIGHT, SessionSlots

log = logging.getLogger("polar")

# Bytes a chat template adds around the messages (roles, tool instructions); the messages'
# JSON is otherwise longer than their rendered text.
TEMPLATE_SLACK = 4096


# Call ids: a random prefix per process and a counter, uuid-shaped (a uuid4 per call showed
# up in profiles of the event loop; these are just as unique).
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def new_id() -> str:
    p, n = _ID_PREFIX, next(_ID_COUNTER)
    return f"{p[:8]}-{p[8:12]}-{p[12:16]}-{n >> 48 & 0xffff:04x}-{n & 0xffffffffffff:012x}"


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


def read_body(req: http.Request, limit: int) -> tuple[Any, bytes | None]:
    """(parsed JSON or an AdapterError or None, the body's bytes) of a POST body. The bytes
    are kept as they are (the log thread decodes them): no second copy per call in flight."""
    if req.method != "POST":
        return None, None
    try:
        raw = decoded_body(req, limit) or b"null"
    except AdapterError as e:  # too large or undecodable: answered as a failed call
        return e, None
    try:
        return orjson.loads(raw), raw
    except orjson.JSONDecodeError:
        return None, raw   # kept as sent; the call is a 400


@dataclass
class Call:
    """One model call in flight: its flow, provider and session, what its request says, and
    the adapter's translation of its body. Its record is made once, from its outcome."""
    flow: http.HTTPFlow
    adapter: Adapter
    session: SessionInfo
    facts: RequestFacts
    t0: float                              # perf_counter at its start: total_ms runs from it
    # The body in the chat shape; once vLLM's request is made, without the conversation (the
    # answer is made without it). None: the body could not be translated ...
    request: ChatRequest | None = None
    rejected: Exception | None = None      # ... for this reason, answered as a failure
    # The response id a keepalive's opening events named, set as the relay takes the call over
    # (before its answer is made): the answer keeps it.
    keepalive_id: str | None = None

    def answering(self) -> ChatRequest:
        """The request the answer is made from: the keepalive's response id included."""
        assert self.request is not None
        if self.keepalive_id is None:
            return self.request
        named = self.request.copy()
        named["response_id"] = self.keepalive_id
        return named


def translate(adapter: Adapter, body: Any, path: str) -> ChatRequest:
    """The adapter's chat shape of a request body; AdapterError when it has none."""
    if isinstance(body, AdapterError):  # the body could not be read (too large, bad encoding)
        raise body
    if not isinstance(body, dict):
        raise AdapterError("request body must be a JSON object")
    try:
        return adapter.to_chat(body, path)
    except (RecursionError, orjson.JSONEncodeError) as e:
        raise unforwardable(body, e) from None


def unforwardable(body: Any, e: Exception) -> AdapterError:
    # Depth is checked only here (~0.1 ms a call): what orjson cannot write (255+ levels)
    # would fail the call's log line too. Depth in what the adapters drop (an unknown
    # field) is harmless: the log keeps the request's bytes as sent.
    if not depth_ok(body):
        return AdapterError(f"request body is nested deeper than {MAX_BODY_DEPTH} levels")
    return AdapterError(f"request body cannot be forwarded: {e}")


class ModelCalls:
    def __init__(self, backend_client: BackendClient, users: ProxyUsers, relay: StreamRelay,
                 recorder: Recorder, gate: PolicyGate | None = None, control: Control | None = None):
        self.backend, self.users, self.relay, self.recorder = backend_client, users, relay, recorder
        self.gate = gate or PolicyGate()   # which policy version samples each call
        self.control = control or Control()   # whose calls may be stored (polar_session_auth)
        self.overrides: dict[str, Any] = {}
        self.harness_sampling = False                       # polar_harness_sampling
        self.filters: dict[str, re.Pattern | None] = {}   # polar_model_hosts/_paths
        self.max_body = 64 * 1024 * 1024                    # polar_max_body, in bytes
        self.keepalive = 10.0
        # session -> (request text length, prompt tokens) of its last call: bounds the next prompt
        self._prompt_sizes: dict[str, tuple[int, int]] = {}
        self.calls = 0
        self.session_slots = SessionSlots()    # polar_session_max_inflight
        self.witness = BackendWitness()        # whose failure a failed call is (polar_request_failure_window)

    def load(self, loader: Loader) -> None:
        loader.add_option("polar_session_key", str, "auto",
                          "How calls are attributed to sessions: auto (proxy user, then API "
                          "key, then client), proxy-user, api-key, client.",
                          choices=sessions.SCHEMES)
        # Plain strings, not Sequence[str]: mitmproxy 11 rejects repeated --set of a script's
        # sequence option ("Received multiple values"), and a failed addon load would let
        # traffic through to the real hosts.
        loader.add_option("polar_sampling", str, "",
                          "Sampling overrides sent to the backend, comma-separated KEY=VALUE "
                          "(JSON values), e.g. temperature=0.8,max_tokens=512; max_tokens "
                          "caps the harness's own value. Without them vLLM gets the policy's "
                          "sampling: temperature 1.0, top_p 1, top_k off.")
        loader.add_option("polar_harness_sampling", bool, False,
                          "Send vLLM the harness's own temperature, top_p and top_k instead of "
                          "the policy's. Its calls are recorded as sampled; polar-train leaves "
                          "out those with truncated sampling or another temperature than its own.")
        loader.add_option("polar_model_hosts", str, "",
                          "Regex of hosts whose API calls are model calls (empty: any host).")
        loader.add_option("polar_model_paths", str, "",
                          "Regex of request paths that may be model calls (empty: any path "
                          "the adapters recognise); other paths are answered locally.")
        loader.add_option("polar_max_body", str, "64m",
                          "Largest request body, as sent and once decompressed (e.g. 64m); "
                          "larger ones get a 413. Also caps mitmproxy's body_size_limit.")
        loader.add_option("polar_stream_keepalive", str, "10",   # str: mitmproxy options take no floats
                          "Seconds a streaming call may wait for the backend before its SSE "
                          "headers go out, followed by a keepalive comment every as many "
                          "seconds until the answer (0: off; the answer then goes out whole).")
        loader.add_option("polar_session_max_inflight", int, DEFAULT_MAX_INFLIGHT,
                          "Calls of one session at the backend at once (0: no cap); a session's "
                          "further calls wait their turn, first come first served, at most "
                          "polar_backend_timeout (then it fails as session_busy).")
        loader.add_option("polar_request_failure_window", str, f"{DEFAULT_WINDOW_S:g}",
                          "Seconds after a failure in which another call must succeed at the "
                          "backend for an error the backend answered (a 4xx/5xx other than "
                          "429/503, or no completion) to be the request's (request_failed: the "
                          "policy's, scored) rather than the backend's (released); the backend's "
                          "/health is probed too. 0: every such error is the backend's.")

    def configure(self, updated: set[str]) -> None:
        if "polar_max_body" in updated:
            self.max_body = option_values.size("polar_max_body", ctx.options.polar_max_body)
        if ("polar_max_body" in updated or "body_size_limit" in updated) and "body_size_limit" in ctx.options:
            # mitmproxy stops reading a larger body itself (its own 413), so memory stays bounded.
            current = human.parse_size(ctx.options.body_size_limit)
            if current is None or current > self.max_body:
                ctx.options.body_size_limit = str(self.max_body)
        if "polar_sampling" in updated:
            self.overrides = parse_overrides(ctx.options.polar_sampling)
        if "polar_harness_sampling" in updated:
            self.harness_sampling = ctx.options.polar_harness_sampling
        for name in ("polar_model_hosts", "polar_model_paths"):
            if name in updated:
                try:
                    value = getattr(ctx.options, name)
                    self.filters[name] = re.compile(value) if value else None
                except re.error as e:
                    raise exceptions.OptionsError(f"{name}: {e}") from None
        if "polar_stream_keepalive" in updated:
            self.keepalive = option_values.seconds("polar_stream_keepalive", ctx.options.polar_stream_keepalive)
        if "polar_session_max_inflight" in updated:
            if ctx.options.polar_session_max_inflight < 0:
                raise exceptions.OptionsError("polar_session_max_inflight must be >= 0")
            self.session_slots.cap = ctx.options.polar_session_max_inflight
        if "polar_request_failure_window" in updated:
            self.witness.window_s = option_values.seconds("polar_request_failure_window",
                                                          ctx.options.polar_request_failure_window)

    async def running(self) -> None:
        gc.freeze()   # what start-up made lives on: later collections need not scan it
        await self.relay.start()

    def done(self) -> None:
        self.relay.close()

    # ---- hooks -------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        try:
            await self._route(flow)
        except Exception:  # a bug: answered here, so no other addon mistakes it for telemetry
            log.exception("polar: unexpected error")
            flow.response = internal_error()

    async def _route(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        if not self.may_be_model_call(req) or is_count_tokens(req.path) or is_websocket(req):
            return
        body, text = read_body(req, self.max_body)
        style = adapters.detect(req.method, req.path, header_dict(req), body)
        if not style:
            return
        # mitmdump prints the URL of every flow: a ?key= secret must not reach its log.
        query = split_path(req.path)[1]
        req.path = sessions.redact_query(req.path)
        claim = self._claim(flow, query)
        if self._refused(flow, style, claim):
            return
        call = self.begin(flow, style, body, text, query, claim.session)
        answer = asyncio.ensure_future(self.finish(call, body))
        del body   # the call holds it only as long as it needs it (see _outcome)
        if self.keepalive and self.relay.address and call.facts.stream:
            done, _ = await asyncio.wait({answer}, timeout=self.keepalive)
            if not done:
                # The answer is not made yet (the backend is still generating): it takes this
                # id, so the keepalive's opening events and the answer name one response.
                call.keepalive_id = "resp_" + new_id().replace("-", "")
                request = call.answering()
                self.relay.hand_over(flow, answer, call.adapter.stream_content_type(request), self.keepalive,
                                     call.adapter.stream_keepalive(request, int(time.time())))
                return
        flow.response = http.Response.make(*await answer)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self.relay.responseheaders(flow)

    async def error(self, flow: http.HTTPFlow) -> None:
        # mitmproxy stopped reading a body over body_size_limit and answered 413 itself.
        if (flow.response is None and flow.error and "body_size_limit" in flow.error.msg
                and self.may_be_model_call(flow.request)):
            style = adapters.detect(flow.request.method, flow.request.path, header_dict(flow.request))
            claim = self._claim(flow, split_path(flow.request.path)[1]) if style else None
            if style and claim and not self._refused(flow, style, claim):
                too_large = BodyTooLarge(f"request body is larger than polar_max_body ({self.max_body} bytes)")
                await self.finish(self.begin(flow, style, too_large, None, split_path(flow.request.path)[1],
                                             claim.session), None)

    def _refused(self, flow: http.HTTPFlow, style: str, claim: sessions.Claim) -> bool:
        """With polar_session_auth on, a call that names a session without that session's
        credential gets a 403 in its provider's shape, is counted, and is stored nowhere: a
        session cannot write into a sibling's trajectory by naming it."""
        if self.control.may_store(claim.session.session_id, claim.session.source, claim.credential):
            return False
        self.control.refused += 1
        if self.control.refused <= 10 or self.control.refused % 1000 == 0:   # a flood is not a flood of lines
            log.warning("polar: refused a call naming session %r without its credential (from %s; %d refused so far)",
                        claim.session.session_id[:200], claim.session.client, self.control.refused)
        adapter = adapters.adapter(style)
        message = "this call does not carry the credential of the session it names (polar_session_auth)"
        flow.response = http.Response.make(403, orjson.dumps(adapter.error(403, message, "authentication")),
                                           JSON_HEADERS)
        return True

    def may_be_model_call(self, req: http.Request) -> bool:
        hosts, paths = self.filters.get("polar_model_hosts"), self.filters.get("polar_model_paths")
        return ((hosts is None or bool(hosts.search(req.pretty_host)))
                and (paths is None or bool(paths.search(split_path(req.path)[0]))))

    # ---- one call ----------------------------------------------------------------------

    def begin(self, flow: http.HTTPFlow, style: str, body: Any, text: bytes | None, query: str,
              session: SessionInfo | None = None) -> Call:
        """A call's start: its session, what its request says, and its body in the chat shape
        (a body that has none is the call's failure, which finish answers and records)."""
        t0 = time.perf_counter()
        adapter = adapters.adapter(style)
        req = flow.request
        session = session or self._session(flow, query)
        request: ChatRequest | None = None
        rejected: Exception | None = None
        try:
            request = translate(adapter, body, req.path)
        except Exception as e:   # answered and recorded like any failure, in finish
            rejected = e
        facts = RequestFacts(
            call_id=new_id(), style=style, method=req.method, path=sessions.redact_query(req.path),
            started_at=time.time(),
            request_text=(f"<request body not kept: {body}>" if isinstance(body, AdapterError)
                          else text if text is not None else b""),
            stream=request["stream"] if request is not None else None,
            requested_model=request["model"] if request is not None else None,
            dropped=request["dropped"] if request is not None else None)
        return Call(flow, adapter, session, facts, t0, request, rejected)

    async def finish(self, call: Call, body: Any) -> Answer:
        """The answer, recorded before it is returned. Never raises: failures are answers in
        the client's error format."""
        outcome = self._outcome(call, body)
        del body
        done = await outcome
        # The harness gave up (its timeout, or it was stopped): kept, never trained on.
        record = call_record(call.facts, done, abandoned=call.flow.client_conn.timestamp_end is not None)
        answer = done.answer
        try:
            await self.recorder.record(call.session, record, call.t0)
        except Exception as e:  # not recorded -> not acknowledged: the harness retries
            log.error("polar: could not record call: %s", e)
            status = call.adapter.OVERLOADED_STATUS
            answer = Answer(status, orjson.dumps(call.adapter.error(status, f"recording failed: {e}", "overloaded")),
                            dict(JSON_HEADERS))
        self.calls += 1
        return answer

    async def _outcome(self, call: Call, body: Any) -> Outcome:
        """What became of the call: served by the backend, or failed with what it had reached
        (what vLLM was asked, how long it waited). Never raises."""
        if call.request is None:   # the body has no chat shape: that is the call's failure
            return self._failed(call, call.rejected or AdapterError("request body must be a JSON object"))
        dispatch: Dispatch | None = None
        try:
            dispatch, backend_body = await self._dispatch(call, call.request)
            payload = orjson.dumps(backend_body)
        except (RecursionError, orjson.JSONEncodeError) as e:
            return self._failed(call, unforwardable(body, e), dispatch)
        except Exception as e:
            return self._failed(call, e, dispatch)
        # While the backend generates, a call in flight keeps its bytes as sent (mitmproxy's
        # and the log's) and the request as the backend got it, not the parsed conversation
        # as well: 11 MB less at 64 clients (tracemalloc's peak, 58 -> 47 MB).
        del body, backend_body
        without_conversation = call.request.copy()
        without_conversation["messages"] = []
        call.request = without_conversation
        queue_ms = backend_ms = 0.0
        sent: float | None = None      # when it went to the backend (monotonic)
        answered = False               # the backend's 200 came back
        returned = False               # the witness heard how it ended
        try:
            slots = self.backend.slots
            q0 = time.perf_counter()
            # At most polar_session_max_inflight of a session's calls at the backend: the rest
            # wait here, outside the gate (a sync never waits on a session's queue). Inside the
            # gate the weights cannot change: a sync waits for this call, and a call that
            # arrives during a sync waits for it (queue_ms counts all three waits).
            async with self.session_slots.slot(call.session.session_id, self.backend.timeout):
                async with self.gate.call() as ticket:
                    if slots:
                        await slots.acquire()
                    try:
                        b0 = time.perf_counter()
                        sent = time.monotonic()
                        queue_ms = (b0 - q0) * 1000
                        self.witness.sent()
                        completion = await self.backend.complete(payload)
                        answered = True
                        backend_ms = (time.perf_counter() - b0) * 1000
                    finally:
                        if slots:
                            slots.release()
            served = self._served(call, completion, dispatch, Waits(queue_ms, backend_ms), ticket)
            returned = True
            self.witness.returned(ok=True)     # a success only once its answer is a completion
            return served
        except Exception as e:
            failed = self._failed(call, e, dispatch, Waits(queue_ms, backend_ms))
            if sent is not None:   # it reached the backend: whose failure is it?
                returned = True
                self.witness.returned(ok=False)
                failed = await self._attributed(failed, e, sent, answered)
            return failed
        finally:
            if sent is not None and not returned:   # cancelled
                self.witness.returned(ok=False)

    async def _attributed(self, failed: Failed, e: Exception, sent: float, answered_ok: bool) -> Failed:
        """A call the backend answered with an error (or a 200 that is no completion) while it
        was healthy and served other calls is the request's failure (request_failures.py);
        what the probe saw goes into the record either way."""
        status = getattr(e, "backend_status", 200 if answered_ok else None)
        if (failed.kind != "backend_error" or status is None or not isinstance(e, AdapterError)
                or not self.witness.window_s):
            return failed
        verdict = await self.witness.judge(self.backend.health, sent, time.monotonic())
        return failed._replace(kind=REQUEST_FAILED if verdict.request_failed else failed.kind,
                               error=f"{failed.error} [HTTP {status} from the backend; {verdict.note}]"[:2000])

    async def _dispatch(self, call: Call, request: ChatRequest) -> tuple[Dispatch, dict[str, Any]]:
        """What vLLM is asked for, and the request it gets."""
        served = await self.backend.served()
        backend_body = backend.to_backend(request, served, self.overrides, self.backend.max_model_len,
                                          harness_sampling=self.harness_sampling)
        await self._fit_max_tokens(backend_body, call.session.session_id, len(call.facts.request_text))
        params = {k: v for k, v in backend_body.items() if k not in ("messages", "tools")}
        params["harness"] = backend.requested_sampling(request)
        return Dispatch(served, params), backend_body

    def _served(self, call: Call, completion: Completion, dispatch: Dispatch, waits: Waits, ticket: Ticket) -> Served:
        """vLLM's answer in the client's format, with the versions that sampled it: the
        engine's own per token where it gave spans, else the gateway's ticket."""
        request = call.answering()
        result, tokens = backend.from_backend(completion.resp, request)
        version, versions = ticket.version, None
        if completion.weight_versions is not None:
            versions = backend.token_versions(completion.weight_versions, len(tokens["token_ids"]),
                                              lambda tag: self.gate.version_of_tag(tag, ticket))
            # the version the call started under: its first token's (no token: the gateway's)
            version = versions[0] if versions else ticket.version
        answer = call.adapter.from_chat(result, request)
        usage = result["usage"]
        self._prompt_sizes[call.session.session_id] = (len(call.facts.request_text), usage["prompt_tokens"])
        if len(self._prompt_sizes) > 10_000:
            self._prompt_sizes.pop(next(iter(self._prompt_sizes)))
        if request["stream"]:
            sent = Answer(200, b"".join(call.adapter.stream(result, request)), {
                "content-type": call.adapter.stream_content_type(request), "cache-control": "no-cache"})
        else:
            sent = Answer(200, orjson.dumps(answer), dict(JSON_HEADERS))
        return Served(sent, answer, dispatch, waits, version, completion.prompt_ids or b"[]", tokens["token_ids"],
                      tokens["logprobs"], result["finish_reason"], usage, versions)

    @staticmethod
    def _failed(call: Call, e: Exception, dispatch: Dispatch | None = None, waits: Waits = Waits()) -> Failed:
        """A failed call's answer in the client's error format."""
        if not isinstance(e, AdapterError):
            log.error("polar: unexpected error in a model call", exc_info=e)
        status, kind = (e.status, e.kind) if isinstance(e, AdapterError) else (500, "backend_error")
        if kind == "overloaded":
            status = call.adapter.OVERLOADED_STATUS
        # A bug's Python text goes to the log and the record, not to the harness.
        message = (str(e) or type(e).__name__) if isinstance(e, AdapterError) else "polar-mitm internal error"
        answer = call.adapter.error(status, message, getattr(e, "answer_kind", kind))
        return Failed(Answer(status, orjson.dumps(answer), dict(JSON_HEADERS)), answer, str(e)[:2000] or repr(e),
                      kind, dispatch, waits)

    async def _fit_max_tokens(self, body: dict[str, Any], session_id: str, text_len: int) -> None:
        """Caps max_tokens at what the context leaves after the prompt: some vLLM versions
        refuse more (Claude Code asks for 64000). A token is at least one byte of the
        harness's request text, and a session's prompt grows by at most the bytes its text
        grows by, so the backend counts the prompt only when its size could matter."""
        limit, wanted = self.backend.max_model_len, body.get("max_tokens")
        if not limit or not isinstance(wanted, int):
            return
        bound = text_len
        if session_id in self._prompt_sizes:
            last_len, last_tokens = self._prompt_sizes[session_id]
            bound = min(bound, last_tokens + max(0, text_len - last_len))
        # an image is a short URL or base64 that renders to many tokens
        if wanted + bound + TEMPLATE_SLACK <= limit and not has_image(body) or not self.backend.has_tokenize:
            return
        try:
            count = await self.backend.tokenize(body)
        except Exception as e:  # the completion call will say more
            log.warning("polar: could not count prompt tokens, max_tokens left at %s: %s", wanted, e)
            return
        body["max_tokens"] = max(1, min(wanted, limit - count))

    def _session(self, flow: http.HTTPFlow, query: str) -> SessionInfo:
        return self._claim(flow, query).session

    def _claim(self, flow: http.HTTPFlow, query: str) -> sessions.Claim:
        return sessions.claim(
            headers=header_dict(flow.request), query=query, proxy=self.users.auth(flow),
            client_host=flow.client_conn.peername[0] if flow.client_conn.peername else "unknown",
            salt=self.recorder.salt(), scheme=ctx.options.polar_session_key)
