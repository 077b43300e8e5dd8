"""The vLLM client, as an addon: built in configure from the polar_backend* options, rebuilt
when they change (--set), closed in done. The other addons ask it for completions, token
counts and the served model, and swaps its weights in a sync."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import orjson
from mitmproxy import ctx, exceptions

from polar_mitm.adapters import backend
from polar_mitm.adapters.chat import AdapterError

from .backend_http import BackendHTTP, HTTPError, HTTPTimeout
from .http_json import JSON_HEADERS
from .policy_gate import TAG_PREFIX
from .sync_report import SwapSeconds, SwapStep

log = logging.getLogger("polar")


class BackendUnavailable(AdapterError):
    status, kind = 503, "overloaded"


class BackendTimeout(AdapterError):
    status, kind = 504, "timeout"


class NoWeightInfo(AdapterError):
    """The backend cannot tell which weights it serves (no dev mode, a stand-in)."""
    status, kind = 502, "api_error"


def answered(e: AdapterError, status: int) -> AdapterError:
    """e, marked as the backend's own answer (its HTTP status): it served the request and
    failed it, which may be the request's doing (request_failures.py)."""
    e.backend_status = status       # type: ignore[attr-defined]
    return e


@dataclass(frozen=True)
class WeightSource:
    """Where vLLM loads a version from: a checkpoint folder it reads (reload_weights), or the
    trainer's memory over HTTP (pull_url: one safetensors blob with this sha256, loaded by
    polar-mitm's worker extension, polar_mitm/vllm_ext/weight_pull.py)."""
    checkpoint: str | None = None
    pull_url: str | None = None
    sha256: str | None = None

    def reload_rpc(self, method: str = "polar_pull_weights") -> dict[str, Any]:
        """The /collective_rpc body that loads it."""
        if self.pull_url:
            return {"method": method, "kwargs": {"url": self.pull_url, "sha256": self.sha256}}
        return {"method": "reload_weights", "kwargs": {"weights_path": self.checkpoint}}


def weight_tag(version: int) -> str:
    """The tag a sync gives vLLM's weights: distinct from anything vLLM starts with ("default"),
    so a restarted server (back on the weights of its command line) never passes for version N."""
    return f"{TAG_PREFIX}{version}"


def untagged(tag: str | None) -> bool:
    """A tag no sync set (vLLM's own "default" at start): the weights of its command line."""
    return tag is None or not tag.startswith(TAG_PREFIX)


ROUTES = ("auto", "generate", "chat")
# How vLLM answers a route it does not have: 404 (an older vLLM), or 403 with its
# PermissionDeniedError (0.32 started without --enable-scale-out).
_NO_ROUTE = (b"Not Found", b"PermissionDeniedError", b"--enable-scale-out")


class Completion(NamedTuple):
    """vLLM's answer as a chat completion (from_backend reads it), its prompt token ids as
    JSON text, and the engine's weight spans over the sampled tokens (None: the chat route,
    which has none)."""
    resp: Any
    prompt_ids: bytes | None
    weight_versions: list | None


def _route_missing(e: AdapterError) -> bool:
    status = getattr(e, "backend_status", None)
    return status in (403, 404, 405) and any(m.decode() in str(e) for m in _NO_ROUTE)


