"""`polar-mitm sync`: new weights into a running `polar-mitm up`, from a trainer of the user's
own (TRL, a notebook). It reads the stack's control token from CONFDIR/control-token (which
`up` writes, this user's only), asks the gateway for its policy version (`/_polar/health`)
unless given one, and posts `/_polar/sync` to the proxy's regular listener: the checkpoint
folder to reload (disk), or the trainer's weight server to pull from (`--from URL --sha256
HEX`: grpo/weight_server.py, no disk). It prints the new version and what the sync cost."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click
import httpx

from ..models import model_dir_problem
from .params import PORT

TOKEN_FILE = "control-token"     # in the confdir `up` was given: the gateway's control token
CONTROL_HOST = "http://polar.control"   # any name: the addon answers /_polar/* itself
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


class GatewayError(click.ClickException):
    """The gateway could not be reached, refused, or the sync failed (the old version serves)."""


def read_control_token(confdir: Path) -> str:
    path = confdir / TOKEN_FILE
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise GatewayError(f"no control token at {path} ({e.strerror}): start `polar-mitm up --confdir "
                           f"{confdir}` first, and give sync the same --confdir") from None
    if not token:
        raise GatewayError(f"{path} is empty")
    return token


def control(port: int, token: str, path: str, body: dict | None = None,
            timeout: float = 900.0) -> dict[str, Any]:
    """The gateway's answer on its control path (POST body, or GET), through its regular
    listener; GatewayError unless it is a 200 with a JSON object."""
    try:
        r = httpx.request("GET" if body is None else "POST", CONTROL_HOST + path, json=body,
                          proxy=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {token}"},
                          trust_env=False, timeout=httpx.Timeout(timeout, connect=5.0))
    except httpx.HTTPError as e:
        raise GatewayError(f"no answer from the gateway on 127.0.0.1:{port} ({e!r}): is `polar-mitm up "
                           "--port` this one?") from None
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if r.status_code == 403:
        raise GatewayError(f"the gateway on 127.0.0.1:{port} refused the control token: give sync the "
                           "--confdir that this `polar-mitm up` was given")
    if r.status_code != 200 or not isinstance(answer, dict):
        message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
        raise GatewayError(f"{path}: {r.status_code} {message or r.text[:300]}")
    return answer


def current_version(port: int, token: str) -> int:
    """The policy version the gateway's new calls sample (its health's policy)."""
    version = control(port, token, "/_polar/health", timeout=30.0).get("policy", {}).get("version")
    if not isinstance(version, int):
        raise GatewayError(f"the gateway on 127.0.0.1:{port} reports no policy version; give --version")
    return version


def sync_body(checkpoint: str | None, version: int, pull_url: str | None,
              sha256: str | None) -> dict[str, Any]:
    """The body of POST /_polar/sync: a checkpoint folder to reload, or a pull (and the
    folder the same weights are saved in, if any: the gateway reloads it after a restart)."""
    if pull_url is None:
        return {"checkpoint": checkpoint, "version": version}
    return {"pull": {"url": pull_url, "sha256": sha256}, "version": version, "checkpoint": checkpoint}


def summary(report: dict[str, Any]) -> list[str]:
    """The sync's answer as lines: the version, the stall and total first, then what else
    the gateway said (seconds rounded, steps that did not run left out)."""
    def shown(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        return json.dumps(value) if isinstance(value, dict) else str(value)

    lines = [f"policy version {report.get('version')}"]
    if "stall_s" in report or "total_s" in report:
        lines.append(f"stall {shown(report.get('stall_s'))} s, total {shown(report.get('total_s'))} s")
    rest = {k: v for k, v in report.items() if k not in ("version", "stall_s", "total_s") and v is not None}
    if isinstance(rest.get("steps"), dict):
        rest["steps"] = {k: v for k, v in rest["steps"].items() if v is not None}
    lines += [f"  {k}: {shown(v)}" for k, v in rest.items()]
    return lines


@click.command("sync")
@click.argument("checkpoint", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--confdir", default=str(Path("~/.mitmproxy").expanduser()), show_default=True,
              help="The --confdir `polar-mitm up` was given: its control token is there")
@click.option("--port", default=8080, show_default=True, type=PORT,
              help="The proxy's regular listener (up's --port)")
@click.option("--from", "pull_url", default=None, metavar="URL",
              help="Pull the weights from the trainer's memory instead of reading CHECKPOINT: the URL a "
                   "weight server gave (polar_mitm.grpo.weight_server); needs --sha256")
@click.option("--sha256", default=None, metavar="HEX", help="The SHA-256 of what --from serves (the weight "
              "server gives it): vLLM checks it before loading anything")
@click.option("--version", "version", type=click.IntRange(min=0), default=None,
              help="The policy version the new weights are (default: the gateway's current one + 1)")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds to wait for the sync")
@click.option("--json", "as_json", is_flag=True, help="Print the gateway's answer as JSON")
def sync_command(checkpoint: Path | None, confdir: str, port: int, pull_url: str | None, sha256: str | None,
                 version: int | None, timeout: float, as_json: bool) -> None:
    """Push new weights into a running `polar-mitm up`: CHECKPOINT (a folder save_pretrained
    wrote: vLLM reloads it), or --from URL --sha256 HEX (the trainer's weight server: no
    disk; CHECKPOINT is then where the same weights are saved, if anywhere). Calls from now on
    record the new version. See docs/sync.md."""
    if pull_url is None and sha256 is not None:
        raise click.BadParameter("--sha256 goes with --from", param_hint="'--sha256'")
    if pull_url is not None:
        if not pull_url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{pull_url!r} is not an http(s) URL", param_hint="'--from'")
        if sha256 is None or not SHA256_HEX.fullmatch(sha256):
            raise click.BadParameter("give the 64 hex digits the weight server gave", param_hint="'--sha256'")
    elif checkpoint is None:
        raise click.UsageError("give CHECKPOINT (a folder to reload) or --from URL --sha256 HEX")
    elif problem := model_dir_problem(checkpoint):
        raise click.BadParameter(problem, param_hint="'CHECKPOINT'")
    # the gateway runs elsewhere (its own working directory): an absolute path
    folder = str(checkpoint.resolve()) if checkpoint is not None else None
    token = read_control_token(Path(confdir))
    if version is None:
        version = current_version(port, token) + 1
    report = control(port, token, "/_polar/sync", sync_body(folder, version, pull_url, sha256), timeout)
    if as_json:
        click.echo(json.dumps(report))
        return
    for line in summary(report):
        click.echo(line)


def register(main: click.Group) -> None:
    main.add_command(sync_command)
