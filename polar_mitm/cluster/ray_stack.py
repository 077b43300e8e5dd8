"""The loop's stack on a Ray cluster (`polar-train loop --ray`): what runs where, started and
stopped as one, like stack/local.py's Stack on one machine.

- The driver (this process): the loop, the trainer, the rollout server (on this node's
  address, with the cluster's secret as its bearer token), the weight server the replicas
  pull from, and the collector that ships every node's recorded calls into the driver's
  `rollouts.duckdb`.
- `polar-vllm-I` (--replicas M): vLLM replicas as actors, GPUs through Ray's resources
  (replica.py). Or --backend URL[,URL...]: servers that run already, swapped by the driver.
- `polar-node-K`: one gateway node on every Ray node that offers the `polar_node` resource
  (--nodes N to cap), with one proxy per replica (node_host.py).

Ray restarts a dead actor (max_restarts=-1): a replica loads the current version before it
answers, a node comes back on its own folder (its call log continues where the driver's
position says). A session on a node that died is released by the rollout server when the
node's heartbeats stop, and runs again elsewhere.

The secret travels to the actors as a constructor argument (through Ray), never on argv."""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import click

from ..addons.backend_client import weight_tag
from ..rollout.protocol import WeightPull
from ..rollout.server import RolloutServer
from ..stack.vllm import VLLMSettings
from .node_host import NodeHost, NodeSpec, actor_name
from .ray_env import NODE_RESOURCE, connect, node_address
from .replica import Replica, ReplicaSpec, SwapFigures, swap
from .shipping import Collector


@dataclass(frozen=True)
class ClusterOptions:
    address: str = "auto"                 # --ray
    nodes: int | None = None              # --nodes: at most this many gateway nodes
    replicas: int = 1                     # --replicas (unless backends)
    backends: tuple[str, ...] = ()        # --backend URL[,URL...]: running servers, not actors
    replica_gpus: float = 0.0             # per replica (0: CPU; 1 where the cluster has GPUs)
    replica_argv: tuple[str, ...] = ()    # a stand-in server instead of vLLM (tests)
    # vLLM's own data parallelism: engines per replica (--data-parallel-size), each session
    # pinned to one (a gateway per engine rank)
    replica_dp: int = 1
    model: str = ""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)


@dataclass(frozen=True)
class RolloutSetup:
    """What the loop's rollouts need from the stack, as on one machine."""
    workers: int
    max_tokens: int | None
    temperature: float | None
    limits: dict
    harnesses: tuple[str, ...]
    version: int
    fold_s: float | None = None


