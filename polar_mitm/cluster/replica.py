"""A vLLM replica on a Ray cluster, and the one way its weights change: swap().

A replica is owned by its actor (Replica, made a Ray actor by ray_stack.py), not by the
gateways that send it calls: several gateways on several machines share it, so none of them
may pause or reload it (their proxies run with polar_weights_owner=external and only read its
tag). The driver swaps every replica itself: the new weights are pulled from the trainer's
memory over HTTP (vllm_ext/weight_pull.py: fetched and checked while the engine serves, then
pause(keep, clear_cache) -> load -> tag polar-vN -> resume), so no machine reads another's
disk, and every token carries the version of the replica that sampled it (the engine's spans).

A replica that dies is restarted by Ray (the actor's constructor runs again): it starts vLLM,
asks the rollout server which version is current, loads it (or tags the base weights v0), and
only then answers ready(); until it is tagged, its gateways record no version for its tokens
(polar_weights_owner=external takes an untagged engine as lost)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import httpx

from ..addons.backend_client import weight_tag
from ..rollout.protocol import WeightPull
from ..stack.vllm import VLLMSettings


class SwapFigures(TypedDict):
    """One replica's swap, in seconds: prefetch (while it serves), then the stall (paused)."""
    url: str
    version: int
    prefetch_s: float
    stall_s: float
    total_s: float


class SwapError(RuntimeError):
    pass


def _post(client: httpx.Client, url: str, path: str, body: dict | None = None) -> dict:
    r = client.post(f"{url}{path}", json=body or {})
    if r.status_code != 200:
        raise SwapError(f"{url}{path.partition('?')[0]}: {r.status_code} {r.text[:300]}")
    try:
        return r.json()
    except ValueError:
        return {}


def swap(url: str, version: int, pull: WeightPull | None, timeout: float = 900.0) -> SwapFigures:
    """The backend at url (vLLM in dev mode with polar-mitm's worker extension) loads the
    pulled weights in flight and is tagged polar-v{version}; pull None: only tagged (the
    weights it serves are that version already). Never leaves the engine paused."""
    t0 = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), trust_env=False) as client:
        prefetch_s = 0.0
        if pull is not None:
            rpc = {"method": "polar_prefetch_weights", "kwargs": {"url": pull["url"], "sha256": pull["sha256"]}}
            while True:   # fetched and checked while the engine still serves
                states = [r.get("state") for r in _post(client, url, "/collective_rpc", rpc).get("results", [])]
                if "failed" in states:
                    raise SwapError(f"{url}: the weight pull failed: {states}")
                if states and all(s == "ready" for s in states):
                    break
                if time.monotonic() - t0 > timeout:
                    raise SwapError(f"{url}: the weights were not fetched within {timeout:g}s")
                time.sleep(0.05)
            prefetch_s = time.monotonic() - t0
        t1 = time.monotonic()
        paused = False
        try:
            if pull is not None:
                _post(client, url, "/pause?mode=keep&clear_cache=true")
                paused = True
                _post(client, url, "/collective_rpc",
                      {"method": "polar_pull_weights", "kwargs": {"url": pull["url"], "sha256": pull["sha256"]}})
            _post(client, url, "/update_weight_version", {"new_version": weight_tag(version)})
        finally:
            if paused:
                _resume(client, url)
        stall_s = time.monotonic() - t1
    return SwapFigures(url=url, version=version, prefetch_s=round(prefetch_s, 4), stall_s=round(stall_s, 4),
                       total_s=round(time.monotonic() - t0, 4))


def _resume(client: httpx.Client, url: str, tries: int = 5) -> None:
    for i in range(tries):
        try:
            _post(client, url, "/resume")
            return
        except (httpx.HTTPError, SwapError):
            if i == tries - 1:
                raise
            time.sleep(0.2 * (i + 1))


