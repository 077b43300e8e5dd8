"""Starting what runs on this machine: the Stack (vLLM and the proxy for polar-mitm up, demo,
rollout; a rollout server; gateway nodes around their proxies), owned by one object and
stopped together; task files and harness installs. Shared by the CLIs and the loop."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import click
import orjson

from . import launch
from .launch import Service
from .vllm import VLLMSettings
from ..models import DEFAULT_MODEL_NAME, ensure_default_model
from ..rollout import GatewayNode, NodeConfig, RolloutServer, TaskError, TaskRequest, parse_task
from ..rollout import harnesses
from ..rollout.node import probe_backend
from ..rollout.limits import DEFAULTS as DEFAULT_LIMITS
from ..rollout.runtime import LocalRuntime
from ..rollout.spec import check_workspace


@dataclass(frozen=True)
class Endpoints:
    """Where rollouts go: the rollout server, and the vLLM its node on this machine samples
    (None: a remote server's nodes have their own)."""
    server: str
    backend: str | None
    token: str | None = None    # the server's bearer token (one this stack started makes one)


class Stack:
    """What this process runs, in one place: services (vLLM, mitmdump: child processes), a
    rollout server and gateway nodes (threads of this process). stop() ends them in the
    reverse order of their start (nodes, the server, then the services), also when a start
    fails half-way (as a context manager)."""

    def __init__(self) -> None:
        self.services: list[Service] = []
        self.server: RolloutServer | None = None
        self.nodes: list[GatewayNode] = []
        self.weights: dict[str, str] = {}     # a vLLM this stack started (its URL) -> the weights it serves

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add(self, service: Service) -> Service:
        self.services.append(service)
        return service

    def start_model(self, logs: Path, vllm: VLLMSettings, model: str = "",
                    echo: Callable[[str], None] = click.echo) -> str:
        """vLLM serving `model` (a checkpoint of the default model, polar-train's, or any HF
        directory; default: the embedded default model); returns its URL."""
        model_dir = model or ensure_default_model(log=echo)
        vport = launch.free_port()
        echo(f"starting vLLM ({model_dir}, {vllm.dtype}) on 127.0.0.1:{vport}; "
             f"log {logs / 'vllm.log'} (first start takes minutes on CPU)")
        t0 = time.time()
        self.add(launch.start_vllm(model_dir, port=vport, served_name=DEFAULT_MODEL_NAME,
                                   log_path=logs / "vllm.log", settings=vllm))
        echo(f"vLLM ready after {time.time() - t0:.0f}s")
        url = f"http://127.0.0.1:{vport}"
        self.weights[url] = str(Path(model_dir).resolve())
        return url

    def _checkpoint_sets(self, backend: str, sets: list[str]) -> list[str]:
        """polar_policy_checkpoint for a backend this stack started (its gateway reloads those
        weights itself if it restarts), unless the caller gave one."""
        if backend in self.weights and not any(s.startswith("polar_policy_checkpoint=") for s in sets):
            return [*sets, f"polar_policy_checkpoint={self.weights[backend]}"]
        return sets

    def start_gateway(self, db: str, backend: str, port: int, reverse_port: int | None, confdir: str | Path,
                      logs: Path, vllm: VLLMSettings, model: str = "", control_token: str | None = None,
                      session_auth: bool = False) -> str:
        """vLLM (unless a backend is given) and the proxy before it; returns the backend.
        control_token: syncs on; session_auth (needs it): every call must carry its session's
        credential."""
        if not backend:
            backend = self.start_model(logs, vllm, model)
        self.add(launch.start_proxy(db=db, backend=backend, port=port, confdir=confdir,
                                    log_path=logs / "mitmdump.log", reverse_port=reverse_port,
                                    control_token=control_token,
                                    extra_sets=self._checkpoint_sets(
                                        backend, ["polar_session_auth=on"] if session_auth else [])))
        return backend

    def start_server(self, db: str, **options: Any) -> RolloutServer:
        self.server = RolloutServer(db, **options).start()
        return self.server

    def start_rollouts(self, *, server: str | None, backend: str | None, db: str, work: Path, weights: str,
                       version: int, vllm: VLLMSettings, workers: int, max_tokens: int | None,
                       temperature: float, fold_s: float | None = None,
                       echo: Callable[[str], None] = click.echo, limits: Mapping[str, Any] | None = None,
                       sync_mode: str = "auto") -> Endpoints:
        """Where the loop's rollouts run: a remote rollout server (its nodes bring their own
        vLLMs: nothing starts here), or on this machine vLLM serving `weights` as policy
        `version` (unless backend: a running one), a rollout server and one gateway node.
        fold_s: how often the server folds its journal by itself (None: its default)."""
        if server:
            return Endpoints(server=server, backend=None)
        backend = backend or self.start_model(work, vllm, weights, echo)
        # a token even on loopback: a session in the fallback sandbox shares the node's network
        started = self.start_server(db, token=secrets.token_urlsafe(32),
                                    **({"fold_s": fold_s} if fold_s is not None else {}))
        self.start_node(db=db, backend=backend, work=work, proxy_port=launch.free_port(), workers=workers,
                        max_tokens=max_tokens, server_url=started.url, temperature=temperature, limits=limits,
                        server_token=started.token,
                        extra_sets=[f"polar_policy_version={version}", f"polar_policy_checkpoint={weights}",
                                    f"polar_sync_mode={sync_mode}"])
        return Endpoints(server=started.url, backend=backend, token=started.token)

    def start_node(self, *, db: str, backend: str, work: Path, proxy_port: int, workers: int,
                   max_tokens: int | None, server_url: str, node_id: str | None = None,
                   extra_sets: list[str] | None = None, temperature: float | None = None,
                   server_token: str | None = None, limits: Mapping[str, Any] | None = None,
                   node_config: Mapping[str, Any] | None = None) -> GatewayNode:
        """The proxy (mitmdump) and a gateway node around it. The node alone holds the proxy's
        control token (handed to mitmdump in a file it removes): weight syncs come through
        the node, and each session's credential is made under it."""
        token = secrets.token_hex(16)
        sampling = ([f"max_tokens={max_tokens}"] if max_tokens else []) + \
            ([f"temperature={temperature}"] if temperature is not None else [])   # the policy's
        sets = [f"polar_sampling={','.join(sampling)}"] if sampling else []
        # Every call must carry its session's credential (made under the token): a session
        # cannot name a sibling's.
        sets = self._checkpoint_sets(backend, [*sets, "polar_session_auth=on", *(extra_sets or [])])
        confdir = work / "mitmproxy"
        self.add(launch.start_proxy(db=db, backend=backend, port=proxy_port, confdir=confdir,
                                    log_path=work / "mitmdump.log", extra_sets=sets, control_token=token))
        cfg = NodeConfig(server_url=server_url, proxy_port=proxy_port,
                         ca_path=str(confdir / "mitmproxy-ca-cert.pem"), db=db, control_token=token,
                         init_workers=workers, run_workers=workers, post_workers=max(1, workers // 2),
                         backend_url=backend, server_token=server_token)
        if node_id:
            cfg.node_id = node_id
        for key, value in (node_config or {}).items():   # a Ray node's: its calls shipped, its files' cache
            setattr(cfg, key, value)
        # each session's limits: these (--session-limit) over the defaults, its task's over them
        runtime = LocalRuntime(work / "sessions", limits=DEFAULT_LIMITS.merged(limits))
        node = GatewayNode(cfg, runtime=runtime).start()
        self.nodes.append(node)
        return node

    def dead(self) -> list[Service]:
        return [s for s in self.services if not s.alive()]

    def why_dead(self) -> str:
        """The services that stopped, each with its log's last lines ("" while all run)."""
        return "; ".join(f"{s.name}: {s.tail(5)}" for s in self.dead())

    def stop_nodes(self) -> None:
        """The nodes first: each stores the rewards the server settled before it returns."""
        _each(self.nodes, lambda node: node.stop())

    def stop(self) -> None:
        """Every part, in order (nodes, server, services), each stopped even when another's
        stop failed (a fold that timed out, an interrupt): a proxy left running would hold the
        database from the next run. The first failure is raised once all are stopped."""
        errors: list[BaseException] = []
        for step in (self.stop_nodes, self._stop_server, lambda: _each(self.services, lambda s: s.stop())):
            try:
                step()
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _stop_server(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()


def _each(items: list, stop: Callable[[Any], None]) -> None:
    """Pops and stops every item, last first, all of them whatever fails; then raises the
    first failure."""
    errors: list[BaseException] = []
    while items:
        try:
            stop(items.pop())
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]


def relative_to(task, base: Path):
    """A task of a task file, with its relative paths (its workspace's path or local git
    repository, its runtime's image where one is there, its prepare actions' copies) taken
    from the file's directory, so that a task file and its repositories travel together."""
    if not isinstance(task, dict):
        return task

    def here(p):
        return str(base / p) if isinstance(p, str) and p and not os.path.isabs(p) and (base / p).exists() else p

    task = dict(task)
    ws = task.get("workspace")
    if isinstance(ws, str):
        task["workspace"] = here(ws)
    elif isinstance(ws, dict):
        task["workspace"] = {**ws, **{k: here(ws[k]) for k in ("path", "git") if k in ws}}
    rt = task.get("runtime")
    if isinstance(rt, str):
        task["runtime"] = here(rt)
    elif isinstance(rt, dict):
        rt = {**rt, **({"image": here(rt["image"])} if "image" in rt else {})}
        for key in ("prepare", "eval_prepare"):
            if isinstance(rt.get(key), list):
                rt[key] = [{**a, "copy": here(a["copy"])} if isinstance(a, dict) and "copy" in a else a
                           for a in rt[key]]
        task["runtime"] = rt
    return task


def read_tasks(path: str, harness: str | None, samples: int | None) -> list[TaskRequest]:
    """The tasks of a JSONL file; a bad line or a task_id given twice is an error that names
    its line(s)."""
    tasks: list[TaskRequest] = []
    lines: dict[str, int] = {}
    try:
        f = open(path, "rb")
    except OSError as e:
        raise click.ClickException(f"{path}: cannot read the task file: {e.strerror or e}")
    with f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise click.ClickException(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                                           f"column {len(raw[:e.start].decode('utf-8', 'replace')) + 1})")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                task = parse_task(relative_to(orjson.loads(line), Path(path).resolve().parent), harness=harness,
                                  samples=samples)
            except (orjson.JSONDecodeError, TaskError) as e:
                raise click.ClickException(f"{path}:{n}: {e}")
            if task.task_id in lines:
                raise click.ClickException(f"{path}:{n}: task_id {task.task_id} is on line "
                                           f"{lines[task.task_id]} already (task ids are unique)")
            lines[task.task_id] = n
            tasks.append(task)
    if not tasks:
        raise click.ClickException(f"{path}: no tasks")
    return tasks


def check_workspaces(tasks: Iterable[TaskRequest]) -> None:
    """Every task's workspace (directory, git repo and commit) is there, before anything starts."""
    for t in tasks:
        try:
            check_workspace(t)
        except TaskError as e:
            raise click.ClickException(str(e))


def check_backend(url: str) -> None:
    """A --backend that does not answer is an error at start, not a failed session each."""
    error = probe_backend(url, timeout=10.0)
    if error:
        raise click.ClickException(f"{error} (--backend {url})")


def ensure_harnesses(names: Iterable[str]) -> None:
    """The CLIs of these harnesses installed (those with a package: the registry's)."""
    for name in sorted(set(names) & set(harnesses.PACKAGES)):
        try:
            harnesses.executable(name)
        except harnesses.HarnessMissing:
            pkg = harnesses.PACKAGES[name]
            click.echo(f"installing {name} ({pkg.npm}@{pkg.version})")
            harnesses.install(name)
