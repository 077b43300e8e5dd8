"""Every HTTP client reaches the gateway with the proxy URL a node gives its sessions
(issue 31, section 4): the loop's session names (TASK@RUN.I~SAMPLE) hold an "@" that curl,
libcurl and undici read as the end of the userinfo unless it is percent-encoded. Each client
below takes HTTPS_PROXY from its environment, as a `command` harness's would, with the
session's credential as the password, and its call is stored under the session's own name.
(The five CLIs run the same way in test_harness_runners.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.fake_vllm import FakeVLLM
from polar_mitm import session_auth
from polar_mitm.rollout import harnesses
from polar_mitm.store import query

TOKEN = "client-matrix-token"
URL = "https://api.openai.com/v1/chat/completions"
BODY = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})

PY_HTTPX = f"""
import httpx, os
r = httpx.post({URL!r}, content={BODY!r}, headers={{"content-type": "application/json", "authorization": "Bearer x"}},
               verify=os.environ["SSL_CERT_FILE"], timeout=30)
print(r.status_code, r.json()["choices"][0]["message"]["content"])
"""
PY_REQUESTS = f"""
import requests
r = requests.post({URL!r}, data={BODY!r}, headers={{"content-type": "application/json", "authorization": "Bearer x"}},
                  timeout=30)
print(r.status_code, r.json()["choices"][0]["message"]["content"])
"""
NODE_FETCH = f"""
const {{ setGlobalDispatcher, EnvHttpProxyAgent, fetch: undiciFetch }} = require("undici");
const agent = new EnvHttpProxyAgent();
const how = process.argv[2];
const go = how === "undici" ? (u, o) => undiciFetch(u, {{...o, dispatcher: agent}})
                            : (setGlobalDispatcher(agent), (u, o) => fetch(u, o));   // Node's own fetch
go({URL!r}, {{method: "POST", body: {BODY!r},
             headers: {{"content-type": "application/json", "authorization": "Bearer x"}}}})
  .then(async r => {{ const j = await r.json(); console.log(r.status, j.choices[0].message.content); }})
  .catch(e => {{ console.error(e); process.exit(1); }});
"""


def undici_dir() -> Path:
    """Node 20's fetch takes a proxy only through undici's dispatcher: the copy that the Pi
    harness installs (scripts/install.sh installs Pi)."""
    try:
        exe = harnesses.install("pi")
    except harnesses.HarnessMissing as e:
        pytest.fail(f"the Pi harness (and its undici) could not be installed: {e}")
    return exe.parents[1]      # .../node_modules


CLIENTS = {
    "curl": lambda d: ["curl", "-sS", "--fail-with-body", "-X", "POST", URL, "-H", "content-type: application/json",
                       "-H", "authorization: Bearer x", "-d", BODY, "-w", "\n%{http_code}"],
    "httpx": lambda d: [sys.executable, "-c", PY_HTTPX],
    "requests": lambda d: [sys.executable, "-c", PY_REQUESTS],
    "node-fetch": lambda d: ["node", "-e", NODE_FETCH, "--", "fetch"],
    "undici": lambda d: ["node", "-e", NODE_FETCH, "--", "undici"],
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from support.mitmdump_proxy import Proxy
    with FakeVLLM() as fake:
        proxy = Proxy(tmp_path_factory.mktemp("matrix"), fake.url,
                      [f"polar_control_token={TOKEN}", "polar_session_auth=on", "polar_version_check=0"])
        yield proxy
        proxy.stop()


@pytest.mark.parametrize("client", list(CLIENTS))
def test_every_client_reaches_the_gateway_under_a_loop_session_name(client, gateway):
    sid = f"sum-{client}@5f1c2a.3~1"          # as the loop names iteration 3's sample 1
    ctx = harnesses.RunContext(session_id=sid, instruction="x", proxy_port=gateway.port, ca_path=gateway.ca,
                               home=Path("/tmp"), workdir=Path("/tmp"),
                               credential=session_auth.credential(TOKEN, sid))
    env = {**os.environ, **harnesses.proxy_env(ctx), "NODE_PATH": str(undici_dir())}
    done = subprocess.run(CLIENTS[client](gateway), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{client}: {done.stdout}\n{done.stderr}"
    out = done.stdout.split()
    assert "200" in out and ("ok" in out or '"content":"ok"' in done.stdout), done.stdout
    rows = query(gateway.db, "SELECT c.session_id, s.task_id, s.source, c.status_code FROM calls c "
                             "JOIN sessions s USING (session_id) WHERE c.session_id = ?", [sid])[1]
    assert rows == [(sid, f"sum-{client}@5f1c2a.3", "proxy_user", 200)], rows


def test_the_unencoded_name_is_what_broke_curl(gateway):
    """The control: the same name written raw in the URL's userinfo, as nodes did before."""
    sid = "raw@5f1c2a.3~1"
    env = {**os.environ, "HTTPS_PROXY": f"http://{sid}:x@127.0.0.1:{gateway.port}", "SSL_CERT_FILE": gateway.ca}
    done = subprocess.run(CLIENTS["curl"](gateway), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 5 and "proxy" in done.stderr.lower(), (done.returncode, done.stderr)


def test_a_curl_command_harness_in_the_loop_records_its_calls(tmp_path):
    """The held-out task file that made 0 calls: a `command` harness that calls the model with
    curl through the HTTPS_PROXY the node sets, in `polar-train loop` (session names
    TASK@RUN.I~SAMPLE). Every sample's call is recorded under its own session and trained."""
    from support.grpo_data import tiny_model_dir
    from support.loop_run import TRAIN, LoopRun

    model = str(tiny_model_dir(tmp_path / "model"))
    curl = (f"curl -sS --fail-with-body -X POST {URL} -H 'content-type: application/json' "
            f"-H 'authorization: Bearer x' -d '{BODY}' -o answer.json")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"task_id": t, "instruction": "say ok", "harness": "command",
                                           "command": curl, "timeout": 60,
                                           "evaluator": "grep -q chat.completion answer.json && echo $POLAR_SAMPLE"})
                               for t in ("curl-a", "curl-b")) + "\n")
    out = tmp_path / "run"
    with FakeVLLM() as fake:
        run = LoopRun([TRAIN, "loop", "--tasks", str(tasks), "--iterations", "1", "--out", str(out),
                       "--samples", "2", "--backend", fake.url, "--model", model, "--lr", "1e-3",
                       "--token-budget", "256", "--workers", "2", "--max-tokens", "8"])
        assert run.wait(300) == 0, run.output[-3000:]
    run_id = json.loads((out / "loop.json").read_text())["run_id"]
    rows = query(out / "rollouts.duckdb", "SELECT c.session_id, s.source, s.reward FROM calls c "
                                          "JOIN sessions s USING (session_id) ORDER BY 1")[1]
    assert rows == [(f"{t}@{run_id}.0~{i}", "proxy_user", float(i)) for t in ("curl-a", "curl-b") for i in (0, 1)]
    trained = query(out / "rollouts.duckdb", "SELECT calls FROM loop_iterations")[1]
    assert trained == [(4,)], trained
