"""Each of the five CLIs, installed from npm at its pinned version and started by its runner,
completes a multi-turn tool loop through the proxy in regular mode (HTTPS_PROXY + CA): the
scripted backend asks for the CLI's own shell tool, the CLI runs it in the session's
workspace, sends the result back, and the evaluator finds the file the command wrote."""

from __future__ import annotations

import httpx
import pytest

from polar_mitm.rollout import harnesses
from polar_mitm.rollout.runtime import LocalRuntime, unshare_argv
from polar_mitm.store import query
from support.procs import until
from support.fake_vllm import MARKER, FakeVLLM
from support.rollouts import Rollouts, installed, session_logs

CLIS = list(harnesses.PACKAGES)       # every harness of the registry that is a CLI
# A node's gateway: session credentials checked (made under its control token), and the
# sessions named as the loop names them (TASK@RUN.I~SAMPLE: an "@" that every client must
# read as part of the proxy user, percent-encoded).
TOKEN = "harness-runners-token"
NODE_SETS = [f"polar_control_token={TOKEN}", "polar_session_auth=on"]


@pytest.fixture(scope="module")
def scripted():
    with FakeVLLM("scripted") as backend:
        yield backend


def tool_results(bodies: list[dict]) -> list[str]:
    out = []
    for b in bodies:
        for m in b.get("messages") or []:
            if m.get("role") == "tool":
                c = m.get("content")
                out.append(c if isinstance(c, str) else str(c))
    return out


# Harness timers shorter than a SLOW_ANSWER: without keepalives each would fail the call.
#  - Codex gives up on a stream after stream_idle_timeout_ms without an SSE event (300 s by
#    default; comment lines do not count).
#  - Claude Code (API_TIMEOUT_MS) and Qwen Code (QWEN_CODE_API_TIMEOUT_MS) abort a request
#    whose response headers take longer than their SDK timeout (600 s and 120 s by default).
#  Claude's own stream idle timers cannot be set below 300 s (max(CLAUDE_STREAM_IDLE_TIMEOUT_MS,
#  300000)), too long for CI.
SLOW_ANSWER, SHORT_TIMER = 3.5, 2000
SHORT_TIMER_ARGS = {"codex": ["-c", f"model_providers.polar.stream_idle_timeout_ms={SHORT_TIMER}",
                              "-c", "model_providers.polar.stream_max_retries=0",
                              "-c", "model_providers.polar.request_max_retries=0"]}
SHORT_TIMER_ENV = {"claude": {"API_TIMEOUT_MS": str(SHORT_TIMER), "CLAUDE_CODE_MAX_RETRIES": "0"},
                   "qwen": {"QWEN_CODE_API_TIMEOUT_MS": str(SHORT_TIMER)}}
SHORT_TIMERS = SHORT_TIMER_ARGS.keys() | SHORT_TIMER_ENV.keys()


def short_timers(name, ctx):
    launch = harnesses.launch(name, ctx)
    launch.argv[1:1] = SHORT_TIMER_ARGS.get(name, [])
    launch.env.update(SHORT_TIMER_ENV.get(name, {}))
    return launch


def run_task(proxy, tmp_path, task: str, name: str, launcher, timeout: int, **extra) -> tuple[dict, str]:
    """One sample of a task (with extra fields), run by a gateway node with `name`'s runner
    through the proxy: its session, and the tail of its logs."""
    runtime = LocalRuntime(tmp_path / "sessions", keep=True)
    with Rollouts(proxy, runtime, workers=1, post_workers=1, control_token=TOKEN, launcher=launcher) as rollouts:
        groups = rollouts.run([{"task_id": task, "harness": name, "timeout": timeout,
                                "instruction": "Run the shell command 'echo hi' and tell me what it printed.",
                                "evaluator": f"grep -q {MARKER} polar_proof.txt", **extra}], timeout=timeout + 60)
    return groups[task]["sessions"][0], session_logs(runtime)


