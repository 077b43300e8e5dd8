"""A hostile session against the gateway that stores its calls (issue 31, section 1). From
inside a sandboxed session, calls that name a sibling session (by proxy user, by API key,
with or without the session's own credential) or no session are refused in the provider's
shape, counted and stored nowhere; the health check and the sync endpoint refuse it; its own
calls go through. In the fallback sandbox the control token is nowhere a session can read
(mitmdump's and the node's command lines, environments, memory, open files; the proxy's
files)."""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support.fake_vllm import FakeVLLM
from polar_mitm import session_auth
from polar_mitm.addons import sessions
from polar_mitm.rollout import bwrap as bw
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.store import query
from support import SUPPORT
from support.mitmdump_proxy import Proxy
from support.rollouts import Rollouts

HERE = SUPPORT   # the helper scripts the sessions run
FAKE = f"{sys.executable} {HERE / 'fake_harness.py'}"

needs_bwrap = pytest.mark.skipif(bw.probe()[0] is None, reason=f"no bwrap sandbox here: {bw.probe()[1]}")


def gateway_health(proxy: Proxy) -> dict:
    """The gateway's health check, asked with its control token."""
    return httpx.get("http://polar.health/_polar/health", proxy=proxy.proxy_url(),
                     headers={"authorization": f"Bearer {proxy.control_token}"}, trust_env=False, timeout=10).json()


def run_probe(tmp_path: Path, sandbox: str, probe: str, task: dict) -> tuple[Proxy, dict, dict]:
    """One task whose workspace holds the probe (as probe.py), run by a node in `sandbox`
    against a stand-in vLLM, behind a mitmdump as Stack.start_node makes it (its control token
    handed over in a file, session credentials checked): the proxy (stopped), the task's
    group, and the gateway's health once it was done."""
    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copy(HERE / probe, ws / "probe.py")
    token = secrets.token_hex(16)
    with FakeVLLM() as backend:
        proxy = Proxy(tmp_path, backend.url, extra_sets=["polar_session_auth=on", "polar_version_check=0"],
                      control_token=token)
        try:
            runtime = LocalRuntime(tmp_path / "sessions", sandbox=sandbox, expose=[HERE])
            with Rollouts(proxy, runtime, control_token=token) as rollouts:
                (group,) = rollouts.run([{"instruction": "x", "harness": "command", "workspace": str(ws),
                                          **task}], timeout=150).values()
                return proxy, group, gateway_health(proxy)
        finally:
            proxy.stop()


def test_credentials_are_per_session_and_carried_where_the_name_is():
    cred = session_auth.credential("secret", "add@5f1c2a.0~1")
    assert len(cred) == 32 and cred != session_auth.credential("secret", "add@5f1c2a.0~0")
    assert cred != session_auth.credential("other", "add@5f1c2a.0~1")
    url = session_auth.proxy_url("add@5f1c2a.0~1", 8080, cred)
    assert url == f"http://add%405f1c2a.0~1:{cred}@127.0.0.1:8080"
    header = "Basic " + base64.b64encode(f"add%405f1c2a.0~1:{cred}".encode()).decode()
    assert sessions.proxy_auth(header) == ("add@5f1c2a.0~1", cred)     # as sent, or decoded first
    key = session_auth.api_key("add@5f1c2a.0~1", cred)
    claim = sessions.claim(headers={"authorization": f"Bearer {key}"}, query="", proxy=None, client_host="c",
                           salt="s")
    assert (claim.session.session_id, claim.session.task_id, claim.credential) == \
        ("add@5f1c2a.0~1", "add@5f1c2a.0", cred)
    assert session_auth.valid("secret", "add@5f1c2a.0~1", cred)
    assert not session_auth.valid("secret", "add@5f1c2a.0~0", cred) and not session_auth.valid("secret", "x", None)


@needs_bwrap
def test_a_session_cannot_write_into_a_siblings_trajectory(tmp_path):
    # sample 0 attacks its sibling, sample 1 (one honest call); the evaluator prints what the
    # attacker's probe got (it sees the workspace)
    command = (f'case "$POLAR_SESSION" in *~1) {FAKE} ok 1;; '
               f'*) {sys.executable} probe.py 1 && {FAKE} ok 1;; esac')
    proxy, group, health = run_probe(tmp_path, "bwrap", "tamper_probe.py", {
        "task_id": "tamper", "num_samples": 2, "timeout": 60, "command": command,
        "evaluator": "[ -f tamper.json ] && tr -d '\\n' < tamper.json; echo; echo 1"})
    states = {s["session_id"]: (s["state"], s["reward"]) for s in group["sessions"]}
    assert states == {"tamper~0": ("done", 1.0), "tamper~1": ("done", 1.0)}, group
    # stored: the sibling's one call, and the attacker's own two (the probe's and the harness's)
    rows = dict(query(str(proxy.db), "SELECT session_id, count(*) FROM calls GROUP BY session_id")[1])
    assert rows == {"tamper~0": 2, "tamper~1": 1}, rows
    assert health["refused_calls"] == 5 and health["session_auth"] is True, health
    # what the attacker got: its provider's 403 for each, and its own call answered
    report = next(s for s in group["sessions"] if s["session_id"] == "tamper~0")["stats"]["eval_output"]
    got = json.loads(report[report.index("{"):report.rindex("}") + 1])
    for name in ("sibling by proxy user", "sibling by proxy user, own credential", "sibling by API key",
                 "sibling by API key, own credential", "no name"):
        status, body = got[name]
        assert status == 403 and body["error"]["type"] and "credential" in body["error"]["message"], (name, body)
    assert got["health"][0] == 403 and "policy" not in got["health"][1], got["health"]
    assert got["sync"][0] == 403 and got["verify"][0] == 403
    assert got["own"][0] == 200 and got["own"][1]["choices"][0]["message"]["content"] == "ok"


def test_in_the_fallback_sandbox_the_control_token_cannot_be_read(tmp_path):
    # the probe runs as the harness, then the test reads what it kept
    proxy, group, _ = run_probe(tmp_path, "local", "secret_probe.py", {
        "task_id": "peek", "num_samples": 1, "timeout": 120, "evaluator": "echo 1",
        "command": f"{sys.executable} probe.py {tmp_path / 'mitmproxy'} {tmp_path} && cp -r seen probe.json {tmp_path}/"})
    mitmdump = proxy.pid
    (s,) = group["sessions"]
    assert s["state"] == "done", s
    report = json.loads((tmp_path / "probe.json").read_text())
    procs = report["processes"]
    assert str(mitmdump) in procs, "the fallback sandbox shares the node's PID namespace: the probe must see mitmdump"
    assert "mitmdump" in procs[str(mitmdump)]["cmdline"]
    seen = procs[str(mitmdump)]
    assert seen["environ"].startswith("blocked") and seen["mem"].startswith("blocked"), seen
    fds = seen["fds"]     # listed maybe, but none of them opened
    assert isinstance(fds, str) or all(v.startswith("blocked") for v in fds.values()), seen
    token = proxy.control_token.encode()
    leaked = [p.name for p in (tmp_path / "seen").iterdir() if token in p.read_bytes()]
    assert not leaked, f"the control token was readable in {leaked}"
    assert len(list((tmp_path / "seen").iterdir())) > 10       # it did read what it could
    assert subprocess.run(["grep", "-rl", proxy.control_token, str(proxy.confdir)],
                          capture_output=True).stdout == b""    # no token file left behind
