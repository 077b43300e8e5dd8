"""`polar-mitm sync`: the control token from --confdir, the next version from the gateway's
health, the body of /_polar/sync (a checkpoint to reload, or a pull from the trainer's weight
server), and what it prints. Against a stand-in gateway that records what it got, and once
against the real one behind `polar-mitm up` (a vLLM stand-in behind it)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
from click.testing import CliRunner

from polar_mitm.cli.main import main as polar_mitm
from polar_mitm.cli.sync import TOKEN_FILE, control
from polar_mitm.stack import launch
from support.fake_vllm import FakeVLLM
from support.http_stub import Reply, Request, StubServer

TOKEN = "0123456789abcdef0123456789abcdef"
SHA = "ab" * 32


def checkpoint(path: Path) -> Path:
    """A folder as save_pretrained leaves it (what sync checks before asking the gateway)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def confdir_with_token(tmp_path: Path, token: str = TOKEN) -> Path:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / TOKEN_FILE).write_text(token)
    return conf


class StandInGateway(StubServer):
    """Answers /_polar/health with version `current` and /_polar/sync with the lead's report
    shape; keeps every request. A wrong token gets the gateway's 403."""

    def __init__(self, current: int = 4, sync_status: int = 200):
        self.requests: list[Request] = []
        self.current, self.sync_status = current, sync_status
        super().__init__(self.answer)

    def answer(self, request: Request) -> Reply:
        self.requests.append(request)
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return Reply(403, b'{"error": {"message": "this needs the proxy\'s control token"}}')
        if request.path.endswith("/_polar/health"):
            return Reply(200, json.dumps({"polar": "ok", "policy": {"version": self.current}}).encode())
        body = json.loads(request.body)
        if self.sync_status != 200:
            return Reply(self.sync_status,
                         b'{"error": {"message": "the weight sync failed; version 4 still serves"}}')
        report = {"version": body["version"], "checkpoint": body.get("checkpoint"), "held": 0, "drained": 0,
                  "drain_s": 0.0, "swap_s": 0.25, "stall_s": 0.2468, "total_s": 1.5,
                  "steps": {"wake_s": None, "reload_s": 0.2, "reset_s": 0.01}}
        return Reply(200, json.dumps(report).encode())

    def syncs(self) -> list[dict]:
        return [json.loads(r.body) for r in self.requests if r.path.endswith("/_polar/sync")]


def run(*args: str):
    return CliRunner().invoke(polar_mitm, ["sync", *args])


