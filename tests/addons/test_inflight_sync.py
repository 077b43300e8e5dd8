"""An in-flight sync (issue 42): vLLM pauses the calls it runs where they are, reloads, tags
and resumes; nothing is drained, and a call in flight across it records the version of each
of its tokens, exactly at the token. Against the stand-in's token route, whose tokens are
sampled one by one and labelled by the weights in force then (its logprob_under is the
re-score under each version). Without the token route, calls go to /v1/chat/completions and a
sync drains, as before."""

from __future__ import annotations

import threading
import time

import httpx
import openai

from polar_mitm.store import query
from support.fake_vllm import FakeVLLM

TOKEN = "inflight-token"


def control(proxy, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(proxy.base_url + path, json=body or {}, headers={"authorization": f"Bearer {TOKEN}"},
                      timeout=60, trust_env=False)


def health(proxy) -> dict:
    return httpx.get(proxy.base_url + "/_polar/health", headers={"authorization": f"Bearer {TOKEN}"},
                     timeout=10, trust_env=False).json()


def ask(proxy, session: str, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=proxy.base_url + "/v1", api_key=f"polar-{session}", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hi"}]
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(model="m", messages=messages, stream=True) if c.choices)
    return client.chat.completions.create(model="m", messages=messages).choices[0].message.content or ""


def test_a_call_in_flight_across_a_sync_records_both_versions_exactly_at_the_token(start_proxy):
    with FakeVLLM("scripted", delay=3.0, reload_delay=0.3) as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}", "polar_stream_keepalive=0.2"])
        t0 = time.monotonic()
        ask(proxy, "alone~0", stream=True)          # the same call with no sync: its wall time
        alone_s = time.monotonic() - t0
        answers: dict[str, str] = {}
        walls: dict[str, float] = {}

        def call(session: str) -> None:
            t = time.monotonic()
            answers[session] = ask(proxy, session, stream=session.endswith("1"))
            walls[session] = time.monotonic() - t

        across = [threading.Thread(target=call, args=(f"across~{i}",)) for i in range(2)]
        for t in across:
            t.start()
        assert _until(lambda: len(fake.bodies) >= 3), fake.bodies      # both generating
        time.sleep(1.0)                                                # a third of their tokens out
        report = control(proxy, "/_polar/sync", {"checkpoint": "/ckpt/1", "version": 1}).json()
        during = time.monotonic()
        call("after~0")                             # a new call is not held once the pause is over
        for t in across:
            t.join(60)
        assert health(proxy)["backend_route"] == {"route": "generate", "wanted": "auto",
                                                  "why": "the backend has /inference/v1/generate",
                                                  "sync_mode": "inflight"}
    assert report["mode"] == "inflight" and report["drained"] == 0 and report["version"] == 1, report
    assert report["stall_s"] >= 0.3 and report["steps"]["pause_s"] is not None, report
    assert time.monotonic() - during < 60
    # the engine was paused with its cache cleared (sent explicitly), then resumed
    pause = "/pause?mode=keep&clear_cache=true"
    assert pause in fake.control, fake.control
    assert fake.control[fake.control.index(pause):] == [pause, "/collective_rpc", "/update_weight_version",
                                                        "/resume"], fake.control
    rows = query(proxy.db, "SELECT session_id, policy_version, token_versions, logprobs FROM calls "
                           "ORDER BY session_id")[1]
    by = {sid: (v, tv, lp) for sid, v, tv, lp in rows}
    weights = {0: "base", 1: "/ckpt/1"}
    for sid in ("across~0", "across~1"):
        version, versions, logprobs = by[sid]
        # two versions, one boundary, each token's logprob its own version's re-score
        assert version == 0 and versions[0] == 0 and versions[-1] == 1, versions
        boundary = versions.index(1)
        assert versions == [0] * boundary + [1] * (len(versions) - boundary), versions
        for j, v in enumerate(versions):
            assert abs(logprobs[j] - FakeVLLM.logprob_under(weights[v], -0.1)) < 1e-5, (sid, j, v, logprobs[j])
    assert set(by["alone~0"][1]) == {0} and set(by["after~0"][1]) == {1}, by
    # the calls across paid the pause, not a drain: about their own time plus the stall
    assert max(walls[s] for s in ("across~0", "across~1")) < alone_s + report["total_s"] + 2.0, (walls, alone_s)
    print(f"\nalone {alone_s:.2f}s; across {walls}; sync total {report['total_s']:.2f}s stall {report['stall_s']:.2f}s")


