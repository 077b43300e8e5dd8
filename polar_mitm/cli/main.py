"""polar-mitm: run the gateway, inspect what it recorded."""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from ..stack import launch
from ..models import cache_dir
from .params import (MAX_TOKENS_OR_NONE, PORT, PORT_OR_ANY, allowed_host_option, backend_option, check_model_dir,
                     check_port_free, db_file, db_option)
from .rollout import register as register_rollout
from .sync import TOKEN_FILE, register as register_sync
from .lifecycle import LongRunning
from ..stack.local import Stack
from ..stack.vllm import VLLMSettings, vllm_options
from ..store import export_parquet, query
from ..loop.trackers import report_to_option


@click.group()
def main():
    """Record token-faithful harness traffic from vLLM into DuckDB."""


def _print_table(columns: list[str], rows: list[tuple], fmt: str) -> None:
    if fmt == "json":
        for row in rows:
            click.echo(json.dumps(dict(zip(columns, row)), default=str))
        return
    if fmt == "csv":
        import csv
        w = csv.writer(sys.stdout)
        w.writerow(columns)
        w.writerows(rows)
        return
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    click.echo("  ".join("-" * w for w in widths))
    for r in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    click.echo(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")


def _cell(v) -> str:
    s = "NULL" if v is None else str(v)
    return s if len(s) <= 60 else s[:57] + "..."


@main.command()
@click.argument("statement")
@click.option("--db", default="rollouts.duckdb", show_default=True, help="DuckDB file")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table")
@click.option("--timeout", default=30.0, show_default=True,
              help="Seconds to wait while the proxy holds the write lock")
def sql(statement, db, fmt, timeout):
    """Run one read-only SQL statement on the database (safe while the proxy runs)."""
    import duckdb

    from ..store.rollout_journal import fold_orphaned
    try:
        if Path(db).exists():
            fold_orphaned(db, timeout)   # what a rollout server killed -9 saved, in its tables first
        columns, rows = query(db, statement, timeout=timeout)
    except (FileNotFoundError, duckdb.Error) as e:  # e.g. a write on the read-only connection
        raise click.ClickException(str(e)) from None
    _print_table(columns, rows, fmt)


@main.group(invoke_without_command=True)
@click.option("--db", default="rollouts.duckdb", show_default=True)
@click.option("--out", default="export", show_default=True, help="Folder for the Parquet files")
@click.pass_context
def export(ctx, db, out):
    """Export sessions and calls to Parquet (`export --db FILE --out DIR`), or rollouts as
    SFT data (`export sft ...`)."""
    if ctx.invoked_subcommand is None:
        for path in export_parquet(db, out):
            click.echo(path)


@export.command("sft")
@click.option("--db", "dbs", multiple=True, required=True,
              help="DuckDB file (repeat for one per gateway machine); each row names its file")
@click.option("--min-reward", type=float, required=True,
              help="Only sessions whose reward is at least this (rejection sampling: 1)")
@click.option("--task", "task", default=None, metavar="GLOB",
              help="Only tasks whose id matches this shell glob, whole (TASK@RUN.I) or without the "
                   "loop's run suffix (TASK)")
@click.option("--iteration", type=click.IntRange(min=0), default=None, metavar="N",
              help="Only the sessions of the loop's iteration N: its tasks are TASK@RUN.N (the id the "
                   "loop submitted them with, in every file, so node databases without the loop's tables "
                   "select the same; a policy version is not an iteration once a sync failed or "
                   "--max-staleness lets an older one sample)")
@click.option("--main-chain", is_flag=True,
              help="Only each session's main chain (its main loop: the chain with the most calls to its "
                   "most used model), no sub-agents or side calls")
@click.option("--held-out", "include_held_out", is_flag=True,
              help="Also the loop's held-out copies (TASK@RUN.I.eval), left out by default")
@click.option("--format", "fmt", type=click.Choice(["messages", "tokens"]), default="messages", show_default=True,
              help="messages: OpenAI chat messages with tool calls and results, plus tools (TRL's "
                   "conversational format); tokens: the exact prompt + sampled token ids with a "
                   "completion mask")
@click.option("--out", required=True, metavar="FILE.jsonl|FILE.parquet", help="Where to write (by its suffix)")
@click.option("--timeout", default=30.0, show_default=True,
              help="Seconds to wait while a proxy holds a database's write lock")
def export_sft(dbs, min_reward, task, iteration, main_chain, include_held_out, fmt, out, timeout):
    """Export rollouts as SFT data: one row per chain (a session's main conversation, or
    each sub-agent's) of every rewarded session (its latest attempt) with reward >=
    --min-reward. Rejection sampling: `rollout` the tasks with a strong model, then
    `export sft --min-reward 1`. See docs/sft.md."""
    import duckdb

    from ..store.sft import SUFFIXES, export_sft as run_export

    if Path(out).suffix not in SUFFIXES:
        raise click.BadParameter(f"{out}: give a file ending in .jsonl or .parquet", param_hint="--out")
    for db in dbs:
        if not Path(db).is_file():
            raise click.BadParameter(f"no database at {db}", param_hint="--db")
    try:
        stats = run_export(dbs, out, min_reward=min_reward, fmt=fmt, task=task, iteration=iteration,
                           main_chain=main_chain, include_held_out=include_held_out, timeout=timeout)
    except (FileNotFoundError, ValueError, duckdb.Error) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {stats.rows} row{'s' if stats.rows != 1 else ''} ({fmt}) from {stats.sessions} "
               f"session{'s' if stats.sessions != 1 else ''} to {out}")
    skipped = sum(stats.skipped_sessions.values())
    click.echo(f"skipped {skipped} session{'s' if skipped != 1 else ''}"
               + (": " + ", ".join(f"{why} {n}" for why, n in sorted(stats.skipped_sessions.items()))
                  if skipped else ""))
    if stats.skipped_calls:
        click.echo("calls in no row: " + ", ".join(f"{why} {n}" for why, n in sorted(stats.skipped_calls.items())))


