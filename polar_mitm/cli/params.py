"""The commands' options, checked as they are parsed, before anything starts: counts, ports,
server URLs and database paths (a bad value is a one-line usage error, never a traceback
after the stack has started). Only click and the standard library."""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from urllib.parse import urlsplit

import click

from ..models import model_dir_problem

WORKERS = click.IntRange(1)              # 0 would start no RUN slot: nothing would ever run
MAX_TOKENS = click.IntRange(1)           # a cap on each call's output tokens
MAX_TOKENS_OR_NONE = click.IntRange(0)   # 0: the command's default (or none)
PORT = click.IntRange(1, 65535)
PORT_OR_ANY = click.IntRange(0, 65535)   # 0: any free port (or, for a second listener, none)


def server_root(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """A click callback for a server's URL (--backend, --server): "" (none) or its root,
    http(s)://HOST[:PORT], returned without a trailing slash. A path such as /v1 is refused:
    every client adds its own (vLLM's /v1/..., its dev-mode endpoints at the root)."""
    if not value:
        return value
    url = value.strip()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise click.BadParameter(f"{value!r} is not a valid URL ({e}); give the server's root, such as "
                                 "http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise click.BadParameter(f"{value!r} is not an http(s) URL; give the server's root, such as "
                                 "http://127.0.0.1:8000")
    if port == 0:
        raise click.BadParameter(f"{value!r}: port 0 is not a server's port (1 to 65535)")
    if parts.path.strip("/") or parts.query or parts.fragment:
        root = f"{parts.scheme}://{parts.netloc}"
        raise click.BadParameter(f"{value!r} has a path; give the server's root, {root} (each client adds "
                                 "its own path, such as /v1/chat/completions)")
    return f"{parts.scheme}://{parts.netloc}"


def db_file(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """A click callback for --db: a database file (it may not exist yet), never a directory."""
    if value and Path(value).is_dir():
        raise click.BadParameter(f"{value} is a directory; give a database file, such as "
                                 f"{Path(value) / 'rollouts.duckdb'}")
    return value


def check_port_free(port: int, host: str = "127.0.0.1", option: str = "--port") -> None:
    """The port can be listened on now (0: any free port, not checked). Racy, as any check
    before a bind: it turns the common cases (a server already there, a privileged port, an
    address not of this machine) into one clear line before anything starts."""
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise click.BadParameter(f"cannot listen on {host}: {e.strerror}", param_hint=f"'{option}'") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        # as the servers do (asyncio, uvicorn): a port left in TIME_WAIT is not in use
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            why = {errno.EADDRINUSE: "is in use (another server listens there: pick another port)",
                   errno.EACCES: "needs privileges (ports below 1024 are root's)",
                   errno.EADDRNOTAVAIL: f"is not available: {host} is not an address of this machine"}
            reason = why.get(e.errno or 0, f"cannot be used: {e.strerror}")
            raise click.BadParameter(f"port {port} on {host} {reason}", param_hint=f"'{option}'") from None


def check_model_dir(path: str | Path, option: str = "--model") -> None:
    problem = model_dir_problem(path)
    if problem:
        raise click.BadParameter(problem, param_hint=f"'{option}'")


# The options several commands share, each written once.
db_option = click.option("--db", default="rollouts.duckdb", show_default=True, callback=db_file,
                         help="The DuckDB file")


def backend_option(help: str = "A running vLLM server's root URL (http://HOST:PORT); default: start the "
                               "embedded default model", many: bool = False):
    """many: a comma-separated list of roots is taken too (the loop's replicas on Ray)."""
    return click.option("--backend", default="", callback=server_roots if many else server_root, help=help)


def server_roots(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """server_root for each of a comma-separated list; returned joined by commas."""
    if not value:
        return value
    return ",".join(server_root(ctx, param, part) or "" for part in value.split(","))


def _allowed_hosts(ctx: click.Context | None, param: click.Parameter | None, value: tuple[str, ...]) -> list[str]:
    from ..rollout.web_guard import split_host

    for v in value:
        if v != "*":
            try:
                split_host(v)
            except ValueError:
                raise click.BadParameter(f"{v!r} is not a host name or HOST:PORT", param_hint="'--allowed-host'") \
                    from None
    return list(value)


allowed_host_option = click.option(
    "--allowed-host", "allowed_hosts", multiple=True, callback=_allowed_hosts,
    help="A Host name (or HOST:PORT) it answers to besides loopback and the --host address "
         "(repeatable; a guard against DNS rebinding)")


def _session_limits(ctx: click.Context | None, param: click.Parameter | None, value: tuple[str, ...]) -> dict:
    from ..rollout.limits import parse_options

    try:
        return parse_options(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--session-limit'") from None


session_limit_option = click.option(
    "--session-limit", "session_limits", multiple=True, callback=_session_limits, metavar="NAME=VALUE",
    help="What each session may use, for tasks that set none (repeatable): memory=2GiB, pids=512, cpus=1, "
         "nofile=4096, disk=4GiB, log=8MiB (these are the defaults); a task's own `limits` go over them")
