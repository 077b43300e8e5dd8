"""The dashboard's web app: FastAPI (on uvicorn, as the rollout server's API), one page of
vanilla JS served for every route, the JSON API under /api/ and the live event stream.

Reads are cached per (endpoint, arguments) and generation (live.py): any number of browsers
cost one database read per change, and while changes keep coming an answer is read again at
most once per MIN_REFRESH_S, and no more often than 20 times the time its last read took
(until then the last one is served, with the generation it was read at, and the page asks
again): a page open beside a rollout takes a bounded share of the machine. Reads take turns
(one connection at a time, on one DuckDB thread, opened and closed within the request: none
is held between requests), in worker threads, so the event loop and the event streams never
wait on DuckDB.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Hashable

import anyio.to_thread
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from . import data
from .live import CALLS_EVERY_S, POLL_S, Live
from .tokens import TokenText, find_tokenizer

STATIC = Path(__file__).parent / "static"
MIN_REFRESH_S = 5.0       # an answer is read again at most this often while changes keep coming,
READ_SHARE = 0.05         # and no more often than its last read took / READ_SHARE (20x its time)
CACHE_ENTRIES = 256
STREAM_PING_S = 15.0      # a comment line on an idle event stream, so proxies keep it open
NO_STORE = {"Cache-Control": "no-store"}
_ICON = (b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
         b'fill="#2456a6"/><path d="M3 12 L6 7 L9 9 L13 3" stroke="#fff" stroke-width="2" fill="none"/></svg>')


@dataclass
class Entry:
    generation: int
    at: float            # monotonic time the read ended
    took: float          # seconds the read took
    value: Any           # None: not found (404)
    body: bytes


class AnswerCache:
    """Answers by key, each read at most once per generation and once per min_refresh_s."""

    def __init__(self, live: Live, min_refresh_s: float = MIN_REFRESH_S, size: int = CACHE_ENTRIES):
        self.live, self.min_refresh_s, self.size = live, min_refresh_s, size
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self._locks: dict[Hashable, asyncio.Lock] = {}
        self._read_lock = threading.Lock()   # one database read at a time
        self.reads = 0                       # database reads so far (the tests count them)

    def _fresh(self, e: Entry | None) -> bool:
        return e is not None and (e.generation == self.live.generation
                                  or time.monotonic() - e.at < max(self.min_refresh_s, e.took / READ_SHARE))

    def _read(self, compute: Callable[[], Any]) -> tuple[Any, float]:
        """(the answer, seconds its read took: not the wait for another read's turn)."""
        with self._read_lock:
            self.reads += 1
            t0 = time.monotonic()
            return compute(), time.monotonic() - t0

    async def get(self, key: Hashable, compute: Callable[[], Any]) -> Entry:
        e = self._entries.get(key)
        if e is not None and self._fresh(e):
            self._entries.move_to_end(key)
            return e
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            e = self._entries.get(key)
            if e is not None and self._fresh(e):
                return e
            generation = self.live.generation      # before the read: it shows at least this
            value, took = await anyio.to_thread.run_sync(self._read, compute)
            body = orjson.dumps({"generation": generation, **value} if value is not None else
                                {"generation": generation, "error": {"message": "not found"}},
                                option=orjson.OPT_SERIALIZE_NUMPY)
            e = Entry(generation, time.monotonic(), took, value, body)
            self._entries[key] = e
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                old, _ = self._entries.popitem(last=False)
                if old in self._locks and not self._locks[old].locked():
                    del self._locks[old]
        return e


def _json(e: Entry) -> Response:
    return Response(e.body, status_code=200 if e.value is not None else 404, media_type="application/json",
                    headers={**NO_STORE, "X-Polar-Generation": str(e.generation)})


def _error(status: int, message: str) -> Response:
    return Response(orjson.dumps({"error": {"message": message}}), status_code=status,
                    media_type="application/json", headers=NO_STORE)


def make_app(dbs: list[str], run_dir: str | None = None, tokenizer: str | None = None, *,
             poll_s: float = POLL_S, min_refresh_s: float = MIN_REFRESH_S,
             calls_every_s: float = CALLS_EVERY_S) -> FastAPI:
    """The dashboard over these database files (and a loop's run directory). tokenizer: a
    directory with tokenizer.json (or the file); None: the run's latest checkpoint's, if any."""
    dbs = [str(d) for d in dbs]
    run = str(run_dir) if run_dir is not None else None
    live = Live(dbs, run, poll_s, calls_every_s)
    tokens = TokenText(tokenizer if tokenizer else find_tokenizer(run))
    cache = AnswerCache(live, min_refresh_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        task = asyncio.create_task(live.run())
        threading.Thread(target=tokens.preload, name="dashboard-tokenizer", daemon=True).start()
        try:
            yield
        finally:
            live.close()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    app = FastAPI(title="polar-mitm dashboard", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/api/openapi.json")
    app.state.live, app.state.cache, app.state.tokens = live, cache, tokens
    app.state.dbs, app.state.run_dir = dbs, run

    # -- the page ---------------------------------------------------------------------------
    def index() -> Response:
        version = max(int(p.stat().st_mtime) for p in STATIC.iterdir() if p.is_file())
        html = (STATIC / "index.html").read_text().replace("__V__", str(version))
        return Response(html, media_type="text/html; charset=utf-8", headers=NO_STORE)

    for route in ("/", "/groups", "/compare"):
        app.add_api_route(route, index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/groups/{rest:path}", index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/sessions/{rest:path}", index, methods=["GET"], include_in_schema=False)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(_ICON, media_type="image/svg+xml")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # -- the API ------------------------------------------------------------------------------
    @app.get("/api/info")
    def info() -> Response:
        return Response(orjson.dumps({"generation": live.generation, "dbs": data.db_list(dbs), "run_dir": run,
                                      "tokenizer": tokens.source, "poll_s": poll_s,
                                      "min_refresh_s": min_refresh_s}),
                        media_type="application/json", headers=NO_STORE)

    @app.get("/api/runs")
    async def runs() -> Response:
        return _json(await cache.get(("runs",), lambda: data.runs(dbs, run)))

    @app.get("/api/groups")
    async def groups() -> Response:
        return _json(await cache.get(("groups",), lambda: data.groups(dbs)))

    @app.get("/api/groups/{task_id:path}")
    async def group(task_id: str) -> Response:
        return _json(await cache.get(("group", task_id), lambda: data.group(dbs, task_id)))

    @app.get("/api/sessions/{session_id:path}")
    async def session(session_id: str) -> Response:
        return _json(await cache.get(("session", session_id), lambda: data.session(dbs, session_id, tokens)))

    @app.get("/api/compare")
    async def compare(a: str | None = None, b: str | None = None, task: str | None = None) -> Response:
        if task:
            return _json(await cache.get(("compare-task", task), lambda: data.compare_task(dbs, task)))
        if not a or not b:
            return _error(400, "give ?a=SESSION&b=SESSION, or ?task=TASK")
        ea = await cache.get(("session", a), lambda: data.session(dbs, a, tokens))
        eb = await cache.get(("session", b), lambda: data.session(dbs, b, tokens))
        missing = [sid for sid, e in ((a, ea), (b, eb)) if e.value is None]
        if missing:
            return _error(404, f"no such session: {', '.join(missing)}")
        body = b'{"generation":%d,"a":%s,"b":%s}' % (min(ea.generation, eb.generation), ea.body, eb.body)
        return Response(body, media_type="application/json", headers=NO_STORE)

    @app.get("/api/stream")
    async def stream(request: Request) -> StreamingResponse:
        """Server-sent events: `hello` with the generation at once, then `change` with
        {"generation": N} whenever the watched files change; a comment line when idle."""
        async def events() -> AsyncIterator[bytes]:
            seen = live.generation
            yield b"retry: 2000\nevent: hello\ndata: " + orjson.dumps({"generation": seen}) + b"\n\n"
            while not live.closed:
                got = await live.wait(seen, STREAM_PING_S)
                if live.closed:
                    break
                if got is None:
                    yield b": ping\n\n"
                    continue
                seen = got
                yield b"event: change\ndata: " + orjson.dumps({"generation": got}) + b"\n\n"
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**NO_STORE, "X-Accel-Buffering": "no"})

    return app


def close_streams(app: FastAPI) -> None:
    """End every event stream now (from any thread), so that a server's stop need not wait
    out its graceful timeout for them."""
    loop = getattr(app.state, "loop", None)
    if loop is not None and not loop.is_closed():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(app.state.live.close)