@main.command("options")
def show_options():
    """The addon's --set options with types and defaults. (`mitmdump --options` lists only
    built-in options: mitmdump loads -s scripts after printing.)"""
    import asyncio

    from mitmproxy import optmanager
    from mitmproxy.test import taddons

    from ..addons.gateway import PolarGateway

    async def dump() -> str:
        with taddons.context(PolarGateway()) as tctx:
            out = io.StringIO()
            optmanager.dump_defaults(tctx.options, out)
            return out.getvalue()

    blocks = [b for b in asyncio.run(dump()).split("\n\n") if "\npolar_" in "\n" + b]
    click.echo("\n\n".join(b.strip("\n") for b in blocks))


@main.command("addon-path")
def addon_path():
    """Print the addon file for `mitmdump -s`."""
    click.echo(launch.ADDON_FILE)


@main.command()
@db_option
@backend_option()
@click.option("--port", default=8080, show_default=True, type=PORT, help="Regular (HTTPS_PROXY) listener")
@click.option("--reverse-port", default=8081, show_default=True, type=PORT_OR_ANY,
              help="Base-URL (reverse) listener (0: none)")
@click.option("--confdir", default=os.path.expanduser("~/.mitmproxy"), show_default=True)
@click.option("--model", default="", help="Serve this model directory (a polar-train checkpoint) instead of the default")
@vllm_options
@click.option("--session-auth", is_flag=True,
              help="Store a call only with its session's credential (`polar-mitm credential NAME`, "
                   "made under the control token that `up` always keeps in CONFDIR/control-token)")
def up(db, backend, port, reverse_port, confdir, model, vllm, session_auth):
    """Start vLLM (unless --backend) and the proxy; stop with Ctrl-C or SIGTERM.

    Exit status: 130 after Ctrl-C, 143 after SIGTERM (as `node` and `rollout-server`); 1 when
    a service it started stopped by itself."""
    with LongRunning() as life:
        if reverse_port == port:
            raise click.BadParameter(f"{port} is --port already", param_hint="'--reverse-port'")
        check_port_free(port)
        check_port_free(reverse_port, option="--reverse-port")
        if model and not backend:
            check_model_dir(model)
        logs = cache_dir() / "logs"
        logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        # always: `polar-mitm sync` (and `credential`) read it from the same --confdir
        token = new_control_token(Path(confdir))
        stack = life.stops(Stack())
        backend = stack.start_gateway(db, backend, port, reverse_port, confdir, logs, vllm,
                                      model=model, control_token=token, session_auth=session_auth)
        click.echo(f"proxy ready: backend {backend}, database {db}\nharness environment:")
        for k, v in launch.proxy_env(port, confdir).items():
            click.echo(f"  export {k}={v}")
        if session_auth:
            click.echo(f"session credentials are checked: `polar-mitm credential NAME --confdir {confdir}` "
                       "gives a session's proxy URL and API key")
        click.echo(f"new weights: `polar-mitm sync CHECKPOINT --confdir {confdir} --port {port}`")
        click.echo(f"or point a base URL at http://127.0.0.1:{reverse_port}")
        life.wait(stack)


