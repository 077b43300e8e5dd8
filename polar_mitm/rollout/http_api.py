"""The rollout server's HTTP API: FastAPI on uvicorn, served from a thread of the process that
holds the RolloutServer (server.py; this module knows it only through the RolloutAPI protocol).

Requests and answers are typed: a task is TaskIn (here), every other message is protocol.py's
(heartbeats and their events, the policy, groups), which pydantic validates. A request that
does not fit its type gets 400 and names the field; a task that fits is then checked by
spec.parse_task, the one place that says what a task may be. Every
error answers {"error": {"message": ...}}, mapped from the exception's type: TaskExists 409
(a rerun resumes it), TaskChanged 422 (with "changed"), any other TaskError 400, no such task
404, and state that could not be saved 503 (the client retries).

In front of every route (server.py wraps the app): web_guard.py, which answers only the
server's own Host names (421 otherwise: DNS rebinding), takes no POST without
`content-type: application/json` (415: a cross-site form or no-cors fetch), and asks for the
bearer token once the server has one (401; always beyond loopback).

Every endpoint is a plain `def`: FastAPI runs it in a worker thread, so a heartbeat that waits
on DuckDB (its events are durable before the node hears back) never holds the event loop, and
the other requests go on meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from typing import Annotated, Any, Iterable, Iterator, Literal, Mapping, Protocol

import anyio.to_thread
import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictInt, StrictStr, Tag
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException

from .protocol import (CancelReply, CancelRequest, Group, GroupsReply, GroupsRequest, Heartbeat, HeartbeatReply,
                       Number, PolicyRequest, PolicyStatus, PolicyTarget, Status, SubmitReply, Submitted, TaskList,
                       TaskStatus, WeightPull)
from .spec import (ENGINES, HARNESSES, LOG_PARSERS, NETWORKS, ON_FAILURE, REWARD_COVERS, TaskChanged, TaskError,
                   TaskExists, TaskRequest,
                   parse_task)

log = logging.getLogger("polar.rollout")

Seconds = Number                            # an int or a float (not a bool, not a string)
_TASK_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TaskRequest)}


class RolloutAPI(Protocol):
    """What the API serves: a RolloutServer's Python API (server.py)."""
    def task_views(self, task_ids: Iterable[str] | None = None) -> Mapping[str, Any]: ...   # those it holds
    def submit(self, task: TaskRequest) -> list[str]: ...
    def task_list(self) -> list[Any]: ...
    def task_status(self, task_id: str) -> TaskStatus | None: ...
    def group(self, task_id: str) -> Group: ...
    def cancel(self, task_id: str, reason: str = ...) -> bool: ...
    def status(self) -> Status: ...
    def policy_status(self) -> PolicyStatus: ...
    def set_policy(self, version: int, checkpoint: str, asleep: bool = False,
                   pull: WeightPull | None = None) -> PolicyTarget: ...
    def heartbeat(self, body: Heartbeat) -> HeartbeatReply: ...
    def file_blob(self, sha256: str) -> str | None: ...     # a shipped blob's file (ship_files)


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- tasks ---------------------------------------------------------------------------------------
def _shorthand(key: str, shape: str):
    """A string stands for {key: string} (a workspace's path, an evaluator's command)."""
    def check(v):
        if isinstance(v, str):
            return {key: v}
        if v is not None and not isinstance(v, dict):
            raise PydanticCustomError("shape", f"must be {shape}")
        return v
    return check


class WorkspaceIn(_In):
    path: StrictStr | None = None
    git: StrictStr | None = None
    commit: StrictStr | None = None


class EvaluatorIn(_In):
    command: StrictStr
    timeout: Seconds = 120.0


class TestsEvaluatorIn(_In):
    kind: Literal["tests"]
    fail_to_pass: list[StrictStr]
    pass_to_pass: list[StrictStr] | None = None
    test_command: StrictStr | None = None
    log_parser: Literal[LOG_PARSERS] | None = None      # type: ignore[valid-type]
    timeout: Seconds = 900.0
    exclude: list[StrictStr] | None = None
    plugins: list[StrictStr] | None = None


class ActionIn(_In):
    run: StrictStr | None = None
    copy_: StrictStr | None = Field(None, alias="copy", serialization_alias="copy")   # not BaseModel.copy
    to: StrictStr | None = None
    timeout: Seconds = 600.0


