"""A gateway node on a Ray node (the actor polar-node-K): one proxy and one GatewayNode per
vLLM replica, in a folder of this machine's own, and the door through which the driver takes
their recorded calls.

Every gateway here fronts one replica and records into its own database on this machine
(`<node dir>/r<R>/calls.duckdb`). The driver's collector pulls each database's call log over
Ray (read/ack) into the driver's store, exactly once (store/shipping.py); an outcome is
reported to the rollout server only after the session's calls are shipped, so a node that
dies later loses nothing that was scored. The gateways never touch the replicas' weights
(polar_weights_owner=external): the replicas' owners load them, and every token carries the
version of the replica that sampled it.

The rollout server's address and token, and the proxies' control tokens, reach this process
as constructor arguments through Ray, never on a command line."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..store.calllog import Position

log = logging.getLogger("polar.cluster")


@dataclass(frozen=True)
class NodeSpec:
    """What a node actor is made from (Ray passes it again when it restarts the actor)."""
    index: int
    server_url: str
    server_token: str = field(repr=False)
    backends: tuple[str, ...] = ()       # one gateway per replica URL (and engine rank)
    # vLLM's own data parallelism: the engine rank each backend's gateway pins its calls to
    # (X-data-parallel-rank; -1: none), so a session's calls stay on one engine
    ranks: tuple[int, ...] = ()
    workers: int = 4                     # RUN slots of this Ray node, shared by its gateways
    max_tokens: int | None = None
    temperature: float | None = None
    limits: dict = field(default_factory=dict)
    harnesses: tuple[str, ...] = ()
    version: int = 0
    backend_route: str = "auto"


class GatewayInfo(TypedDict):
    key: str             # r<R>: the replica it fronts
    node_id: str         # as rollout_sessions.node_id has it
    backend: str
    log_id: str          # its call log's identity (the driver's position is kept per log)


class NodeHost:
    def __init__(self, spec: NodeSpec):
        from ..stack.local import Stack, ensure_harnesses
        from .ray_env import node_address, node_dir

        self.spec = spec
        self.dir = node_dir(f"node-{spec.index}")
        self.address = node_address()
        if spec.harnesses:
            ensure_harnesses(spec.harnesses)
        self.stack = Stack()
        self.gateways: dict[str, GatewayInfo] = {}
        self._shippers: dict[str, Any] = {}
        try:
            for r, url in enumerate(spec.backends):
                self._start_gateway(r, url, spec.ranks[r] if spec.ranks else -1)
        except BaseException:
            self.stack.stop()
            raise

    def _start_gateway(self, r: int, url: str, rank: int) -> None:
        from ..stack import launch
        from .shipping import NodeShipper

        key = f"r{r}"
        work = self.dir / key
        work.mkdir(mode=0o700, parents=True, exist_ok=True)
        db = str(work / "calls.duckdb")
        shipper = NodeShipper(db)
        per = max(1, self.spec.workers // max(1, len(self.spec.backends)))
        node_id = f"{_host_label(self.address)}-n{self.spec.index}-{key}"
        self.stack.start_node(
            db=db, backend=url, work=work, proxy_port=launch.free_port(), workers=per,
            max_tokens=self.spec.max_tokens, server_url=self.spec.server_url, node_id=node_id,
            temperature=self.spec.temperature, server_token=self.spec.server_token, limits=self.spec.limits,
            extra_sets=[f"polar_policy_version={self.spec.version}", "polar_weights_owner=external",
                        f"polar_backend_route={self.spec.backend_route}", f"polar_dp_rank={rank}"],
            node_config={"calls_shipped": lambda: shipper.wait_shipped(120.0),
                         "files_cache": str(self.dir / "files")})
        self._shippers[key] = shipper
        self.gateways[key] = GatewayInfo(key=key, node_id=node_id, backend=url, log_id=shipper.log_id())

    # -- what the driver asks ------------------------------------------------------------
    def ready(self) -> dict[str, Any]:
        return {"index": self.spec.index, "address": self.address, "dir": str(self.dir),
                "gateways": list(self.gateways.values())}

    def log_ids(self) -> dict[str, str]:
        return {key: info["log_id"] for key, info in self.gateways.items()}

    def read(self, key: str, start: tuple[int, int], max_bytes: int):
        return self._shippers[key].read(Position(*start), max_bytes)

    def ack(self, key: str, end: tuple[int, int], log_id: str | None = None) -> None:
        self._shippers[key].ack(Position(*end), log_id)

    def dead_services(self) -> str:
        return self.stack.why_dead()

    def stop(self) -> None:
        self.stack.stop()


def _host_label(address: str) -> str:
    """A node id part from an address: its host name where it has one, else the address."""
    if address.startswith("127."):
        return socket.gethostname().split(".")[0] or "local"
    return address.replace(".", "-").replace(":", "-")


def actor_name(index: int) -> str:
    return f"polar-node-{index}"