def new_control_token(confdir: Path) -> str:
    """A new control token, kept in CONFDIR/control-token (0600, this user's only) for
    `credential` and `sync`; mitmdump gets it in a file of its own that it removes."""
    import secrets
    confdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    path = confdir / TOKEN_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


@main.command()
@click.argument("session")
@click.option("--confdir", default=os.path.expanduser("~/.mitmproxy"), show_default=True,
              help="Where `polar-mitm up --session-auth` keeps its control token")
@click.option("--port", default=8080, show_default=True, type=PORT, help="The proxy's regular listener")
def credential(session, confdir, port):
    """A session's credential under `up --session-auth`: its HTTPS_PROXY and its API key."""
    from .. import session_auth
    path = Path(confdir) / TOKEN_FILE
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise click.ClickException(f"no control token at {path} ({e.strerror}): start `polar-mitm up "
                                   "--session-auth` first") from None
    cred = session_auth.credential(token, session)
    click.echo(f"HTTPS_PROXY={session_auth.proxy_url(session, port, cred)}")
    click.echo(f"API key: {session_auth.api_key(session, cred)}")


DEMO_TASKS = Path(__file__).resolve().parents[1] / "demo_tasks"


@dataclass(frozen=True)
class DemoSettings:
    """The demo's loop, chosen by measurement on a 2-core machine (docs/performance.md, "The
    demo and the closed loop"): the held-out reward must rise by 2 standard errors within 15
    minutes. A Pi session costs ~1.6 s of the machine (its Node.js start most of it), so the
    held-out tasks run at the first and the last iteration only, 64 sessions each, and each
    iteration trains on 32."""
    iterations: int = 5
    samples: int = 8            # per task: 4 training tasks (32 sessions), 8 held-out ones (64)
    eval_every: int = 4         # held-out at iterations 1 and 5 (the first and the last)
    workers: int = 8
    max_tokens: int = 32
    lr: float = 3e-5
    groups_per_step: int = 1    # 4 optimizer steps an iteration (training costs the same)


DEMO = DemoSettings()


@main.command()
@click.option("--sdk", is_flag=True, help="Instead: the SDK tour (every API style through the proxy)")
@click.option("--out", default="polar-demo", show_default=True, help="The loop's run directory")
@click.option("--iterations", default=DEMO.iterations, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, help="The trainer's seed (vLLM's sampling is not seeded: "
              "runs differ anyway)")
@click.option("--db", default="polar-demo.duckdb", show_default=True, callback=db_file, help="--sdk: the database")
@backend_option("A running vLLM server (dev mode; its root URL) instead of starting the default model")
@click.option("--max-tokens", default=0, type=MAX_TOKENS_OR_NONE,
              help=f"Cap on each call's output tokens (0: {DEMO.max_tokens} for the loop, 24 --sdk)")
@report_to_option
def demo(sdk, out, iterations, seed, db, backend, max_tokens, report_to):
    """The main job on the embedded default model: the closed loop (Pi on small arithmetic
    tasks, GRPO, the new weights synced into the running vLLM, held-out tasks each
    iteration), ending with the held-out reward's rise and its standard error. --sdk: every
    API style through the proxy instead."""
    if sdk:
        _sdk_tour(db, backend, max_tokens or 24)
        return
    from ..grpo.config import TrainConfig
    from ..loop.run import LoopOptions
    from .train import interruptible_loop
    opts = LoopOptions(tasks_file=str(DEMO_TASKS / "arithmetic.jsonl"), iterations=iterations,
                       out=Path(out), harness="pi", samples=DEMO.samples, backend=backend or None,
                       eval_tasks_file=str(DEMO_TASKS / "arithmetic_heldout.jsonl"), workers=DEMO.workers,
                       eval_every=DEMO.eval_every, max_tokens=max_tokens or DEMO.max_tokens, report_to=report_to)
    interruptible_loop(opts, TrainConfig(lr=DEMO.lr, groups_per_step=DEMO.groups_per_step, seed=seed))