class RuntimeIn(_In):
    image: StrictStr
    workdir: StrictStr | None = None
    env: dict[str, StrictStr] | None = None
    prepare: list[ActionIn | StrictStr] | None = None
    eval_prepare: list[ActionIn | StrictStr] | None = None
    network: Literal[NETWORKS] | None = None            # type: ignore[valid-type]
    engine: Literal[ENGINES] | None = None              # type: ignore[valid-type]


def _evaluator_kind(v: Any) -> str:
    kind = v.get("kind") if isinstance(v, dict) else getattr(v, "kind", None)
    return kind if kind in EVALUATOR_TAGS else "command"


EVALUATOR_TAGS = ("tests", "command")   # an evaluator's kind: the errors name the fields of that kind only
_EvaluatorKinds = Annotated[Annotated[TestsEvaluatorIn, Tag("tests")] | Annotated[EvaluatorIn, Tag("command")],
                            Discriminator(_evaluator_kind)]
_WORKSPACE = BeforeValidator(_shorthand("path", "a path, or an object with path, or git and commit"))
_EVALUATOR = BeforeValidator(_shorthand("command", "a shell line, or an object with command and timeout"))


class TaskIn(_In):
    """A task (spec.TaskRequest) as it comes in: the types here; what else a task must be
    (a valid task_id, positive timeouts, a workspace that is there) in spec.py."""
    task_id: StrictStr
    instruction: StrictStr
    harness: Literal[HARNESSES] = _TASK_DEFAULTS["harness"]          # type: ignore[valid-type]
    workspace: Annotated[WorkspaceIn | None, _WORKSPACE] = Field(
        None, description="a directory: its path, or an object with path, or git and commit")
    num_samples: StrictInt = _TASK_DEFAULTS["num_samples"]
    timeout: Seconds = _TASK_DEFAULTS["timeout"]
    evaluator: Annotated[_EvaluatorKinds | None, _EVALUATOR] = Field(
        None, description="a shell line, an object with command and timeout, or {kind: tests, fail_to_pass, ...}")
    priority: StrictInt = _TASK_DEFAULTS["priority"]
    callback_url: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    early_stop: StrictInt | None = None
    command: StrictStr | None = None
    on_failure: Literal[ON_FAILURE] = _TASK_DEFAULTS["on_failure"]    # type: ignore[valid-type]
    reward_covers: Literal[REWARD_COVERS] = _TASK_DEFAULTS["reward_covers"]  # type: ignore[valid-type]
    runtime: Annotated[RuntimeIn | None, BeforeValidator(_shorthand("image", "an image, or an object with image"))] \
        = Field(None, description="an environment image: a reference, or an object with image, workdir, env, "
                                  "prepare, eval_prepare, network")
    min_complete_fraction: Seconds = _TASK_DEFAULTS["min_complete_fraction"]
    mcp_servers: dict[str, Any] | None = None
    skills: dict[str, Any] | None = None
    judge: dict[str, Any] | StrictStr | None = None
    limits: dict[str, Any] | None = Field(None, description="what each session may use: memory, disk, log "
                                                            "(bytes or \"512MiB\"), pids, nofile, cpus")


# -- errors --------------------------------------------------------------------------------------
class NoSuchTask(LookupError):
    def __init__(self, task_ids: list[str]):
        super().__init__(f"no such task: {task_ids[0]}" if len(task_ids) == 1
                         else f"no such task(s): {', '.join(task_ids[:5])}")


class NotSaved(RuntimeError):
    """The state could not be saved (the database stayed busy): the client may retry."""


def _error(status: int, message: str, **extra) -> JSONResponse:
    return JSONResponse({"error": {"message": message, **extra}}, status_code=status)


_UNION_TAGS = {TaskIn.__name__: dict, f"list[{TaskIn.__name__}]": list}   # POST /tasks: one, or a list