class BackendClient:
    def __init__(self):
        self.client: BackendHTTP | None = None
        self.slots: asyncio.Semaphore | None = None     # polar_max_concurrency
        self.base = ""
        self.timeout = 600
        self.served_model: str | None = None
        self.max_model_len: int | None = None           # from the backend's model list
        self._listed = False
        self.has_tokenize = True   # False once the backend said it has no /tokenize
        # polar_backend_route: "generate" (render -> /inference/v1/generate -> derender: every
        # token's weight version, from the engine) or "chat" (/v1/chat/completions); auto
        # takes generate where the backend has it, decided at the first call
        self.route_wanted = "auto"
        self.route: str | None = None
        self.route_note = "not decided yet (at the first call)"
        self.headers: dict[str, str] = JSON_HEADERS   # with X-data-parallel-rank under polar_dp_rank

    def load(self, loader):
        loader.add_option("polar_backend", str, "http://127.0.0.1:8000",
                          "Base URL of the vLLM OpenAI-compatible server.")
        loader.add_option("polar_served_model", str, "",
                          "Model name to ask the backend for (empty: the first one it serves).")
        loader.add_option("polar_backend_timeout", int, 600, "Seconds to wait for the backend.")
        loader.add_option("polar_max_concurrency", int, 0,
                          "Calls in flight to the backend at once (0: unlimited).")
        loader.add_option("polar_dp_rank", int, -1,
                          "vLLM's data parallelism (--data-parallel-size): pin every call of this "
                          "gateway to this engine rank (X-data-parallel-rank), so a session's calls "
                          "stay on one engine's prefix cache (-1: vLLM balances them).")
        loader.add_option("polar_backend_route", str, "auto",
                          "How calls reach vLLM: generate (render -> /inference/v1/generate -> "
                          "derender, with every token's weight version from the engine; vLLM "
                          "needs --enable-scale-out), chat (/v1/chat/completions, versions from "
                          "the gateway), or auto (generate where the backend has it).",
                          choices=ROUTES)

    def configure(self, updated):
        if "polar_backend_timeout" in updated and ctx.options.polar_backend_timeout <= 0:
            raise exceptions.OptionsError("polar_backend_timeout must be > 0")
        if "polar_max_concurrency" in updated and ctx.options.polar_max_concurrency < 0:
            raise exceptions.OptionsError("polar_max_concurrency must be >= 0")
        if "polar_dp_rank" in updated:
            rank = ctx.options.polar_dp_rank
            if rank < -1:
                raise exceptions.OptionsError("polar_dp_rank must be an engine rank (0 or more), or -1")
            self.headers = JSON_HEADERS if rank < 0 else {**JSON_HEADERS, "X-data-parallel-rank": str(rank)}
        if "polar_backend_route" in updated or "polar_backend" in updated:
            self.route_wanted = ctx.options.polar_backend_route
            self.route = None if self.route_wanted == "auto" else self.route_wanted
            self.route_note = ("not decided yet (at the first call)" if self.route is None
                               else f"polar_backend_route={self.route}")
        if "polar_served_model" in updated or "polar_backend" in updated:
            self.served_model = ctx.options.polar_served_model or None
            self._listed = False
        if {"polar_backend", "polar_backend_timeout", "polar_max_concurrency"} & set(updated) or self.client is None:
            self._close()
            self.base = ctx.options.polar_backend.rstrip("/")
            self.timeout = ctx.options.polar_backend_timeout
            limit = ctx.options.polar_max_concurrency or None
            try:   # never through a proxy: the backend is reached directly
                # the token route makes three exchanges a call: idle connections are kept for
                # 128 calls at once (at 32, 64 clients opened a new one every ~5 calls)
                self.client = BackendHTTP(self.base, timeout=self.timeout, connect_timeout=10, max_idle=128)
            except ValueError as e:
                raise exceptions.OptionsError(f"polar_backend: {e}") from None
            self.slots = asyncio.Semaphore(limit) if limit else None
            self.has_tokenize = True

    def done(self):
        self._close()

    def _http(self) -> BackendHTTP:
        if self.client is None:   # before configure, or after done
            raise RuntimeError("the backend client is not configured")
        return self.client

    def _close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                asyncio.get_running_loop().create_task(client.aclose())
            except RuntimeError:   # no loop any more: its sockets go with the process
                client.closed = True

    async def complete(self, payload: bytes) -> Completion:
        """vLLM's answer to a chat completion request (payload: its JSON), by the route in
        force; auto tries generate once and keeps chat where the backend lacks it."""
        if self.route != "chat":
            try:
                return await self._generate(payload)
            except AdapterError as e:
                # a backend without the route (auto only): this call and every later one take chat;
                # calls that raced to the first render find it decided already
                if self.route_wanted == "generate" or not _route_missing(e):
                    raise
                if self.route != "chat":
                    self.route, self.route_note = "chat", f"the backend has no token route ({str(e)[:120]})"
                    log.warning("polar: %s: calls go to /v1/chat/completions, with the gateway's versions",
                                self.route_note)
        resp = await self._post("/v1/chat/completions", payload)
        try:
            parsed, prompt_ids = backend.parse_completion(resp.content)
        except orjson.JSONDecodeError:
            raise answered(backend.BackendError("the model backend answered with invalid JSON"), resp.status) \
                from None
        return Completion(parsed, prompt_ids, None)

    async def probe_route(self) -> str:
        """The route, decided now if no call decided it: a prompt of one word rendered (no
        generation), the token route where the backend renders it."""
        if self.route is None:
            body = orjson.dumps({"model": await self.served(), "messages": [{"role": "user", "content": "hi"}]})
            try:
                await self._post("/v1/chat/completions/render", body)
                self.route, self.route_note = "generate", "the backend has /inference/v1/generate"
            except AdapterError as e:
                if not _route_missing(e):
                    raise
                self.route, self.route_note = "chat", f"the backend has no token route ({str(e)[:120]})"
        return self.route

    async def _generate(self, payload: bytes) -> Completion:
        """render -> /inference/v1/generate -> derender: the chat completion vLLM would give,
        with the engine's weight version spans over the sampled tokens."""
        rendered = await self._post("/v1/chat/completions/render", payload)
        prompt = self._parsed(backend.rendered_prompt, rendered.content, rendered.status)
        if self.route is None:
            self.route, self.route_note = "generate", "the backend has /inference/v1/generate"
        generated = await self._post("/inference/v1/generate", rendered.content)   # as rendered, byte for byte
        gen = self._parsed(orjson.loads, generated.content, generated.status)
        self._parsed(backend.generate_choice, gen, generated.status)
        derendered = await self._post("/v1/chat/completions/derender", backend.derender_body(gen, payload, prompt))
        resp = self._parsed(orjson.loads, derendered.content, derendered.status)
        merged = self._parsed(lambda r: backend.completion_from_generate(r, gen, prompt), resp, derendered.status)
        return Completion(merged, prompt.ids_json, merged["weight_versions"] or [])

    @staticmethod
    def _parsed(parse: Callable[[Any], Any], content: Any, status: int) -> Any:
        """parse(content); what fails is the backend's answer (its status), for the witness."""
        try:
            return parse(content)
        except orjson.JSONDecodeError:
            raise answered(backend.BackendError("the model backend answered with invalid JSON"), status) from None
        except AdapterError as e:
            raise answered(e, status) from None

    async def tokenize(self, backend_body: dict) -> int:
        """The prompt's token count from vLLM's /tokenize, rendered as the completion will be."""
        if not self.has_tokenize:
            raise backend.BackendError("the model backend has no /tokenize", status=404, kind="not_found")
        keys = ("model", "messages", "tools", "add_generation_prompt", "continue_final_message")
        tok = {k: backend_body[k] for k in keys if k in backend_body}
        try:
            resp = await self._post("/tokenize", tok)
        except backend.BackendError as e:
            if e.status == 404:   # a backend without it (a stand-in): not asked again
                self.has_tokenize = False
            raise
        try:
            return int(orjson.loads(resp.content).get("count", 0))
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            raise backend.BackendError("the model backend's /tokenize answer is not valid") from None

    async def _post(self, path: str, body: dict | bytes):
        """The backend's 200 answer; anything else raised as the error the harness gets."""
        if isinstance(body, dict):
            body = orjson.dumps(body)
        try:
            resp = await self._http().request("POST", path, body, self.headers)
        except HTTPTimeout:
            raise BackendTimeout(f"the model backend did not answer within {self.timeout}s") from None
        except HTTPError as e:
            raise BackendUnavailable(f"the model backend is unavailable: {e}") from None
        if resp.status != 200:
            raise answered(backend.backend_error(resp.status, resp.content), resp.status)
        return resp

    async def health(self, timeout: float) -> tuple[bool, str]:
        """Whether the backend answers its health check now: vLLM's /health, or its model list
        where there is no /health (a stand-in). (healthy, what it saw)."""
        try:
            resp = await self._http().request("GET", "/health", timeout=timeout)
            seen = f"/health {resp.status}"
            if resp.status == 404:
                resp = await self._http().request("GET", "/v1/models", timeout=timeout)
                seen = f"/health 404, /v1/models {resp.status}"
        except HTTPTimeout:
            return False, f"/health: no answer within {timeout:g}s"
        except HTTPError as e:
            return False, f"/health: {e}"
        return resp.status == 200, seen

    async def served(self) -> str:
        """The model asked for, and the backend's context length, from its model list (once)."""
        if self._listed and self.served_model is not None:
            return self.served_model
        try:
            resp = await self._http().request("GET", "/v1/models", timeout=10)
            models = orjson.loads(resp.content)["data"]
            wanted = self.served_model or models[0]["id"]
            entry = next((m for m in models if m["id"] == wanted), models[0])
            self.max_model_len = entry.get("max_model_len")
            self.served_model = wanted
            self._listed = True
        except (HTTPError, ValueError, KeyError, IndexError, TypeError):
            raise BackendUnavailable("the model backend is unavailable (no model list)") from None
        return wanted

    async def swap_weights(self, source: "WeightSource", version: int, wake: bool = False,
                           inflight: bool = False) -> SwapSeconds:
        """vLLM (dev mode) reloads its weights in place from source, forgets the old
        weights' keys and values and takes the version as its own tag. wake: it slept
        (sleep() below): its weights' memory comes back first, the reload fills it, and
        only then its KV cache's, so the two never peak together. inflight: the engine pauses
        the requests it runs where they are (/pause?mode=keep, with clear_cache=true sent
        explicitly: the route's default, which its docstring says keep mode ignores and the
        engine applies: their KV is recomputed under the new weights), then resumes them (a
        pull is best fetched first, prefetch(), while the engine still serves)."""
        seconds = SwapSeconds()
        steps: list[tuple[SwapStep, str, dict[str, Any]]] = [("wake", "/wake_up?tags=weights", {})] if wake else []
        steps += [("pause", "/pause?mode=keep&clear_cache=true", {})] if inflight else []
        steps += [("reload", "/collective_rpc", source.reload_rpc())]
        steps += [("wake", "/wake_up?tags=kv_cache", {})] if wake else []
        steps += [] if inflight else [("reset", "/reset_prefix_cache", {})]
        steps += [("reset", "/update_weight_version", {"new_version": weight_tag(version)})]
        paused = False
        try:
            for i, (step, path, body) in enumerate(steps):
                t0 = time.monotonic()
                try:
                    await self._dev_post(path, body, "to sync weights into it")
                except AdapterError as e:
                    # Refused outright at its first step (an answer, not a timeout or a lost
                    # connection): vLLM's weights are as they were. Anything else may have half
                    # reloaded them.
                    e.weights_untouched = i == 0 and isinstance(e, backend.BackendError)   # type: ignore[attr-defined]
                    raise
                paused = paused or step == "pause"
                seconds.add(step, time.monotonic() - t0)
        finally:
            if paused:      # never leave the engine paused: its requests would wait forever
                t0 = time.monotonic()
                await self._resume()
                seconds.add("resume", time.monotonic() - t0)
        return seconds

    async def _resume(self, tries: int = 5) -> None:
        """/resume, tried again while the backend does not answer (a reload that failed may
        have closed the connection): a paused engine serves nothing until it is resumed."""
        for i in range(tries):
            try:
                await self._dev_post("/resume", {}, "to resume it")
                return
            except (BackendUnavailable, BackendTimeout):
                if i == tries - 1:
                    raise
                await asyncio.sleep(0.2 * (i + 1))

    async def prefetch(self, source: "WeightSource", timeout: float = 600) -> float:
        """Has vLLM's workers fetch and check a pull's bytes (the worker extension's
        polar_prefetch_weights) and waits until they hold them, while the engine still serves
        (the load itself, paused, then takes them from memory). Returns its seconds."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            resp = await self._post("/collective_rpc", source.reload_rpc("polar_prefetch_weights"))
            try:
                states = [r.get("state") for r in orjson.loads(resp.content)["results"]]
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise backend.BackendError("the worker extension's prefetch answer is not valid") from None
            if "failed" in states:
                raise backend.BackendError(f"the weight pull failed in vLLM: {resp.content[:300].decode(errors='replace')}")
            if all(s == "ready" for s in states):
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                raise BackendTimeout(f"vLLM did not fetch the weights within {timeout:g}s")
            await asyncio.sleep(0.05)

    async def weight_version(self, http: BackendHTTP | None = None) -> str | None:
        """vLLM's own weight version tag (GET /weight_info, dev mode): what the gateway set
        at its last sync, or vLLM's default after a restart. NoWeightInfo where it has none.
        http: another client of the same backend (the version watch's own connection)."""
        try:
            resp = await (http or self._http()).request("GET", "/weight_info", timeout=10)
        except HTTPTimeout:
            raise BackendTimeout("the model backend did not answer /weight_info") from None
        except HTTPError as e:
            raise BackendUnavailable(f"the model backend is unavailable: {e}") from None
        if resp.status == 404:
            raise NoWeightInfo("the model backend has no /weight_info (start vLLM with VLLM_SERVER_DEV_MODE=1)")
        if resp.status != 200:
            raise backend.backend_error(resp.status, resp.content)
        try:
            tag = orjson.loads(resp.content).get("weight_version")
        except (orjson.JSONDecodeError, AttributeError):
            raise backend.BackendError("the model backend's /weight_info answer is not valid") from None
        return None if tag is None else str(tag)

    async def set_weight_version(self, version: int) -> None:
        """Tags what vLLM serves now as this policy version (dev mode)."""
        await self._dev_post("/update_weight_version", {"new_version": weight_tag(version)}, "to tag its weights")

    async def sleep(self, level: int) -> None:
        """vLLM frees its GPU memory for the trainer (level 2: weights and KV cache are
        discarded; the next swap_weights(wake=True) brings both back)."""
        await self._dev_post(f"/sleep?level={level}", {}, "and --enable-sleep-mode to colocate with the trainer")

    async def _dev_post(self, path: str, body: dict, why: str) -> None:
        try:
            await self._post(path, body)
        except backend.BackendError as e:
            if e.status == 404:
                raise backend.BackendError(
                    f"the model backend has no {path.partition('?')[0]}: start vLLM with "
                    f"VLLM_SERVER_DEV_MODE=1 (polar-mitm up does) {why}", status=502) from None
            raise
