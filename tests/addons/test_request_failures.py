"""Backend failures that the request causes (issue 41, item 8), and calls in flight to the backend
per session (item 4).

A request that a healthy backend answers with an error while other calls succeed at that moment
is the policy's failure (error_kind request_failed: scored, never released); a backend that fails
every call, or whose health probe fails, is an outage (backend_error: released). A session that
fires many calls at once has at most polar_session_max_inflight of them at the backend; the rest
wait, and a sibling session's calls go through meanwhile.

The rollouts here run real sessions (the fake harness in the node's sandbox) through a real
mitmdump against the FakeVLLM stand-in; the gateway-level checks use the in-process proxy."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson

from polar_mitm.store import query
from polar_mitm.rollout.states import Session
from support import SUPPORT
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts

FAKE = f"{sys.executable} {SUPPORT / 'fake_harness.py'}"
POISON = "polar-poison"       # a prompt the stand-in's "tool parser" crashes on
ENGINE_CRASH = b'{"error":{"message":"tool parser crashed","type":"InternalServerError"}}'


class PoisonableVLLM(FakeVLLM):
    """FakeVLLM that answers 500 to a request whose messages hold POISON (a request-triggered
    engine error), to every completion while `broken_calls` > 0 (a broken engine: each such
    call counts it down), and 500 on /v1/models while `sick` (its health probe fails). It
    counts the completions in flight per `tag` (the messages' "flood"/"sibling" marker)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.broken_calls = 0
        self.sick = False
        self.inflight: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def _get(self, route):
        if self.sick and route in ("/health", "/v1/models"):
            return 500, b'{"error":{"message":"sick"}}'
        return super()._get(route)

    def _completion(self, body, weights):
        text = orjson.dumps(body.get("messages")).decode()
        with self.lock:
            if self.broken_calls > 0:
                self.broken_calls -= 1
                return 500, b'{"error":{"message":"engine is broken","type":"InternalServerError"}}'
        if POISON in text:
            return 500, ENGINE_CRASH
        return super()._completion(body, weights)

    def respond(self, method, path, raw):
        tag = None
        if method == "POST" and path.startswith(("/v1/chat/completions", "/inference/v1/generate")):
            asked = raw
            if path.startswith("/inference"):    # the token route generates what render was given
                with self.lock:
                    asked = orjson.dumps(self._rendered.get(orjson.loads(raw).get("request_id")))
            for t in ("flood", "sibling"):
                if f'"{t}' in asked.decode(errors="replace") and not path.endswith("/render"):
                    tag = t
        if tag is None:
            return super().respond(method, path, raw)
        with self.lock:
            self.inflight[tag] = self.inflight.get(tag, 0) + 1
            self.peak[tag] = max(self.peak.get(tag, 0), self.inflight[tag])
        try:
            return super().respond(method, path, raw)
        finally:
            with self.lock:
                self.inflight[tag] -= 1


def _chat(base: str, session: str, content: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=timeout, trust_env=False,
                      headers={"authorization": f"Bearer {session}"},
                      json={"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8})


def _records(db) -> dict[str, tuple]:
    _, rows = query(db, "SELECT session_id, error_kind, error FROM call_records WHERE error IS NOT NULL")
    return {sid: (kind, error) for sid, kind, error in rows}


# -- the gateway's verdict ------------------------------------------------------------------------
def test_the_verdict_on_an_error_the_backend_answered(start_inprocess_proxy, tmp_path):
    """Three failures at one gateway, each recorded with what the probe saw: a poison request
    while a sibling's calls succeed is request_failed; a backend that fails every call (its
    /health fine: no other call succeeds) and one whose probe fails are the backend's."""
    with PoisonableVLLM(delay=0.1) as backend:
        proxy = start_inprocess_proxy(backend.url, ["polar_request_failure_window=2"])
        base = proxy.base_url
        assert _chat(base, "polar-warm~0", "sibling warm").status_code == 200

        def siblings(stop: threading.Event) -> None:
            while not stop.is_set():
                _chat(base, "polar-sib~0", "sibling call")

        # 1. the request's failure: siblings succeed throughout
        stop = threading.Event()
        t = threading.Thread(target=siblings, args=(stop,))
        t.start()
        try:
            time.sleep(0.3)
            t0 = time.monotonic()
            r = _chat(base, "polar-poison~0", f"please {POISON}")
            poisoned_s = time.monotonic() - t0
        finally:
            stop.set()
            t.join()
        assert r.status_code >= 500 and "tool parser crashed" in r.text
        # 2. a broken engine: three sessions' calls at once, each fails, none succeeds
        backend.broken_calls = 3
        t0 = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            statuses = list(pool.map(lambda i: _chat(base, f"polar-broken~{i}", "hello").status_code, range(3)))
        broken_s = time.monotonic() - t0
        assert all(s >= 500 for s in statuses), statuses
        # 3. a failing health probe, though a sibling succeeds at once
        backend.sick = True
        stop = threading.Event()
        t = threading.Thread(target=siblings, args=(stop,))
        t.start()
        try:
            time.sleep(0.3)
            assert _chat(base, "polar-sick~0", f"again {POISON}").status_code >= 500
        finally:
            stop.set()
            t.join()
        backend.sick = False
        proxy.stop()
    rec = _records(proxy.db)
    kind, error = rec["poison~0"]
    assert kind == "request_failed", error
    assert "HTTP 500 from the backend" in error and "backend probe: /health 404, /v1/models 200 in" in error
    assert "other call(s) succeeded at the backend" in error and "tool parser crashed" in error
    for i in range(3):
        kind, error = rec[f"broken~{i}"]
        assert kind == "backend_error" and "no other call succeeded at the backend since this one started" in error, \
            error
    kind, error = rec["sick~0"]
    assert kind == "backend_error" and "backend probe: /health 500 in" in error, error
    # the poison call was answered once a sibling had succeeded; the broken ones once no other
    # call was left at the backend (not after the whole window)
    assert poisoned_s < 1.5 and broken_s < 1.5, (poisoned_s, broken_s)
    # no sibling call failed
    assert not [s for s in rec if s.startswith("sib")], rec


# -- calls in flight per session ------------------------------------------------------------------
def test_a_flooding_session_has_at_most_its_cap_at_the_backend_and_a_sibling_goes_through(
        start_inprocess_proxy):
    """One session fires 50 calls at once (0.25 s each at the backend); a sibling makes 6
    calls one after another meanwhile. The flood never has more than 4 at the backend, every
    call of it is answered (waiting, not failing), and the sibling's calls take about one
    call's time each."""
    cap, n = 4, 50
    with PoisonableVLLM(delay=0.25) as backend:
        proxy = start_inprocess_proxy(backend.url, [f"polar_session_max_inflight={cap}"])
        base = proxy.base_url

        async def run() -> tuple[list[int], list[float], float]:
            async with httpx.AsyncClient(timeout=120, trust_env=False,
                                         limits=httpx.Limits(max_connections=200)) as client:
                async def call(session: str, content: str) -> tuple[int, float]:
                    t0 = time.monotonic()
                    r = await client.post(f"{base}/v1/chat/completions",
                                          headers={"authorization": f"Bearer {session}"},
                                          json={"model": "m", "max_tokens": 8,
                                                "messages": [{"role": "user", "content": content}]})
                    return r.status_code, time.monotonic() - t0

                async def sibling() -> list[float]:
                    await asyncio.sleep(0.5)      # the flood is queued by then
                    out = []
                    for i in range(6):
                        status, took = await call("polar-calm~0", f"sibling {i}")
                        assert status == 200
                        out.append(took)
                    return out

                t0 = time.monotonic()
                flood = asyncio.gather(*(call("polar-flood~0", f"flood {i}") for i in range(n)))
                results, sib = await asyncio.gather(flood, sibling())
                return [s for s, _ in results], sib, time.monotonic() - t0

        statuses, sibling_s, flood_s = asyncio.run(run())
        peak = dict(backend.peak)
        proxy.stop()
    assert statuses == [200] * n, (statuses, _records(proxy.db))
    assert peak["flood"] == cap, peak          # never more, and the cap is used
    # 50 calls, 4 at a time, 0.25 s each: ~3.1 s; the sibling's calls meanwhile take ~0.25 s
    assert flood_s >= (n / cap) * 0.25 * 0.9, flood_s
    # a sibling never waits behind the flood (its last call ~3 s): measured against the flood's
    # own time, so that a loaded machine slows both alike
    assert max(sibling_s) < flood_s / 2, (sibling_s, flood_s)
    print(f"\nflood of {n}: {flood_s:.2f}s, peak at the backend {peak['flood']}; sibling latency "
          f"min {min(sibling_s) * 1000:.0f} ms, max {max(sibling_s) * 1000:.0f} ms")


# -- in a rollout -------------------------------------------------------------------------------
def test_a_request_triggered_5xx_scores_as_the_policys_failure_and_an_outage_releases(start_proxy, tmp_path):
    """Real sessions in the sandbox, one rollout. `poison`'s prompt makes the backend answer 500
    while `calm`'s calls succeed: its sessions fail and score 0.0 (on_failure zero), never
    released. Then `broken` runs alone while the backend fails every call (its /health fine):
    nothing else succeeds, so that is the backend's failure, and the session is released and
    runs again cleanly."""
    with PoisonableVLLM(delay=0.25) as backend:
        proxy = start_proxy(backend.url, ["polar_request_failure_window=3"])
        with Rollouts(proxy, tmp_path / "sessions", workers=4, backend_url=backend.url) as rollouts:
            first = rollouts.run([
                {"task_id": "calm", "instruction": "sibling", "harness": "command", "num_samples": 2,
                 "command": f"{FAKE} ok 6", "evaluator": "test -f result.txt"},
                {"task_id": "poison", "instruction": f"sibling {POISON}", "harness": "command", "num_samples": 2,
                 "command": f"sleep 0.5 && {FAKE} ok 2", "evaluator": "test -f result.txt"}], timeout=120)
            backend.broken_calls = 1
            second = rollouts.run([{"task_id": "broken", "instruction": "x", "harness": "command",
                                    "command": f"{FAKE} ok 2", "evaluator": "test -f result.txt"}], timeout=120)
    calm, poison, broken = first["calm"], first["poison"], second["broken"]
    assert [(s["state"], s["reward"]) for s in calm["sessions"]] == [(Session.DONE, 1.0)] * 2, calm
    # the request's failure: scored (0.0 under on_failure zero), never released
    assert poison["attempts"] == [], poison["attempts"]
    assert [(s["state"], s["reward"]) for s in poison["sessions"]] == [(Session.FAILED, 0.0)] * 2, poison
    assert all("release_cause" not in (s["stats"] or {}) for s in poison["sessions"])
    _, kinds = query(proxy.db, "SELECT session_id, error_kind, error FROM call_records WHERE error IS NOT NULL "
                               "ORDER BY session_id")
    by_session = {sid: (kind, error) for sid, kind, error in kinds}
    for sid in ("poison~0", "poison~1"):
        kind, error = by_session[sid]
        assert kind == "request_failed" and "other call(s) succeeded at the backend" in error, error
    # the outage: released, then scored on its rerun
    (a,) = broken["attempts"]
    assert a["state"] == Session.RELEASED and a["reward"] is None and a["stats"]["release_cause"] == "backend_unavailable"
    assert by_session["broken~0"][0] == "backend_error"
    assert "no other call succeeded" in by_session["broken~0"][1]
    assert [(s["session_id"], s["state"], s["reward"]) for s in broken["sessions"]] == \
        [("broken~0.r2", Session.DONE, 1.0)]


def test_session_slots_wait_in_order_and_a_wait_past_its_bound_is_named_by_whose_it_is():
    """First come first served; a call that waited in vain is session_busy (the policy's) when
    the session's own calls ahead of it were being answered, timeout (the backend's) when none
    was; a caller that goes away leaves no trace."""
    from polar_mitm.addons.backend_client import BackendTimeout
    from polar_mitm.addons.session_slots import SessionBusy, SessionSlots

    async def main():
        slots, order = SessionSlots(cap=1), []

        async def hold(name: str, seconds: float, timeout: float = 10.0):
            async with slots.slot("s", timeout):
                order.append(name)
                await asyncio.sleep(seconds)

        # in order
        await asyncio.gather(*(hold(f"c{i}", 0.01) for i in range(6)))
        assert order == [f"c{i}" for i in range(6)]
        # stuck: the call ahead never finishes while this one waits -> the backend's
        stuck = asyncio.ensure_future(hold("stuck", 0.5))
        await asyncio.sleep(0.01)
        try:
            await hold("late", 0, timeout=0.1)
        except BackendTimeout:
            pass
        else:
            raise AssertionError("no timeout")
        await stuck
        # busy: calls ahead were answered, one after another, but none left a slot for it
        first = asyncio.ensure_future(hold("a", 0.1))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(hold("b", 0.4))
        await asyncio.sleep(0.01)
        try:
            await hold("c", 0, timeout=0.25)
        except SessionBusy as e:
            assert e.kind == "session_busy" and e.answer_kind == "rate_limit"
        else:
            raise AssertionError("not busy")
        await asyncio.gather(first, second)
        # a waiter cancelled: the queue goes on, and nothing is left behind
        holder = asyncio.ensure_future(hold("h", 0.1))
        await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(hold("gone", 0))
        after = asyncio.ensure_future(hold("after", 0))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(holder, after)
        assert order[-2:] == ["h", "after"] and slots.in_flight("s") == 0 and slots._queues == {}

    asyncio.run(main())
