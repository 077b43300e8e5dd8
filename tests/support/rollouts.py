"""Rollouts over a test's proxy, in the test's process: a rollout server on the proxy's
database and one gateway node around the proxy (what `polar-mitm rollout` runs), stopped
together, the node first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar_mitm.rollout import GatewayNode, NodeConfig, RolloutServer, harnesses
from polar_mitm.rollout.runtime import LocalRuntime, Runtime
from support.inprocess_proxy import ProxyLayout


class Rollouts:
    """server and node over `proxy`. runtime: the node's (a directory: LocalRuntime's sessions
    there); workers: its INIT and RUN slots; server_options: RolloutServer's; node_options:
    NodeConfig's (a heartbeat of 0.1 s unless given)."""

    def __init__(self, proxy: ProxyLayout, runtime: Runtime | Path, *, workers: int = 2,
                 server_options: dict[str, Any] | None = None, launcher=harnesses.launch, **node_options: Any):
        self.server = RolloutServer(str(proxy.db), **(server_options or {})).start()
        try:
            cfg = NodeConfig(**{"server_url": self.server.url, "proxy_port": proxy.port, "ca_path": proxy.ca,
                                "db": str(proxy.db), "init_workers": workers, "run_workers": workers,
                                "heartbeat_s": 0.1, **node_options})
            self.node = GatewayNode(cfg, runtime=LocalRuntime(runtime) if isinstance(runtime, Path) else runtime,
                                    launcher=launcher).start()
        except BaseException:
            self.server.stop()
            raise

    def run(self, tasks: list[dict], timeout: float) -> dict[str, dict]:
        """Submits the tasks, waits until every one is settled, and returns their groups by id."""
        for task in tasks:
            self.server.submit(task)
        ids = [t["task_id"] for t in tasks]
        assert self.server.wait(ids, timeout=timeout), {tid: self.server.task_status(tid) for tid in ids}
        return {tid: self.server.group(tid) for tid in ids}

    def stop(self) -> None:
        try:
            self.node.stop()      # stores the rewards the server settled before it returns
        finally:
            self.server.stop()

    def __enter__(self) -> "Rollouts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def session_logs(runtime: LocalRuntime, chars: int = 3000) -> str:
    """The tail of each session's logs, for an assertion's message (a runtime that keeps its
    sessions: LocalRuntime(keep=True))."""
    return "\n".join(p.read_text(errors="replace")[-chars:] for p in runtime.base.glob("*/logs/*.log"))


def installed(name: str) -> Path:
    """The harness CLI `name`, installed from npm at its pinned version (its executable); the
    test is skipped where it cannot be (no npm, or the registry refused)."""
    try:
        return harnesses.install(name)
    except harnesses.HarnessMissing as e:
        pytest.skip(f"{name} could not be installed from npm: {e}")
