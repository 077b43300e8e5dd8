"""A Ray cluster of several nodes on this machine (ray.cluster_utils.Cluster), on loopback,
each node with its own TMPDIR, HOME and polar folder (as machines that share no disk would
have), and the polar_node resource that puts a gateway node on it.

Two pitfalls of Ray here (../shared/reference/vllm-rl-apis.md section 4): Ray rewrites
127.0.0.1 to the VM's address and then hangs unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and
it writes to /tmp/ray unless RAY_TMPDIR says otherwise (a short path: its sockets' names have
a length limit)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from polar_mitm.models import cache_dir

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# read by Ray when it is imported: set before anything imports it (this module first)
os.environ.update(LOOPBACK_ENV)


@dataclass
class NodeDirs:
    name: str
    root: Path

    @property
    def env(self) -> dict[str, str]:
        # Ray's env_vars are the raylet's whole environment change: loopback must be in it too
        # a replica's KV cache of 1 GiB (vLLM-CPU's default here is 2): the suite runs several vLLMs at once.
        # The installed software (the default model's conversion, the harness CLIs) is this
        # machine's, as a shared install would be: made once, not per node on each test run.
        return {**LOOPBACK_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "POLAR_MITM_CACHE": str(cache_dir()),
                # vLLM's compiled kernels: this machine's (a cold compile per node is many minutes on CPU)
                "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
                    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm"),
                "TMPDIR": str(self.root / "tmp"), "HOME": str(self.root / "home"),
                "XDG_CACHE_HOME": str(self.root / "cache"), "POLAR_NODE_DIR": str(self.root / "polar"),
                "POLAR_TEST_NODE": self.name}


class LocalCluster:
    """nodes Ray nodes (the first is the head), each offering polar_node: 1 and `cpus` CPUs;
    resources: more custom resources of node i ({i: {name: amount}}), e.g. to place an actor there."""

    def __init__(self, nodes: int = 3, cpus: int = 2, object_store: int = 80 << 20,
                 resources: dict[int, dict[str, float]] | None = None):
        from ray.cluster_utils import Cluster

        self.base = Path(tempfile.mkdtemp(prefix="pray", dir="/tmp"))
        os.environ.update(LOOPBACK_ENV)
        os.environ["RAY_TMPDIR"] = str(self.base / "r")
        self.dirs = [NodeDirs(f"n{i}", self.base / f"n{i}") for i in range(nodes)]
        for d in self.dirs:
            for sub in ("tmp", "home", "cache", "polar"):
                (d.root / sub).mkdir(parents=True, exist_ok=True)
        self._cpus, self._store, self._extra = cpus, object_store, resources or {}
        common = {"num_cpus": cpus, "object_store_memory": object_store, "node_ip_address": "127.0.0.1"}
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **common, "resources": self._resources(0), "include_dashboard": False, "env_vars": self.dirs[0].env})
        self.nodes = [self.cluster.head_node]
        for i, d in enumerate(self.dirs[1:], start=1):
            self.nodes.append(self.cluster.add_node(**common, resources=self._resources(i), env_vars=d.env))
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def _resources(self, i: int) -> dict[str, float]:
        return {"polar_node": 1, **self._extra.get(i, {})}

    def env(self) -> dict[str, str]:
        """What a driver process needs to join it."""
        return {**os.environ, **LOOPBACK_ENV, "RAY_TMPDIR": str(self.base / "r")}

    def kill_node(self, i: int) -> None:
        """Node i gone at once: its raylet and every process of it (not the head)."""
        self.cluster.remove_node(self.nodes[i], allow_graceful=False)

    def revive(self, i: int) -> None:
        """A new node in node i's place, on the same folders (as a machine that rebooted)."""
        self.nodes[i] = self.cluster.add_node(num_cpus=self._cpus, object_store_memory=self._store,
                                              resources=self._resources(i), node_ip_address="127.0.0.1",
                                              env_vars=self.dirs[i].env)

    def shutdown(self) -> None:
        try:
            for node in reversed(self.nodes[1:]):
                if node in self.cluster.worker_nodes:
                    self.cluster.remove_node(node, allow_graceful=False)
            self.cluster.remove_node(self.cluster.head_node, allow_graceful=False)
        finally:
            shutil.rmtree(self.base, ignore_errors=True)