def test_without_the_token_route_calls_take_chat_and_a_sync_drains(start_proxy):
    with FakeVLLM(delay=0.5, token_route=False) as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}"])
        assert ask(proxy, "chat~0") == "ok"
        route = health(proxy)["backend_route"]
        assert route["route"] == "chat" and route["sync_mode"] == "drain", route
        assert "no token route" in route["why"] and "--enable-scale-out" in route["why"], route
        done = threading.Thread(target=ask, args=(proxy, "chat~1"))
        done.start()
        assert _until(lambda: len(fake.bodies) >= 2)
        report = control(proxy, "/_polar/sync", {"checkpoint": "/ckpt/1", "version": 1}).json()
        done.join(30)
        assert ask(proxy, "chat~2") == "ok /ckpt/1"
    assert report["mode"] == "drain" and report["drained"] == 1, report
    assert not any(c.startswith("/pause") for c in fake.control), fake.control
    rows = query(proxy.db, "SELECT session_id, policy_version, token_versions FROM calls ORDER BY session_id")[1]
    assert rows == [("chat~0", 0, None), ("chat~1", 0, None), ("chat~2", 1, None)], rows
    assert fake.counts.get("/v1/chat/completions/render") == 1     # asked once, then never again


def test_first_calls_at_once_all_find_the_chat_route(start_proxy):
    """Calls that race to the first render of a backend without the token route each fall back
    to /v1/chat/completions (none fails for finding the route decided by another)."""
    with FakeVLLM(delay=0.3, token_route=False) as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}"])
        answers: list[str] = []
        callers = [threading.Thread(target=lambda i=i: answers.append(ask(proxy, f"race~{i}"))) for i in range(6)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(60)
        assert answers == ["ok"] * 6 and health(proxy)["backend_route"]["route"] == "chat"
    assert fake.counts.get("/v1/chat/completions") == 6, fake.counts


def test_a_sync_body_is_a_checkpoint_or_a_pull(start_proxy):
    with FakeVLLM() as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}"])
        bad = [{"version": 1}, {"checkpoint": "/c", "version": -1}, {"checkpoint": "/c", "version": True},
               {"version": 1, "pull": {"url": "file:///etc/passwd", "sha256": "0" * 64}},
               {"version": 1, "pull": {"url": "http://127.0.0.1:1/w", "sha256": "xyz"}}]
        for body in bad:
            assert control(proxy, "/_polar/sync", body).status_code == 400, body
        # a pull: vLLM's workers fetch it before the pause, then load it paused
        r = control(proxy, "/_polar/sync", {"version": 2, "checkpoint": "/ckpt/2",
                                            "pull": {"url": "http://127.0.0.1:9/w", "sha256": "a" * 64}})
        assert r.status_code == 200 and r.json()["mode"] == "inflight", r.text
    assert [c for c in fake.control if c != "/update_weight_version"][:3] == \
        ["/collective_rpc", "/pause?mode=keep&clear_cache=true", "/collective_rpc"], fake.control
    assert fake.rpcs[0] == ("polar_prefetch_weights", {"url": "http://127.0.0.1:9/w", "sha256": "a" * 64})
    assert fake.rpcs[1][0] == "polar_pull_weights" and fake.weight_version == "polar-v2"


def _until(cond, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False
