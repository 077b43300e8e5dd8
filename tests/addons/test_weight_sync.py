"""A weight sync through the gateway in drain mode: new calls are held (not refused; streaming
clients get keepalives), calls in flight finish first, vLLM reloads, and every call carries the
version that sampled it. Against a slow stand-in whose answers say which weights served them."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from support.fake_vllm import FakeVLLM
from polar_mitm.addons.policy_gate import PolicyGate
from polar_mitm.store import query

TOKEN = "test-control-token"


def sync(proxy, checkpoint: str, version: int, token: str = TOKEN) -> httpx.Response:
    return httpx.post(proxy.base_url + "/_polar/sync", json={"checkpoint": checkpoint, "version": version},
                      headers={"authorization": f"Bearer {token}"}, timeout=60, trust_env=False)


def policy(proxy) -> dict:
    return httpx.get(proxy.base_url + "/_polar/health", trust_env=False, timeout=10,
                     headers={"authorization": f"Bearer {TOKEN}"}).json()["policy"]


def test_no_call_straddles_a_sync(start_proxy):
    """polar_sync_mode=drain (the in-flight default: test_inflight_sync.py)."""
    with FakeVLLM(delay=0.8, reload_delay=0.5) as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}", "polar_stream_keepalive=0.2",
                                       "polar_sync_mode=drain"])
        answers: dict[int, str] = {}
        errors: list[BaseException] = []

        def call(i: int) -> None:
            client = openai.OpenAI(base_url=proxy.base_url + "/v1", api_key=f"polar-sync~{i}",
                                   max_retries=0, timeout=60)
            try:
                if i % 2:   # streaming: kept alive while held
                    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                            stream=True)
                    answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                else:
                    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                    answers[i] = r.choices[0].message.content
            except BaseException as e:   # noqa: BLE001 - reported below
                errors.append(e)

        first = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in first:
            t.start()
        deadline = time.monotonic() + 10
        while len(fake.bodies) < 8 and time.monotonic() < deadline:   # all 8 in flight
            time.sleep(0.01)
        report: dict = {}
        fake.reload_gate = threading.Event()
        syncer = threading.Thread(target=lambda: report.update(sync(proxy, "/ckpt/1", 1).json()))
        syncer.start()
        while not policy(proxy)["holding"] and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        second = [threading.Thread(target=call, args=(i,)) for i in range(8, 16)]   # during the sync
        for t in second:
            t.start()
        # the reload lasts until the gateway holds one of them: on a loaded machine the
        # clients could otherwise arrive after the sync (8 threads start slowly)
        held_by = time.monotonic() + 120      # generous: under a loaded suite threads start late
        while not policy(proxy)["held"] and time.monotonic() < held_by:
            time.sleep(0.01)
        fake.reload_gate.set()
        for t in [*first, syncer, *second]:
            t.join(60)
        assert not errors, errors
        assert len(answers) == 16
        # (while the backend is still up: once it is gone the gateway no longer vouches for it)
        assert policy(proxy) == {"version": 1, "checkpoint": "/ckpt/1", "holding": False, "held": 0,
                                 "in_flight": 0, "asleep": False, "verified": True, "epoch": 0,
                                 "losses": 0}

    assert report["version"] == 1 and report["drained"] == 8 and report["held"] >= 1, report
    (r0, r1, _), = fake.reloads
    for start, end, before, after in fake.served:
        assert before == after, "the weights changed under a call"
        assert end <= r0 or start >= r1, "a call reached the backend during the reload"
    rows = query(proxy.db, "SELECT session_id, policy_version, response_json->>'$.choices[0].message.content', "
                           "stream FROM calls")[1]
    assert len(rows) == 16
    by_version = {0: "ok", 1: "ok /ckpt/1"}
    for sid, version, content, stream in rows:
        i = int(sid.split("~")[1])
        assert answers[i] == by_version[version], (sid, version, answers[i])
        if not stream:
            assert content == answers[i]
    assert sorted(v for _, v, *_ in rows) == [0] * 8 + [1] * 8   # the first 8 before, the rest after


def test_a_sync_needs_the_token_and_a_dev_mode_backend(start_proxy):
    with FakeVLLM(dev_mode=False) as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}"])
        assert sync(proxy, "/ckpt/1", 1, token="wrong").status_code == 403
        r = sync(proxy, "/ckpt/1", 1)
        assert r.status_code == 502 and "VLLM_SERVER_DEV_MODE=1" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=proxy.base_url + "/v1", api_key="polar-nosync~0", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert query(proxy.db, "SELECT policy_version FROM calls")[1] == [(0,)]   # the old version stays


def test_syncs_are_off_without_a_token(start_proxy):
    with FakeVLLM() as fake:
        proxy = start_proxy(fake.url)
        assert sync(proxy, "/ckpt/1", 1, token="anything").status_code == 403
        assert not fake.reloads


async def test_the_gate_holds_new_calls_until_the_swap_is_done():
    gate = PolicyGate(version=3)
    order: list[str] = []
    import asyncio

    async def call(name: str, hold: float):
        async with gate.call() as v:
            order.append(f"{name}@{v.version}")
            await asyncio.sleep(hold)
        order.append(f"{name} done")

    async def swap(wake: bool):
        order.append("swap")
        await asyncio.sleep(0.05)

    first = asyncio.ensure_future(call("a", 0.1))
    await asyncio.sleep(0.01)
    syncing = asyncio.ensure_future(gate.sync(swap, 4, "/c"))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(call("b", 0))
    report = await syncing
    await asyncio.gather(first, second)
    assert order == ["a@3", "a done", "swap", "b@4", "b done"]
    assert (report.version, report.drained, report.held) == (4, 1, 1)

    async def failing(wake: bool):
        raise RuntimeError("reload failed")
    with pytest.raises(RuntimeError):
        await gate.sync(failing, 5)
    # half a swap may have reloaded without tagging: no call is vouched for until a sync
    assert gate.version == 4 and not gate.verified and gate.epoch == 1
    async with gate.call() as v:
        assert v.version is None


async def test_a_sleeping_backend_holds_calls_until_the_sync_wakes_it():
    import asyncio
    gate = PolicyGate(version=1)
    order: list[str] = []

    async def call(name: str):
        async with gate.call() as v:
            order.append(f"{name}@{v.version}")

    async def sleep():
        order.append("sleep")

    async def swap(wake: bool):
        order.append(f"swap wake={wake}")

    await gate.sleep(sleep)
    assert gate.state()["asleep"] and gate.state()["holding"]
    held = asyncio.ensure_future(call("a"))
    await asyncio.sleep(0.05)
    assert order == ["sleep"] and gate.held == 1      # asleep: the call waits, it is not refused

    async def failing(wake: bool):
        raise RuntimeError("no memory to wake")
    with pytest.raises(RuntimeError):
        await gate.sync(failing, 2)
    await asyncio.sleep(0.05)
    assert order == ["sleep"] and gate.asleep          # still asleep: still held

    await gate.sync(swap, 2, "/c")
    await held
    assert order == ["sleep", "swap wake=True", "a@2"]
    assert not gate.asleep and not gate.state()["holding"]


def test_a_call_its_client_gave_up_on_is_recorded_as_abandoned(start_proxy):
    with FakeVLLM(delay=2.0) as fake:
        proxy = start_proxy(fake.url, ["polar_stream_keepalive=0"])
        with pytest.raises(httpx.TimeoutException):
            httpx.post(proxy.base_url + "/v1/chat/completions", timeout=0.5, trust_env=False,
                       headers={"authorization": "Bearer polar-gone~0"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        time.sleep(2.5)   # the backend answers after the client left
        ok = httpx.post(proxy.base_url + "/v1/chat/completions", timeout=10, trust_env=False,
                        headers={"authorization": "Bearer polar-stayed~0"},
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
    rows = query(proxy.db, "SELECT session_id, status_code, error_kind FROM calls ORDER BY session_id")[1]
    assert rows == [("gone~0", 200, "abandoned"), ("stayed~0", 200, None)]