def served_tag(url: str, timeout: float = 10.0) -> str | None:
    """The tag of the weights the backend serves (vLLM's /weight_info, dev mode)."""
    r = httpx.get(f"{url}/weight_info", timeout=timeout, trust_env=False)
    r.raise_for_status()
    tag = r.json().get("weight_version")
    return None if tag is None else str(tag)


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica actor is made from (Ray passes it to the constructor again on restart)."""
    index: int
    server_url: str                      # the rollout server: the current version, on (re)start
    server_token: str = field(repr=False)
    model: str = ""                      # a model folder present on every node ("": the embedded default)
    settings: VLLMSettings = field(default_factory=VLLMSettings)
    host: str = ""                       # where vLLM listens ("": this node's address)
    port: int = 0                        # 0: a free one
    # a server to run instead of vLLM, given --host H --port P (the test suite's stand-in,
    # with vLLM's dev-mode and token routes)
    argv: tuple[str, ...] = ()
    dp: int = 1                          # vLLM's own data parallelism: engines behind this one server
    start_timeout: float = 1800.0        # vLLM's first start on a loaded CPU node compiles for many minutes


class Replica:
    """vLLM on this Ray node, owned by this object (a Ray actor: polar-vllm-I)."""

    def __init__(self, spec: ReplicaSpec, work: str | None = None):
        from ..models import DEFAULT_MODEL_NAME, ensure_default_model
        from ..stack import launch
        from .ray_env import node_address, node_dir

        self.spec = spec
        host = spec.host or node_address()
        folder = Path(work) if work else node_dir(f"vllm-{spec.index}")
        folder.mkdir(parents=True, exist_ok=True)
        port = spec.port or _kept_port(folder / "port", host)
        self.url = f"http://{host}:{port}"
        if spec.argv:
            self.service = launch.Service(f"replica-{spec.index}", [*spec.argv, "--host", host, "--port", str(port)],
                                          log_path=folder / "vllm.log")
            launch.wait_http(f"{self.url}/v1/models", self.service, min(120.0, spec.start_timeout))
        else:
            model = spec.model or str(ensure_default_model(log=lambda _: None))
            # with --data-parallel-size one pause/reload/tag/resume reaches every engine
            self.service = launch.start_vllm(model, port=port, served_name=DEFAULT_MODEL_NAME,
                                             log_path=folder / "vllm.log", settings=spec.settings, host=host,
                                             extra_args=["--data-parallel-size", str(spec.dp)] if spec.dp > 1 else None,
                                             timeout=spec.start_timeout)
        self.loaded = self._load_current()

    def _load_current(self) -> SwapFigures:
        """The rollout server's current version: pulled and tagged (a restart), or v0 tagged."""
        from ..rollout.client import ServerClient

        client = ServerClient(self.spec.server_url, token=self.spec.server_token)
        try:
            target = client.policy_status()["target"]
        finally:
            client.close()
        version = int(target["version"]) if target else 0
        pull = target.get("pull") if target and version else None
        if version and not pull:
            raise SwapError(f"version {version} has no weights to pull: a replica reads no other machine's disk")
        return swap(self.url, version, pull)

    def ready(self) -> dict[str, Any]:
        return {"url": self.url, "index": self.spec.index, "loaded": self.loaded, "tag": served_tag(self.url),
                "dp": self.spec.dp}

    def address(self) -> str:
        return self.url

    def swap(self, version: int, pull: WeightPull | None) -> SwapFigures:
        if not self.service.alive():
            raise SwapError(f"vLLM of replica {self.spec.index} stopped: {self.service.tail(5)}")
        return swap(self.url, version, pull)

    def tag(self) -> str | None:
        return served_tag(self.url)

    def stop(self) -> None:
        self.service.stop()


def _free_port(host: str, port: int = 0) -> int:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return s.getsockname()[1]


def _kept_port(path: Path, host: str, wait: float = 60.0) -> int:
    """The port this replica had before on this machine (a restart keeps its URL, which its
    gateways know), else a free one, kept for next time. The last process on it may still be
    going (a killed actor's server ends with it, not at once): it is waited for."""
    try:
        kept = int(path.read_text())
    except (OSError, ValueError):
        port = _free_port(host)
        path.write_text(str(port))
        return port
    deadline = time.monotonic() + wait
    while True:
        try:
            return _free_port(host, kept)
        except OSError:
            if time.monotonic() > deadline:
                raise SwapError(f"port {kept} of this replica's last start is still taken after {wait:g}s") from None
            time.sleep(0.5)