def _field_errors(exc: RequestValidationError) -> list[dict]:
    """pydantic's errors as {"field", "message", "task_id"}: the field named from the body down,
    and of POST /tasks (a task, or a list of them) only the branch the body's shape took, each
    error with its task's task_id where the task has one."""
    body, out = exc.body, []
    for e in exc.errors():
        loc, task = list(e.get("loc") or ())[1:], None          # after "body"
        if loc and loc[0] in _UNION_TAGS:
            if not isinstance(body, _UNION_TAGS[loc[0]]):
                continue
            loc, task = loc[1:], body
            if isinstance(body, list) and loc and isinstance(loc[0], int) and loc[0] < len(body):
                task = body[loc[0]]
                if not (isinstance(task, dict) and isinstance(task.get("task_id"), str)):
                    loc[0] = f"tasks[{loc[0]}]"      # no task_id to name it by
                else:
                    loc = loc[1:]
        loc = [p for i, p in enumerate(loc) if not (i and loc[i - 1] == "evaluator" and p in EVALUATOR_TAGS)]
        where = ".".join(str(p) for p in loc)
        tid = task.get("task_id") if isinstance(task, dict) else None
        out.append({"field": where, "message": e.get("msg", "invalid"),
                    "task_id": tid if isinstance(tid, str) else None})
    return out


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    bad_json = [e for e in errors if e.get("type") == "json_invalid"]
    if bad_json:
        e = bad_json[0]
        return _error(400, f"invalid JSON: {(e.get('ctx') or {}).get('error', 'cannot parse it')} "
                           f"(character {e['loc'][-1]})")
    if isinstance(exc.body, (bytes, bytearray)):
        return _error(415, "send the body as JSON, with content-type: application/json")
    if any(e.get("type") == "missing" and tuple(e.get("loc") or ()) == ("body",) for e in errors):
        return _error(400, "a JSON body is required")
    fields = _field_errors(exc) or [{"field": "", "message": "the body does not fit", "task_id": None}]
    parts = []
    for f in fields:
        head = ": ".join(p for p in (f["task_id"], f["field"]) if p)
        parts.append(f"{head}: {f['message']}" if head else f["message"])
    return _error(400, "; ".join(dict.fromkeys(parts)),
                  fields=[{"field": f["field"], "message": f["message"]} for f in fields])


# Errors mapped by the exception's type (the first that matches); TaskChanged says what changed.
_STATUS: list[tuple[type[Exception], int]] = [
    (TaskExists, 409),          # the same task: a rerun resumes it
    (TaskChanged, 422),         # another spec under that id: refused
    (TaskError, 400),
    (NoSuchTask, 404),
    (NotSaved, 503),            # the client retries
]


async def _mapped(request: Request, e: Exception) -> JSONResponse:
    status = next(code for kind, code in _STATUS if isinstance(e, kind))
    extra = {"changed": e.changes} if isinstance(e, TaskChanged) else {}
    return _error(status, str(e), **extra)


async def _http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, HTTPException)
    if e.status_code == 404:
        return _error(404, f"no route {request.url.path}")
    if e.status_code == 405:
        return _error(405, f"{request.method} is not allowed on {request.url.path}")
    return _error(e.status_code, str(e.detail))


@contextmanager
def _saved(what: str, answer: str) -> Iterator[None]:
    """An error other than a bad task is state not saved (e.g. the database stayed busy):
    503 that says `answer`, and the client retries."""
    try:
        yield
    except TaskError:
        raise
    except Exception as e:
        log.exception("%s failed", what)
        raise NotSaved(f"{answer}: {e}") from e


