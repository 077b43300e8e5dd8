"""Starting what runs on this machine: vLLM and the proxy (polar-mitm up, demo, rollout), a
rollout server's gateway node around its proxy, task files, harness installs, and SIGTERM
handling. Shared by the CLIs and the loop."""

from __future__ import annotations

import secrets
import signal
import time
from pathlib import Path

import click
import orjson

from . import launch
from .models import DEFAULT_MODEL_NAME, ensure_default_model
from .rollout import GatewayNode, NodeConfig, TaskError, parse_task
from .rollout.node import probe_backend
from .rollout.spec import check_workspace
from .rollout import harnesses
from .rollout.runtime import LocalRuntime


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM; exit_code is the shell's 128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interrupted_exit_code(e: KeyboardInterrupt) -> int:
    """130 after SIGINT (a plain KeyboardInterrupt too), 143 after SIGTERM."""
    return e.exit_code if isinstance(e, Interrupted) else 128 + signal.SIGINT


def stop_on_sigterm() -> None:
    """SIGTERM (systemd, docker, kill) stops the children as Ctrl-C does; by default it would
    end this process at once and leave mitmdump listening and holding the database. Both
    raise Interrupted (a KeyboardInterrupt) that knows its signal, for the exit code."""
    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # once: the cleanup must not be cut short
        raise Interrupted(signal.SIGTERM)

    def ctrl_c(signum, frame):
        raise Interrupted(signal.SIGINT)
    signal.signal(signal.SIGTERM, interrupt)
    # Ctrl-C too, even when started with SIGINT ignored (a background job of a script):
    # Python then keeps it ignored, and the stack could only be stopped by SIGTERM.
    signal.signal(signal.SIGINT, ctrl_c)


def start_stack(db, backend, port, reverse_port, confdir, logs: Path, max_model_len, proxy=True,
                 model: str = "", dtype: str = "float32"):
    services = []
    try:
        return start_services(services, db, backend, port, reverse_port, confdir, logs, max_model_len,
                               proxy, model, dtype)
    except BaseException:  # e.g. the proxy failed, or SIGTERM, after vLLM started
        for s in reversed(services):
            s.stop()
        raise


def start_services(services, db, backend, port, reverse_port, confdir, logs, max_model_len, proxy,
                    model: str = "", dtype: str = "float32"):
    if not backend:
        # model: a checkpoint of the default model (polar-train's) or any HF directory
        model_dir = model or ensure_default_model(log=click.echo)
        vport = launch.free_port()
        click.echo(f"starting vLLM ({model_dir}, {dtype}) on 127.0.0.1:{vport}; "
                   f"log {logs / 'vllm.log'} (first start takes minutes on CPU)")
        t0 = time.time()
        services.append(launch.start_vllm(
            model_dir, port=vport, served_name=DEFAULT_MODEL_NAME, log_path=logs / "vllm.log",
            max_model_len=max_model_len, chat_template=launch.TEMPLATES / "smollm2_tools.jinja", dtype=dtype))
        click.echo(f"vLLM ready after {time.time() - t0:.0f}s")
        backend = f"http://127.0.0.1:{vport}"
    if not proxy:
        return services, backend
    services.append(launch.start_proxy(db=db, backend=backend, port=port, confdir=confdir,
                                       log_path=logs / "mitmdump.log", reverse_port=reverse_port))
    return services, backend


def read_tasks(path: str, harness: str | None, samples: int | None) -> list:
    """The tasks of a JSONL file; a bad line or a task_id given twice is an error that names
    its line(s)."""
    tasks, lines = [], {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                task = parse_task(orjson.loads(line), harness=harness, samples=samples)
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


def check_workspaces(tasks) -> None:
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


def ensure_harnesses(names) -> None:
    for name in sorted(set(names) - {"command"}):
        try:
            harnesses.executable(name)
        except harnesses.HarnessMissing:
            click.echo(f"installing {name} ({harnesses.PACKAGES[name].npm}@{harnesses.PACKAGES[name].version})")
            harnesses.install(name)


def start_node_stack(*, db: str, backend: str, work: Path, proxy_port: int, workers: int,
                     max_tokens: int | None, server_url: str, node_id: str | None = None,
                     extra_sets: list[str] | None = None, temperature: float | None = None):
    """The proxy (mitmdump) and a gateway node around it; returns (proxy service, node). The
    node alone holds the proxy's control token: weight syncs come through the node."""
    token = secrets.token_hex(16)
    sampling = ([f"max_tokens={max_tokens}"] if max_tokens else []) + \
        ([f"temperature={temperature}"] if temperature is not None else [])   # the policy's
    sets = [f"polar_sampling={','.join(sampling)}"] if sampling else []
    sets += [f"polar_control_token={token}", *(extra_sets or [])]
    confdir = work / "mitmproxy"
    proxy = launch.start_proxy(db=db, backend=backend, port=proxy_port, confdir=confdir,
                               log_path=work / "mitmdump.log", extra_sets=sets)
    cfg = NodeConfig(server_url=server_url, proxy_port=proxy_port, ca_path=str(confdir / "mitmproxy-ca-cert.pem"),
                     db=db, control_token=token, init_workers=workers, run_workers=workers, post_workers=max(1, workers // 2),
                     backend_url=backend)
    if node_id:
        cfg.node_id = node_id
    node = GatewayNode(cfg, runtime=LocalRuntime(work / "sessions")).start()
    return proxy, node


def stop_stack(node, server, services) -> None:
    """Stop a node, a rollout server and services, in the reverse order of their start."""
    if node:
        node.stop()
    if server:
        server.stop()
    for s in reversed(services):
        s.stop()