def test_a_checkpoint_is_synced_as_the_next_version(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    with StandInGateway(current=4) as gateway:
        r = run(str(ckpt.relative_to(Path.cwd())) if ckpt.is_relative_to(Path.cwd()) else str(ckpt),
                "--confdir", str(confdir_with_token(tmp_path)), "--port", str(gateway.port))
    assert r.exit_code == 0, r.output
    assert gateway.syncs() == [{"checkpoint": str(ckpt.resolve()), "version": 5}]
    # through the proxy's regular listener, as every control call: absolute-form requests
    assert [q.path for q in gateway.requests] == ["http://polar.control/_polar/health",
                                                  "http://polar.control/_polar/sync"]
    lines = r.output.splitlines()
    assert lines[0] == "policy version 5"
    assert lines[1] == "stall 0.247 s, total 1.500 s"
    assert "  swap_s: 0.250" in lines and '  steps: {"reload_s": 0.2, "reset_s": 0.01}' in lines


def test_a_pull_names_the_weight_server_and_an_explicit_version(tmp_path):
    with StandInGateway() as gateway:
        r = run("--from", "http://127.0.0.1:9/secret", "--sha256", SHA, "--version", "12",
                "--confdir", str(confdir_with_token(tmp_path)), "--port", str(gateway.port), "--json")
    assert r.exit_code == 0, r.output
    assert gateway.syncs() == [{"pull": {"url": "http://127.0.0.1:9/secret", "sha256": SHA}, "version": 12,
                                "checkpoint": None}]
    assert len(gateway.requests) == 1          # a version given: no health asked
    assert json.loads(r.output)["version"] == 12


def test_a_pull_with_its_checkpoint_folder_sends_both(tmp_path):
    later = tmp_path / "v3"                    # written for resume, maybe not yet: not checked
    with StandInGateway(current=2) as gateway:
        r = run(str(later), "--from", "http://127.0.0.1:9/s", "--sha256", SHA,
                "--confdir", str(confdir_with_token(tmp_path)), "--port", str(gateway.port))
    assert r.exit_code == 0, r.output
    assert gateway.syncs() == [{"pull": {"url": "http://127.0.0.1:9/s", "sha256": SHA}, "version": 3,
                                "checkpoint": str(later.resolve())}]


def test_refusals_are_one_line_and_nothing_is_sent(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    conf = confdir_with_token(tmp_path)
    with StandInGateway() as gateway:
        port = str(gateway.port)
        cases = {
            "no checkpoint": (["--confdir", str(conf), "--port", port], "give CHECKPOINT"),
            "not a model": ([str(tmp_path), "--confdir", str(conf), "--port", port], "config.json"),
            "sha without from": ([str(ckpt), "--sha256", SHA, "--confdir", str(conf), "--port", port],
                                 "--sha256 goes with --from"),
            "bad sha": (["--from", "http://h/x", "--sha256", "xyz", "--confdir", str(conf), "--port", port],
                        "64 hex digits"),
            "not http": (["--from", "file:///w", "--sha256", SHA, "--confdir", str(conf), "--port", port],
                         "not an http(s) URL"),
            "no token": ([str(ckpt), "--confdir", str(tmp_path / "elsewhere"), "--port", port],
                         "no control token at"),
        }
        for name, (args, message) in cases.items():
            r = run(*args)
            assert r.exit_code != 0 and message in r.output, (name, r.output)
        assert gateway.requests == []
        (conf / TOKEN_FILE).write_text("another-token")
        r = run(str(ckpt), "--confdir", str(conf), "--port", port)
        assert r.exit_code == 1 and "refused the control token" in r.output, r.output
    assert gateway.syncs() == []


def test_a_failed_sync_says_what_the_gateway_said(tmp_path):
    with StandInGateway(sync_status=502) as gateway:
        r = run(str(checkpoint(tmp_path / "ckpt")), "--confdir", str(confdir_with_token(tmp_path)),
                "--port", str(gateway.port))
    assert r.exit_code == 1 and "502 the weight sync failed; version 4 still serves" in r.output, r.output
    r = run(str(checkpoint(tmp_path / "c2")), "--confdir", str(tmp_path / "conf"),
            "--port", str(launch.free_port()))
    assert r.exit_code == 1 and "no answer from the gateway" in r.output, r.output


def test_up_leaves_a_private_token_that_sync_uses(tmp_path):
    """Without --session-auth too: `up`, then `sync` with its --confdir, through the real gateway."""
    port, rport = launch.free_ports(2)
    conf = tmp_path / "conf"
    cli = [sys.executable, "-m", "polar_mitm.cli.main"]
    with FakeVLLM() as fake:
        up = subprocess.Popen(cli + ["up", "--db", str(tmp_path / "r.duckdb"), "--backend", fake.url,
                                     "--port", str(port), "--reverse-port", str(rport),
                                     "--confdir", str(conf)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "POLAR_MITM_CACHE": str(tmp_path / "cache")})
        try:
            out, deadline = "", time.monotonic() + 60
            while "base URL" not in out and time.monotonic() < deadline:
                out += up.stdout.readline()
            assert f"polar-mitm sync CHECKPOINT --confdir {conf} --port {port}" in out, out
            assert stat.S_IMODE((conf / TOKEN_FILE).stat().st_mode) == 0o600
            ckpt = checkpoint(tmp_path / "ckpt")
            r = subprocess.run(cli + ["sync", str(ckpt), "--confdir", str(conf), "--port", str(port)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and r.stdout.startswith("policy version 1\n"), r.stdout + r.stderr
            assert fake.weights == str(ckpt.resolve()) and fake.weight_version == "polar-v1"
            # the token is the gateway's, yet calls need no session credential without --session-auth
            health = control(port, (conf / TOKEN_FILE).read_text(), "/_polar/health")
            assert health["session_auth"] is False and health["policy"]["version"] == 1
            assert httpx.get(f"http://127.0.0.1:{rport}/_polar/health", trust_env=False).status_code == 403
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(30)