@pytest.mark.parametrize("slow", [False, True], ids=["quick", "kept-alive"])
@pytest.mark.parametrize("name", CLIS)
def test_cli_completes_a_tool_loop_through_the_proxy(name, slow, scripted, start_proxy, tmp_path):
    """kept-alive: every completion takes 1.2 s (3.5 s for the CLIs with SHORT_TIMERS of 2 s), so
    with a 0.3 s keepalive each streamed answer reaches the CLI as SSE headers, keepalives, then
    the events."""
    installed(name)
    proxy = start_proxy(scripted.url, extra_sets=NODE_SETS + (["polar_stream_keepalive=0.3"] if slow else []))
    scripted.delay = (SLOW_ANSWER if name in SHORT_TIMERS else 1.2) if slow else 0.0
    seen = len(scripted.bodies)
    task = f"loop-{name}@5f1c2a.{int(slow)}"
    try:
        s, logs = run_task(proxy, tmp_path, task, name, short_timers if slow else harnesses.launch, 240)
    finally:
        scripted.delay = 0.0
    assert s["state"] == "done" and s["reward"] == 1.0, f"{s}\n{logs}"
    health = httpx.get("http://polar.health/_polar/health", proxy=proxy.proxy_url(), trust_env=False,
                       headers={"authorization": f"Bearer {TOKEN}"}).json()
    assert (health["streams_kept_alive"] >= 2) if slow else (health["streams_kept_alive"] == 0), health
    assert health["refused_calls"] == 0, health          # every call carried its session's credential
    sid = f"{task}~0"
    bodies = scripted.bodies[seen:]
    assert any(MARKER in r for r in tool_results(bodies)), "the tool's output never reached the model"
    if name == "gemini":   # its router call comes first, asking for schema-shaped JSON
        assert (bodies[0].get("response_format") or {}).get("type") == "json_schema"
    cols, rows = query(proxy.db, "SELECT count(*), count(error), max(seq) FROM call_records "
                                 "WHERE session_id = ?", [sid])
    n, errors, last = rows[0]
    assert n >= 2 and errors == 0 and last == n, rows          # tool call, then the answer
    assert s["stats"]["calls"] == n
    if unshare_argv():   # the CLI ran in its own network namespace, reaching only the proxy
        assert s["stats"]["network"] == "isolated"
    # named by the HTTPS_PROXY user the CLI sent on CONNECT (its API key names it too, but
    # the proxy user wins): regular mode attributes sessions with no harness change
    # the reward is stored once the server has settled the outcome (the node's next heartbeat)
    sql = "SELECT reward, task_id, source FROM sessions WHERE session_id = ?"
    assert until(lambda: query(proxy.db, sql, [sid])[1] == [(1.0, task, "proxy_user")], 10), query(proxy.db, sql, [sid])
    _, rows = query(proxy.db, "SELECT list(state ORDER BY event_at) FROM rollout_events WHERE session_id = ?", [sid])
    assert rows[0][0][:1] == ["pending"] and rows[0][0][-1] == "done"
    assert {"assigned", "init", "ready", "run", "post_run"} <= set(rows[0][0])


@pytest.mark.parametrize("name", CLIS)
def test_cli_runs_inside_an_environment_image(name, scripted, start_proxy, tmp_path):
    """The CLI in the test image (issue 33): the image's root (its own /usr, bash, python3),
    the node's Node.js and harness install bound in read-only; its shell tool runs the image's
    bash, and the evaluator finds what it wrote."""
    from polar_mitm.rollout import images
    from polar_mitm.rollout.runtime import TEST_IMAGE

    installed(name)
    images.test_image()
    proxy = start_proxy(scripted.url, extra_sets=NODE_SETS)
    task = f"image-{name}@5f1c2a.0"
    s, logs = run_task(proxy, tmp_path, task, name, harnesses.launch, 240,
                       runtime={"image": TEST_IMAGE, "workdir": "/workspace"})
    assert s["state"] == "done" and s["reward"] == 1.0, f"{s}\n{logs}"
    assert s["stats"]["image_unpack_s"] >= 0 and s["stats"]["calls"] >= 2, s["stats"]


@pytest.mark.parametrize("name", ["claude", "qwen"])
def test_the_short_timers_fire_without_keepalives(name, scripted, start_proxy, tmp_path):
    """The control for the kept-alive runs: the same timers and answers with keepalives off, and
    the CLI gives up (the timers are real, so the keepalives are what kept those runs alive).
    Codex's idle timer starts only once headers arrive, so an answer sent whole never trips it:
    its kept-alive run is the check (headers at once, then events no more than 2 s apart)."""
    installed(name)
    proxy = start_proxy(scripted.url, extra_sets=["polar_stream_keepalive=0"])
    scripted.delay = SLOW_ANSWER
    seen = len(scripted.bodies)
    try:
        s, _ = run_task(proxy, tmp_path, f"timer-{name}", name, short_timers, 120)
    finally:
        scripted.delay = 0.0
    assert s["reward"] != 1.0, s     # it never got to run the tool
    assert len(scripted.bodies) > seen, "the CLI never asked"
    assert not any(MARKER in r for r in tool_results(scripted.bodies[seen:])), "a call got through"