def _sdk_tour(db: str, backend: str, max_tokens: int) -> None:
    """`demo --sdk`: the proxy on `backend` (or the default model), and one call of each API
    style and mode through it with the official SDKs; then what it recorded."""
    from .demo import SUMMARY_SQL, drive

    with LongRunning() as life:
        work = Path(tempfile.mkdtemp(prefix="polar-demo-"))
        port, reverse_port = launch.free_ports(2)
        stack = life.stops(Stack())
        stack.start_gateway(db, backend, port, reverse_port, work / "mitmproxy", work, VLLMSettings())
        click.echo("driving the official SDKs through the proxy (HTTPS_PROXY and base URL)")
        for r in drive(port, reverse_port, work / "mitmproxy", max_tokens):
            click.echo(f"  {r['style']:17} {r['mode']:8} stream={str(r['stream']):5} -> {r['text']!r}")
    click.echo(f"\nrecorded in {db}:")
    _print_table(*query(db, SUMMARY_SQL), "table")
    _print_table(*query(db, "SELECT * FROM session_summary"), "table")


# -- dashboard ---------------------------------------------------------------------------------------
@main.command()
@click.option("--db", "dbs", multiple=True, callback=lambda c, p, v: [db_file(c, p, x) for x in v],
              help="A database file (repeat for several: a node's each); default: the run directory's")
@click.option("--run", "run_dir", default=None, type=click.Path(file_okay=False),
              help="A polar-train loop's run directory (--out): loop.json, checkpoints, its database")
@click.option("--port", default=8765, show_default=True, type=PORT)
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on")
@allowed_host_option
@click.option("--tokenizer", default=None, type=click.Path(exists=True),
              help="A directory with tokenizer.json (or the file), for the sampled tokens' text; "
                   "default: the run's latest checkpoint's, else token ids")
def dashboard(dbs, run_dir, port, host, allowed_hosts, tokenizer):
    """A local web app over the databases and a loop's run directory: runs, groups, sessions
    (the conversation as the model saw it, its tokens by logprob), compare. Read-only: it reads
    only when files change, as any reader does (docs/dashboard.md)."""
    from ..dashboard.app import close_streams, make_app
    from ..rollout.http_api import ThreadedUvicorn
    from ..rollout.web_guard import guarded

    with LongRunning() as life:
        dbs = _dashboard_dbs(list(dbs), run_dir)
        app = make_app(dbs, run_dir, tokenizer)
        try:   # its own Host names only (DNS rebinding), no token: it is read-only and meant for loopback
            server = life.stops(ThreadedUvicorn(guarded(app, host, allowed_hosts, token_beyond_loopback=False),
                                                host, port, name="dashboard"))
        except OSError as e:
            raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        life.on_stop(lambda: close_streams(app))    # first: the server's stop need not wait for them
        server.start()
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"dashboard of {', '.join(dbs)}" + (f" and run {run_dir}" if run_dir else "")
                   + f" at http://{shown}:{server.port}/  (Ctrl-C stops it)")
        life.wait()


def _dashboard_dbs(dbs: list[str], run_dir: str | None) -> list[str]:
    """The databases given, else the run directory's; each must exist."""
    if run_dir is not None and not Path(run_dir).is_dir():
        raise click.BadParameter(f"{run_dir} is not a directory", param_hint="--run")
    if not dbs and run_dir is not None:
        dbs = [str(p) for p in (Path(run_dir) / "rollouts.duckdb", Path(run_dir) / "loop.duckdb") if p.is_file()]
        if not dbs:
            raise click.UsageError(f"no rollouts.duckdb or loop.duckdb in {run_dir}: name the database with --db")
    if not dbs:
        raise click.UsageError("give a database (--db FILE, repeatable) or a loop's run directory (--run DIR)")
    missing = [db for db in dbs if not Path(db).is_file()]
    if missing:
        raise click.BadParameter(f"no database at {', '.join(missing)}", param_hint="--db")
    return dbs


register_rollout(main)
register_sync(main)

if __name__ == "__main__":
    main()