class RayStack:
    """What the driver started on the cluster; stop() ends it all (actors, server, collector)."""

    def __init__(self, options: ClusterOptions, echo: Callable[[str], None] = click.echo):
        self.options, self.echo = options, echo
        self.server: RolloutServer | None = None
        self.replicas: list[Any] = []        # Ray actor handles (none with --backend)
        self.hosts: list[Any] = []
        self.backends: list[str] = list(options.backends)
        self.collector: Collector | None = None
        self.token = secrets.token_urlsafe(32)
        self.address = ""
        self._shipped: dict[str, tuple[int, int, float]] = {}   # per source: lines, bytes, seconds so far

    def __enter__(self) -> "RayStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start ---------------------------------------------------------------------------
    def start(self, db: str, setup: RolloutSetup, target: tuple[int, str, WeightPull | None]) -> str:
        """The rollout server (target: the version every replica loads first), the replicas,
        the gateway nodes and the collector; returns the server's URL."""
        import ray

        connect(self.options.address)
        self.address = node_address()
        self.server = RolloutServer(db, host=self.address, token=self.token, ship_files=True,
                                    fold_s=30.0 if setup.fold_s is None else setup.fold_s).start()
        version, checkpoint, pull = target
        self.server.set_policy(version, checkpoint, pull=pull)
        self.collector = Collector(db)
        self.collector.start()
        if self.backends:   # running servers: the driver tags (or loads) them as the run's version
            self.swap_replicas(version, pull)
        else:
            self._start_replicas(ray)
        self._start_hosts(ray, setup)
        return self.server.url

    def _start_replicas(self, ray) -> None:
        o = self.options
        assert self.server is not None
        t0 = time.monotonic()
        self.echo(f"starting {o.replicas} vLLM replica(s) on the cluster (first start takes minutes on CPU)")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(Replica)
        homes = _replica_homes(ray, o.replicas, o.replica_gpus)
        for i in range(o.replicas):
            spec = ReplicaSpec(index=i, server_url=self.server.url, server_token=self.token, model=o.model,
                               settings=o.vllm, argv=o.replica_argv, dp=o.replica_dp)
            # a restart goes back to its node (soft: elsewhere only if that node is gone), where
            # it finds its port again, so its gateways reach it at the same address
            place = NodeAffinitySchedulingStrategy(homes[i], soft=True) if homes else None
            self.replicas.append(actor.options(name=f"polar-vllm-{i}", num_cpus=0 if o.replica_gpus else 1,
                                               num_gpus=o.replica_gpus, max_restarts=-1, max_concurrency=4,
                                               scheduling_strategy=place)
                                 .remote(spec))
        ready = ray.get([r.ready.remote() for r in self.replicas])
        self.backends = [r["url"] for r in ready]
        self.echo(f"{len(ready)} replica(s) ready after {time.monotonic() - t0:.0f}s: {', '.join(self.backends)}")

    def _start_hosts(self, ray, setup: RolloutSetup) -> None:
        assert self.server is not None
        offered = int(ray.cluster_resources().get(NODE_RESOURCE, 0))
        n = min(offered, self.options.nodes) if self.options.nodes else offered
        if n < 1:
            raise click.ClickException(f"no Ray node offers the {NODE_RESOURCE!r} resource: start the nodes that "
                                       f"run sessions with `ray start ... --resources '{{\"{NODE_RESOURCE}\": 1}}'`")
        actor = ray.remote(NodeHost)
        dp = max(1, self.options.replica_dp)
        backends = tuple(url for url in self.backends for _ in range(dp))
        ranks = tuple(rank for _ in self.backends for rank in range(dp)) if dp > 1 else ()
        for k in range(n):
            spec = NodeSpec(index=k, server_url=self.server.url, server_token=self.token,
                            backends=backends, ranks=ranks, workers=setup.workers, max_tokens=setup.max_tokens,
                            temperature=setup.temperature, limits=dict(setup.limits),
                            harnesses=setup.harnesses, version=setup.version)
            self.hosts.append(actor.options(name=actor_name(k), resources={NODE_RESOURCE: 1}, num_cpus=0,
                                            max_restarts=-1, max_concurrency=16).remote(spec))
        infos = ray.get([h.ready.remote() for h in self.hosts])
        for host, info in zip(self.hosts, infos):
            self._add_sources(host, info)
        self.echo(f"{n} gateway node(s): " + "; ".join(
            f"{i['address']} ({len(i['gateways'])} gateway(s))" for i in infos))

    def _add_sources(self, host: Any, info: dict) -> None:
        assert self.collector is not None
        for g in info["gateways"]:
            self.collector.add(f"{info['index']}/{g['key']}", RemoteLog(host, g["key"]))

    # -- the loop's needs ------------------------------------------------------------------
    def swap_replicas(self, version: int, pull: WeightPull | None, timeout: float = 900.0) -> list[SwapFigures]:
        """Every replica to version (its weights pulled from the trainer's memory), at once.
        A replica that dies meanwhile is restarted by Ray and loads the rollout server's
        target itself (set before this): it is waited for, and its tag checked."""
        import ray

        if not self.replicas:
            with ThreadPoolExecutor(max(1, len(self.backends))) as pool:
                figures = list(pool.map(lambda url: swap(url, version, pull), self.backends))
        else:
            figures = []
            pending = [(i, r.swap.remote(version, pull)) for i, r in enumerate(self.replicas)]
            for i, ref in pending:
                try:
                    figures.append(ray.get(ref, timeout=timeout))
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    self.echo(f"replica {i} died during the sync ({type(e).__name__}): waiting for Ray to restart it")
                    figures.append(self._restarted(i, version, timeout))
        if pull is not None:
            self.echo(f"weights v{version} to {len(figures)} replica(s): " + "; ".join(
                f"{f['url']} fetched in {f['prefetch_s']:.2f}s, stalled {f['stall_s']:.2f}s" for f in figures))
        return figures

    def _restarted(self, i: int, version: int, timeout: float) -> SwapFigures:
        """Replica i, restarted by Ray, serving version (its constructor loaded the target)."""
        import ray

        t0 = time.monotonic()
        while True:
            try:
                info = ray.get(self.replicas[i].ready.remote(), timeout=max(1.0, timeout - (time.monotonic() - t0)))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                if time.monotonic() - t0 > timeout:
                    raise
                time.sleep(0.5)
                continue
            if info["tag"] != weight_tag(version):
                raise RuntimeError(f"replica {i} came back tagged {info['tag']!r}, not {weight_tag(version)!r}")
            if info["url"] != self.backends[i]:
                raise RuntimeError(f"replica {i} came back at {info['url']}, not {self.backends[i]}: its gateways "
                                   "would not reach it")
            loaded = info["loaded"]
            return SwapFigures(url=info["url"], version=version, prefetch_s=loaded["prefetch_s"],
                               stall_s=loaded["stall_s"], total_s=round(time.monotonic() - t0, 4))

    def calls_in(self, timeout: float = 120.0) -> bool:
        """Every node's recorded calls, as far as they go now, in the driver's store; what was
        shipped since the last time, said in one line."""
        if self.collector is None:
            return True
        t0 = time.monotonic()
        ok = self.collector.catch_up(timeout)
        now = {name: (st.lines, st.bytes, st.seconds) for name, st in self.collector.stats().items()}
        moved = [tuple(a - b for a, b in zip(v, self._shipped.get(name, (0, 0, 0.0)))) for name, v in now.items()]
        self._shipped = now
        lines, size, seconds = (sum(m[i] for m in moved) for i in range(3))
        self.echo(f"calls shipped to the driver: {lines} lines, {size / 1e3:.1f} kB from {len(now)} gateway(s), "
                  f"{seconds:.2f}s of transfers; caught up in {time.monotonic() - t0:.2f}s")
        return ok

    def dead(self) -> list[str]:
        """Nothing the loop must stop for: Ray restarts a dead actor, and the rollout server
        releases the sessions of a node whose heartbeats stop."""
        return []

    def why_dead(self) -> str:
        return ""

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> None:
        import ray

        errors: list[BaseException] = []
        for step in (self._stop_hosts, self._stop_collector, self._stop_server, self._stop_replicas):
            try:
                step(ray)
            except BaseException as e:   # noqa: BLE001 (each part stops whatever failed)
                errors.append(e)
        if errors:
            raise errors[0]

    def _stop_hosts(self, ray) -> None:
        hosts, self.hosts = self.hosts, []
        if hosts:
            # the nodes hand their sessions back and stop their proxies; then the actors go
            ray.wait([h.stop.remote() for h in hosts], num_returns=len(hosts), timeout=60)
        if self.collector is not None:
            self.collector.catch_up(30.0)
        for h in hosts:
            ray.kill(h, no_restart=True)

    def _stop_collector(self, ray) -> None:
        collector, self.collector = self.collector, None
        if collector is not None:
            collector.close()

    def _stop_server(self, ray) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    def _stop_replicas(self, ray) -> None:
        replicas, self.replicas = self.replicas, []
        if replicas:
            ray.wait([r.stop.remote() for r in replicas], num_returns=len(replicas), timeout=60)
        for r in replicas:
            ray.kill(r, no_restart=True)


def _replica_homes(ray, replicas: int, gpus: float) -> list[str]:
    """A node for each replica, spread over the live nodes that have its resources (round
    robin, the GPU nodes when it takes GPUs); [] where none qualifies (Ray places them)."""
    want = "GPU" if gpus else "CPU"
    need = gpus or 1.0
    nodes = sorted((n["NodeID"] for n in ray.nodes()
                    if n.get("Alive") and n.get("Resources", {}).get(want, 0) >= need))
    return [nodes[i % len(nodes)] for i in range(replicas)] if nodes else []


class RemoteLog:
    """A node's call log as the collector reads it: over Ray, from the node actor."""

    def __init__(self, host: Any, key: str, timeout: float = 60.0):
        self.host, self.key, self.timeout = host, key, timeout

    def log_id(self) -> str:
        import ray

        return ray.get(self.host.log_ids.remote(), timeout=self.timeout)[self.key]

    def read(self, start, max_bytes: int):
        import ray

        return ray.get(self.host.read.remote(self.key, tuple(start), max_bytes), timeout=self.timeout)

    def ack(self, end, log_id: str | None = None) -> None:
        import ray

        ray.get(self.host.ack.remote(self.key, tuple(end), log_id), timeout=self.timeout)
