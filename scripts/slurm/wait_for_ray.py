"""Wait until the Ray cluster at RAY_ADDRESS has NODES live nodes, then print what it offers.

scripts/slurm/polar_loop.sbatch runs this twice on the head: after the head's `ray start`
(NODES=1: workers may only join a head that is up) and after the workers' (all of them, so the
loop's `--nodes` sees every node that offers `polar_node`). Ray gives no "node joined" event a
shell can wait on, so this connects once and asks the GCS until the count is reached.

    python wait_for_ray.py --nodes N [--timeout SECONDS] [--watch-pid PID]

Exit status 0 once N nodes are alive, 1 at the timeout or once PID (the srun that starts
those nodes) has exited, with what did join; 2 if the head never answered."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def _running(pid: int | None) -> bool:
    """The srun is still there (its `ray start`s may join yet); True when none is watched."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"    # exited, not yet reaped
    except OSError:
        return False


def _listening(address: str) -> bool:
    """The GCS port takes a TCP connection (host:port, or [v6]:port)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
            return True
    except (OSError, ValueError):
        return False


def _connect(address: str, deadline: float, pid: int | None) -> bool:
    # First the port: ray.init against a head that is not up retries inside Ray, past any
    # deadline of ours, and even after the head's `ray start` has failed.
    if address != "auto":
        while not _listening(address):
            if time.monotonic() >= deadline or not _running(pid):
                why = "its `ray start` exited" if not _running(pid) else "timed out"
                print(f"wait_for_ray: no Ray head at {address} ({why})", file=sys.stderr)
                return False
            time.sleep(0.5)
    import ray

    # log_to_driver off: this helper's stdout is the job log, not the workers' prints.
    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    return True


def _alive(nodes: list[dict]) -> list[dict]:
    return [n for n in nodes if n.get("Alive")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, required=True, help="live nodes to wait for")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds, from now")
    parser.add_argument("--watch-pid", type=int, default=None,
                        help="stop waiting once this process (the srun starting the nodes) has exited")
    args = parser.parse_args()
    address = os.environ.get("RAY_ADDRESS") or "auto"
    deadline = time.monotonic() + args.timeout

    if not _connect(address, deadline, args.watch_pid):
        return 2
    import ray

    try:
        while len(alive := _alive(ray.nodes())) < args.nodes and time.monotonic() < deadline:
            if not _running(args.watch_pid):       # every `ray start` of that step has exited
                break
            time.sleep(1.0)
        resources = ray.cluster_resources()
        hosts = sorted(n.get("NodeManagerHostname", "?") for n in alive)
        print(f"wait_for_ray: {len(alive)}/{args.nodes} nodes alive ({', '.join(hosts)}); "
              f"CPU {resources.get('CPU', 0):g}, GPU {resources.get('GPU', 0):g}, "
              f"polar_node {resources.get('polar_node', 0):g}", flush=True)
        return 0 if len(alive) >= args.nodes else 1
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
