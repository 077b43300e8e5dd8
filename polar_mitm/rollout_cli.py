"""polar-mitm rollout | rollout-server | node | harness: the CLI of the rollout half."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from . import launch
from .rollout import RolloutServer
from .rollout import harnesses
from .rollout.rewards import reward_records
from .rollout.server import ORDER
from .stack import (ensure_harnesses, read_tasks, start_node_stack, start_stack, stop_on_sigterm,
                    stop_stack)
from .store.training import set_rewards


def progress_line(status: dict, t0: float) -> str:
    s = status["sessions"]
    parts = " ".join(f"{k} {s[k]}" for k in ORDER if s.get(k))
    r = status["rewards"]
    reward = f"mean reward {r['mean']:.3f} (n={r['n']})" if r["n"] else "no rewards yet"
    return f"[{time.monotonic() - t0:6.0f}s] sessions: {parts or '-'} | {reward}"


def print_summary(server: RolloutServer, task_ids: list[str]) -> None:
    click.echo(f"\n{'task':24} {'state':10} {'done':>5} {'timeout':>7} {'failed':>6} {'other':>5} {'mean reward':>12}")
    for tid in task_ids:
        g = server.group(tid)
        states = [s["state"] for s in g["sessions"]]
        rewards = [s["reward"] for s in g["sessions"] if s["reward"] is not None]
        mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
        other = len(states) - states.count("done") - states.count("timed_out") - states.count("failed")
        click.echo(f"{tid[:24]:24} {g['state']:10} {states.count('done'):>5} {states.count('timed_out'):>7} "
                   f"{states.count('failed'):>6} {other:>5} {mean:>12}")
        for s in g["sessions"]:
            if s["state"] == "failed":
                click.echo(f"  {s['session_id']}: {(s['reason'] or '')[:160]}")


def register(main: click.Group) -> None:
    @main.command()
    @click.argument("tasks_file", type=click.Path(exists=True, dir_okay=False))
    @click.option("--harness", type=click.Choice([*harnesses.PACKAGES, "command"]), default=None,
                  help="For tasks that name none (default pi)")
    @click.option("--samples", type=int, default=None, help="num_samples for tasks that give none")
    @click.option("--db", default="rollouts.duckdb", show_default=True)
    @click.option("--backend", default="", help="A vLLM server; default: start the embedded default model")
    @click.option("--workers", default=4, show_default=True, help="RUN slots (and INIT workers)")
    @click.option("--max-tokens", default=512, show_default=True, help="Cap on each call's output tokens")
    @click.option("--port", default=0, help="Rollout server port (0: any free port)")
    @click.option("--model", default="", help="Serve this model directory (a checkpoint) instead of the default")
    @click.option("--dtype", default="float32", show_default=True, help="vLLM's dtype (the trainer's by default)")
    def rollout(tasks_file, harness, samples, db, backend, workers, max_tokens, port, model, dtype):
        """Run a task file end to end on this machine: model, proxy, rollout server, one node."""
        tasks = read_tasks(tasks_file, harness, samples)
        ensure_harnesses(t.harness for t in tasks)
        stop_on_sigterm()
        work = Path(os.environ.get("POLAR_ROLLOUT_WORK") or
                    Path(db).resolve().parent / f".{Path(db).name}.rollout")
        work.mkdir(mode=0o700, parents=True, exist_ok=True)
        services = []
        server = node = None
        try:
            if not backend:
                services, backend = start_stack(db, "", launch.free_port(), None, work / "mitmproxy",
                                                 work, 8192, proxy=False, model=model, dtype=dtype)
            server = RolloutServer(db, port=port).start()
            proxy, node = start_node_stack(db=db, backend=backend, work=work, proxy_port=launch.free_port(),
                                           workers=workers, max_tokens=max_tokens, server_url=server.url)
            services.append(proxy)
            ids = []
            for t in tasks:
                if t.task_id in server.tasks:
                    click.echo(f"{t.task_id}: already in {db}; resuming it")
                else:
                    server.submit(t)
                ids.append(t.task_id)
            click.echo(f"rollout server {server.url}; {len(ids)} task(s), "
                       f"{sum(t.num_samples for t in tasks)} session(s); database {db}")
            t0, last = time.monotonic(), ""
            while not server.wait(ids, timeout=2.0):
                line = progress_line(server.status(), t0)
                if line.split("] ", 1)[1] != last:
                    click.echo(line)
                    last = line.split("] ", 1)[1]
                if not all(s.alive() for s in services):
                    raise click.ClickException("a service stopped: " + "; ".join(
                        f"{s.name}: {s.tail(5)}" for s in services if not s.alive()))
            click.echo(progress_line(server.status(), t0))
            # the server's record of each group, stored (a node killed before it stored a
            # settled reward left it out)
            records = [r for t in tasks for r in reward_records(server.group(t.task_id), t.on_failure)]
            if records:
                set_rewards(db, records, timeout=120.0)
            print_summary(server, ids)
        except KeyboardInterrupt:
            click.echo("interrupted: sessions in flight were stopped and go back in the queue; "
                       "rerun the same command to resume")
        finally:
            stop_stack(node, server, services)

    @main.command("rollout-server")
    @click.option("--db", default="rollouts.duckdb", show_default=True)
    @click.option("--host", default="127.0.0.1", show_default=True)
    @click.option("--port", default=8090, show_default=True)
    @click.option("--node-timeout", default=10.0, show_default=True, help="Seconds without a heartbeat")
    def rollout_server(db, host, port, node_timeout):
        """Serve the rollout API (POST /tasks, GET /tasks/ID, POST /tasks/ID/cancel, GET /status)."""
        stop_on_sigterm()
        server = RolloutServer(db, host=host, port=port, node_timeout=node_timeout).start()
        click.echo(f"rollout server on {server.url}, state in {db}")
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()

    @main.command()
    @click.option("--server", "server_url", required=True, help="The rollout server's URL")
    @click.option("--backend", required=True, help="The vLLM server")
    @click.option("--db", default="node.duckdb", show_default=True, help="This node's own call database")
    @click.option("--proxy-port", default=0, help="0: any free port")
    @click.option("--workers", default=4, show_default=True)
    @click.option("--max-tokens", default=0, help="Cap on each call's output tokens (0: none)")
    @click.option("--node-id", default=None)
    def node(server_url, backend, db, proxy_port, workers, max_tokens, node_id):
        """Run a gateway node: the proxy plus the INIT, RUN and POST_RUN pools."""
        stop_on_sigterm()
        work = Path(db).resolve().parent / f".{Path(db).name}.node"
        work.mkdir(mode=0o700, parents=True, exist_ok=True)
        proxy, gw = start_node_stack(db=db, backend=backend, work=work,
                                     proxy_port=proxy_port or launch.free_port(), workers=workers,
                                     max_tokens=max_tokens or None, server_url=server_url, node_id=node_id)
        click.echo(f"node {gw.cfg.node_id}: proxy on 127.0.0.1:{gw.cfg.proxy_port}, database {db}")
        try:
            while proxy.alive():
                time.sleep(1)
            click.echo(f"the proxy stopped: {proxy.tail(10)}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            pass
        finally:
            gw.stop()
            proxy.stop()

    @main.group()
    def harness():
        """The harness CLIs, installed from npm at pinned versions."""

    @harness.command("install")
    @click.argument("names", nargs=-1, required=True,
                    type=click.Choice(list(harnesses.PACKAGES) + ["all"]))
    def harness_install(names):
        """Install CLIs into the cache (~/.cache/polar-mitm/harnesses)."""
        for name in (harnesses.PACKAGES if "all" in names else names):
            pkg = harnesses.PACKAGES[name]
            click.echo(f"{name}: {pkg.npm}@{pkg.version} -> {harnesses.install(name)}")

    @harness.command("list")
    def harness_list():
        """Pinned versions and where each CLI is found."""
        for name, pkg in harnesses.PACKAGES.items():
            try:
                where = str(harnesses.executable(name))
            except harnesses.HarnessMissing:
                where = "not installed"
            click.echo(f"{name:7} {pkg.npm}@{pkg.version}  {where}")