def make_app(server: RolloutAPI, threads: int = 64) -> FastAPI:
    """The API of a RolloutServer (any object with its methods). threads: worker threads for
    the endpoints (a heartbeat waiting on the database holds one)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        yield

    app = FastAPI(title="polar-mitm rollout server", lifespan=lifespan, openapi_url="/openapi.json",
                  docs_url=None, redoc_url=None)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_error)
    for kind, _ in _STATUS:
        app.add_exception_handler(kind, _mapped)

    def _known(task_ids: list[str]) -> None:
        held = server.task_views(task_ids)
        missing = [t for t in task_ids if t not in held]
        if missing:
            raise NoSuchTask(missing)

    # -- tasks -------------------------------------------------------------------------------
    @app.post("/tasks", status_code=202, response_model=SubmitReply)
    def submit(tasks: Annotated[TaskIn | list[TaskIn], Body()]) -> SubmitReply:
        """Queue one task or a list of them; each answers its session ids once they are saved."""
        given = tasks if isinstance(tasks, list) else [tasks]
        specs = [parse_task(t.model_dump(exclude_unset=True, by_alias=True)) for t in given]
        ids = [t.task_id for t in specs]
        twice = sorted({t for t in ids if ids.count(t) > 1})
        if twice:
            raise TaskError(f"task_id {', '.join(twice)} given twice in one request")
        out = []
        for s in specs:
            with _saved(f"submitting {s.task_id}", "not saved yet, retry"):
                out.append(Submitted(task_id=s.task_id, sessions=server.submit(s)))
        return SubmitReply(tasks=out)

    @app.get("/tasks", response_model=TaskList)
    def list_tasks() -> TaskList:
        return TaskList(tasks=server.task_list())

    @app.get("/tasks/{task_id}", response_model=TaskStatus)
    def task_status(task_id: str) -> TaskStatus:
        st = server.task_status(task_id)
        if st is None:
            raise NoSuchTask([task_id])
        return st

    @app.get("/tasks/{task_id}/group", response_model=Group)
    def group(task_id: str) -> Group:
        _known([task_id])
        return server.group(task_id)

    @app.post("/tasks/{task_id}/cancel", response_model=CancelReply)
    def cancel(task_id: str, body: Annotated[CancelRequest | None, Body()] = None):
        ok = server.cancel(task_id, (body or {}).get("reason") or "cancelled by request")
        if not ok:
            return JSONResponse(CancelReply(task_id=task_id, cancelled=False), status_code=404)
        return CancelReply(task_id=task_id, cancelled=True)

    @app.post("/groups", response_model=GroupsReply)
    def groups(body: Annotated[GroupsRequest | None, Body()] = None) -> GroupsReply:
        ids = (body or {}).get("task_ids", [])
        _known(ids)
        return GroupsReply(groups=[server.group(t) for t in ids])

    @app.get("/status", response_model=Status)
    def status() -> Status:
        return server.status()

    # -- the policy --------------------------------------------------------------------------
    @app.get("/policy", response_model=PolicyStatus)
    def policy_status() -> PolicyStatus:
        return server.policy_status()

    @app.post("/policy", response_model=PolicyTarget)
    def set_policy(body: PolicyRequest) -> PolicyTarget:
        return server.set_policy(body["version"], body["checkpoint"], body.get("asleep", False), body.get("pull"))

    # -- nodes -------------------------------------------------------------------------------
    @app.post("/nodes/heartbeat", response_model=HeartbeatReply)
    def heartbeat(body: Heartbeat) -> HeartbeatReply:
        """A node's load, its sessions' state changes and its policy; answered (once saved)
        with new sessions, cancellations, settled outcomes and the policy to serve."""
        with _saved("heartbeat", "state not saved"):      # the node keeps its events and retries
            return server.heartbeat(body)

    @app.get("/files/{sha256}", response_class=FileResponse)
    def file_blob(sha256: str):
        """A blob of a task's shipped files (RolloutServer(ship_files=True)): only one the
        server packed; the name is a sha256 or nothing is looked up."""
        path = server.file_blob(sha256)        # None for anything but a blob it packed
        if path is None:
            return _error(404, "no such file")
        return FileResponse(path, media_type="application/x-tar")

    return app


# -- serving -------------------------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    """Listening already, so that the port (0: any free one) is known before the server runs.
    IPPROTO_TCP by name: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    every answer (headers, then body) waits out a delayed ACK, 40 ms."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


class ThreadedUvicorn:
    """An ASGI app on uvicorn, in a thread of this process (no signal handlers: those stay the
    process's own). The socket is bound on creation: .port is known before start()."""

    def __init__(self, app: Any, host: str, port: int, name: str = "http"):
        self.name = name
        self._sock = _bind(host, port)
        self.port = self._sock.getsockname()[1]
        # log_config=None: the process's logging is left as it is. Keep-alive outlasts the
        # clients' own (httpx: 5 s), so it is always a client that closes an idle connection
        # and never the server under a request just sent.
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="on",
                                timeout_keep_alive=30, timeout_graceful_shutdown=5, server_header=False,
                                backlog=2048)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> None:
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the {self.name} server did not start")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the {self.name} server did not start in {timeout:.0f}s")
            time.sleep(0.005)

    def stop(self, timeout: float = 10.0) -> None:
        """Stops taking connections, lets requests in flight finish (5 s at most), returns."""
        if self._thread is None:
            self._sock.close()
            return
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
