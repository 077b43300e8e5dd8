"""The commands users run: `polar-mitm up` with their own backend, `options`, `export`."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import openai

from support.fake_vllm import FakeVLLM
from polar_mitm.stack import launch
from polar_mitm.store import query

CLI = [sys.executable, "-m", "polar_mitm.cli.main"]


def start_up(tmp_path, backend: str, port: int, rport: int, *args: str, **popen) -> tuple[subprocess.Popen, str]:
    """`polar-mitm up` against `backend`; returns it and what it printed until it was ready."""
    p = subprocess.Popen(CLI + ["up", "--db", str(tmp_path / "r.duckdb"), "--backend", backend,
                                "--port", str(port), "--reverse-port", str(rport),
                                "--confdir", str(tmp_path / "conf"), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "POLAR_MITM_CACHE": str(tmp_path / "cache")}, **popen)
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines.append(p.stdout.readline())
        if "base URL" in lines[-1]:
            break
    return p, "".join(lines)


def test_up_serves_records_and_stops_on_ctrl_c(tmp_path):
    db = tmp_path / "r.duckdb"
    port, rport = launch.free_ports(2)
    with FakeVLLM() as fake:
        p, out = start_up(tmp_path, fake.url, port, rport)
        assert f"export HTTPS_PROXY=http://127.0.0.1:{port}" in out
        assert "NODE_EXTRA_CA_CERTS=" in out and "SSL_CERT_FILE=" in out
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{rport}/v1", api_key="polar-up~1", max_retries=0)
        assert oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 130          # the shell's code for Ctrl-C, as node and rollout-server
    assert query(db, "SELECT session_id, status_code FROM calls")[1] == [("up~1", 200)]
    assert (tmp_path / "conf" / "mitmproxy-ca-cert.pem").exists()
    try:  # everything it started is gone
        httpx.get(f"http://127.0.0.1:{rport}/", timeout=2, trust_env=False)
        raise AssertionError("the proxy is still listening")
    except httpx.ConnectError:
        pass


def test_up_with_session_auth_stores_only_calls_with_their_credential(tmp_path):
    """Sessions named by hand work as before unless the check is turned on: then each needs
    the credential that `polar-mitm credential` gives."""
    db = tmp_path / "r.duckdb"
    port, rport = launch.free_ports(2)
    with FakeVLLM() as fake:
        p, out = start_up(tmp_path, fake.url, port, rport, "--session-auth")
        assert "session credentials are checked" in out, out
        given = subprocess.run(CLI + ["credential", "fix@1~0", "--confdir", str(tmp_path / "conf"), "--port",
                                      str(port)], capture_output=True, text=True, timeout=60).stdout
        key = next(line for line in given.splitlines() if line.startswith("API key: ")).removeprefix("API key: ")
        assert "HTTPS_PROXY=http://fix%401~0:" in given and key.startswith("polar-fix@1~0,"), given
        ask = lambda k: openai.OpenAI(base_url=f"http://127.0.0.1:{rport}/v1", api_key=k,  # noqa: E731
                                      max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
        assert ask(key).choices
        try:
            ask("polar-fix@1~0")
            raise AssertionError("a call without the credential was answered")
        except openai.PermissionDeniedError as e:
            assert "credential" in str(e)
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 130
    assert query(db, "SELECT session_id FROM calls")[1] == [("fix@1~0",)]
    assert not [f for f in (tmp_path / "conf").iterdir() if f.name.startswith(".control-")]   # mitmdump's copy went


def children(pid: int, named: str = "") -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and named.encode() in cmdline:
            out.append(int(stat.parent.name))
    return out


def test_up_killed_with_sigkill_leaves_no_mitmdump(tmp_path):
    """SIGKILL (the OOM killer, kill -9): no handler runs, the janitor stops mitmdump, which
    must not stay behind, listening and holding the database. (SIGTERM and Ctrl-C, for every
    long-running command: test_lifecycle.py.)"""
    port, rport = launch.free_ports(2)
    with FakeVLLM() as fake:
        p, _ = start_up(tmp_path, fake.url, port, rport)
        mitmdump = None
        try:
            assert httpx.get(f"http://127.0.0.1:{rport}/v1/models", timeout=5, trust_env=False).status_code == 200
            (mitmdump,) = children(p.pid, "mitmdump")
            p.send_signal(signal.SIGKILL)
            assert p.wait(30) == -signal.SIGKILL
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and Path(f"/proc/{mitmdump}").exists():
                time.sleep(0.1)
            assert not Path(f"/proc/{mitmdump}").exists(), "mitmdump is still running"
            for listener in (port, rport):
                with socket.socket() as s:
                    assert s.connect_ex(("127.0.0.1", listener)) != 0, f"port {listener} still open"
        finally:  # when the test fails, what it started must still go
            p.kill()
            if mitmdump and Path(f"/proc/{mitmdump}").exists():
                os.kill(mitmdump, signal.SIGKILL)


# A real SIGINT to itself while the CLI's modules load (~0.6 s of the command's start):
# deterministic, where a sleep before the signal races the imports.
SIGINT_DURING_IMPORTS = """
import importlib.abc, os, signal, sys
class Interrupter(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "click":
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, Interrupter())
from polar_mitm.cli.entry import {entry}
sys.argv = ["{command}", "{sub}", "tasks.jsonl"]
{entry}()
"""


@pytest.mark.parametrize("command, entry, sub", [("polar-mitm", "polar_mitm", "rollout"),
                                                  ("polar-train", "polar_train", "loop")])
def test_ctrl_c_while_the_command_starts_exits_130(command, entry, sub):
    """The soak's Ctrl-C 2.3 s after start landed in the imports on a loaded CI machine: a
    traceback and death by SIGINT (-2), where every command documents 130."""
    # started as from a terminal: a background job of a script (CI's, say) inherits SIGINT
    # ignored, and Python then never raises KeyboardInterrupt
    code = SIGINT_DURING_IMPORTS.format(entry=entry, command=command, sub=sub)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (p.returncode, p.stderr) == (130, "")
    script = Path(sys.executable).with_name(command).read_text()
    assert f"from polar_mitm.cli.entry import {entry}" in script    # what the installed command runs

def test_up_exits_1_saying_why_when_the_proxy_dies(tmp_path):
    port, rport = launch.free_ports(2)
    with FakeVLLM() as fake:
        p, _ = start_up(tmp_path, fake.url, port, rport)
        try:
            (mitmdump,) = children(p.pid, "mitmdump")
            os.kill(mitmdump, signal.SIGKILL)
            assert p.wait(30) == 1
            assert "stopped: mitmdump" in p.stdout.read()
        finally:
            p.kill()


def test_options_lists_the_addon_options():
    out = subprocess.run(CLI + ["options"], capture_output=True, text=True, check=True).stdout
    for name in ("polar_db", "polar_backend", "polar_served_model", "polar_session_key",
                 "polar_sampling", "polar_model_hosts", "polar_model_paths", "polar_backend_timeout"):
        assert f"\n{name}:" in "\n" + out
    assert "Type str." in out


def test_export_and_json_output(tmp_path):
    from polar_mitm.store import CallRecord, CallWriter, SessionInfo
    db = tmp_path / "r.duckdb"
    w = CallWriter(db).start()
    w.submit(SessionInfo("s"), CallRecord("c", token_ids=[1, 2])).result(10)
    w.close()
    rows = subprocess.run(CLI + ["sql", "--db", str(db), "--format", "json", "SELECT call_id, token_ids FROM calls"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert [json.loads(r) for r in rows] == [{"call_id": "c", "token_ids": [1, 2]}]
    out = subprocess.run(CLI + ["export", "--db", str(db), "--out", str(tmp_path / "pq")],
                         capture_output=True, text=True, check=True).stdout
    assert "calls.parquet" in out and (tmp_path / "pq" / "sessions.parquet").exists()
