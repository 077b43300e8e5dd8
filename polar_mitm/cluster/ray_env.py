"""Joining a Ray cluster, and what each Ray node gives polar-mitm: its address and a folder
of its own.

`--ray auto` joins the cluster this machine belongs to (`ray start` ran here, or inside `ray
job submit`), `--ray ADDRESS` a given one, `--ray local` starts a private one-machine cluster.
A node's folder is $POLAR_NODE_DIR, else the system temp dir of that node's processes (each
Ray node may give its own TMPDIR): nothing one machine writes is read from another's disk."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

NAMESPACE = "polar-mitm"
NODE_RESOURCE = "polar_node"     # a Ray node that offers it runs a gateway node (proxy + sandboxes)


def connect(address: str, namespace: str = NAMESPACE) -> None:
    """ray.init for the driver: auto (this machine's cluster), local (a private one) or an address."""
    if address == "local":   # one machine: on loopback (Ray reads this when it is imported)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return
    # ray.init puts its own SIGTERM handler (C++, it ends the process) over the command's,
    # which stops the stack and exits 143: put the command's back (scancel, ray job stop)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _init(ray, address, namespace)
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def _init(ray, address: str, namespace: str) -> None:
    if address == "local":
        # a private cluster on this machine: every CPU, and this machine as the one gateway node
        ray.init(resources={NODE_RESOURCE: 1}, include_dashboard=False, namespace=namespace, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    else:
        ray.init(address=address, namespace=namespace, log_to_driver=False)


def node_address() -> str:
    """This Ray node's address as the cluster sees it (loopback on a test cluster)."""
    import ray

    return ray.util.get_node_ip_address()


def node_dir(name: str) -> Path:
    """A folder of this node's own for `name` (made 0700)."""
    base = Path(os.environ.get("POLAR_NODE_DIR") or tempfile.gettempdir())
    folder = base / f"polar-{name}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder
