"""The gateway addon in-process, with mitmproxy's own test helpers: milliseconds, no
mitmdump. (TLS, the CA and the proxy modes stay in the mitmdump end-to-end tests.)"""

import asyncio
import time

import pytest
from mitmproxy import exceptions, hooks
from mitmproxy.test import taddons, tflow

from polar_mitm.addons.gateway import PolarGateway


def run(coro):
    return asyncio.run(coro)


async def through(gw, flow):
    """The request hook of every addon, in the order mitmproxy runs them."""
    for a in gw.addons:
        if hasattr(a, "request"):
            res = a.request(flow)
            if asyncio.iscoroutine(res):
                await res


async def running(tctx):
    """mitmproxy's running hook, as the proxy starts: the writer opens, the relay listens."""
    await tctx.master.addons.trigger_event(hooks.RunningHook())


def test_options_changed_with_set_take_effect(tmp_path):
    async def main():
        gw = PolarGateway()
        with taddons.context(gw) as tctx:
            tctx.configure(gw, polar_db=str(tmp_path / "a.duckdb"), polar_backend_timeout=5,
                           polar_max_concurrency=2, polar_sampling="temperature=1.0")
            first = gw.backend.client
            assert first.timeout == 5 and gw.backend.slots is not None
            tctx.configure(gw, polar_backend_timeout=7, polar_max_concurrency=0)
            second = gw.backend.client
            assert second is not first and second.timeout == 7 and gw.backend.slots is None
            assert gw.model_calls.overrides == {"temperature": 1.0}
            tctx.configure(gw, polar_sampling="max_tokens=64")
            assert gw.model_calls.overrides == {"max_tokens": 64}
            tctx.master.addons.trigger(hooks.DoneHook())
            assert gw.backend.client is None
    run(main())


def test_invalid_options_are_refused_and_passthrough_stays_off(tmp_path):
    async def main():
        gw = PolarGateway()
        with taddons.context(gw) as tctx:
            for bad in ({"polar_sampling": "novalue"}, {"polar_max_body": "lots"},
                        {"polar_model_hosts": "("}, {"polar_backend_timeout": 0}):
                with pytest.raises(exceptions.OptionsError):
                    tctx.configure(gw, **bad)
            tctx.configure(gw, ignore_hosts=[".*"], tcp_hosts=[".*"], udp_hosts=[".*"])
            assert tctx.options.ignore_hosts == tctx.options.tcp_hosts == tctx.options.udp_hosts == []
            assert gw.recorder.writer is None   # loading and configuring open no database
    run(main())


def test_server_connections_are_never_opened():
    async def main():
        gw = PolarGateway()
        with taddons.context(gw):
            f = tflow.tflow()
            from mitmproxy.proxy import server_hooks
            data = server_hooks.ServerConnectionHookData(server=f.server_conn, client=f.client_conn)
            gw.backstop.server_connect(data)
            assert data.server.error
    run(main())


def test_a_bug_gets_a_500_that_names_no_detail(monkeypatch):
    """Raised in a model call, or a request no addon answered (the backstop's Unanswered)."""
    async def bug(flow):
        raise RuntimeError("a detail for the log only")

    async def main():
        gw = PolarGateway()
        with taddons.context(gw):
            monkeypatch.setattr(gw.model_calls, "_route", bug)
            raised, unanswered = tflow.tflow(), tflow.tflow()
            await gw.model_calls.request(raised)
            gw.addons[-1].request(unanswered)   # Unanswered: the last addon, after every one that answers
            for f in (raised, unanswered):
                assert f.response.status_code == 500
                assert f.response.headers["content-type"] == "application/json"
                assert f.response.json() == {"error": {"message": "polar-mitm internal error", "type": "api_error"}}
    run(main())


def test_local_answers_and_health(tmp_path):
    async def main():
        gw = PolarGateway()
        with taddons.context(gw) as tctx:
            tctx.configure(gw, polar_db=str(tmp_path / "a.duckdb"))
            health = tflow.tflow()
            health.request.method, health.request.path = "GET", "/_polar/health"
            await through(gw, health)
            assert health.response.status_code == 200 and b'"polar":"ok"' in health.response.content
            telemetry = tflow.tflow()
            telemetry.request.method, telemetry.request.path = "POST", "/api/event_logging/batch"
            telemetry.request.content = b'{"events": []}'
            await gw.model_calls.request(telemetry)
            await gw.local.request(telemetry)
            assert telemetry.response.status_code == 204
            gw.model_calls.done()
    run(main())


def test_a_model_call_in_process_is_answered_recorded_and_attributed(tmp_path):
    from support.fake_vllm import FakeVLLM
    from polar_mitm.store import query

    async def main():
        gw = PolarGateway()
        with FakeVLLM() as fake, taddons.context(gw) as tctx:
            tctx.configure(gw, polar_db=str(tmp_path / "a.duckdb"), polar_backend=fake.url)
            await running(tctx)
            connect = tflow.tflow()
            connect.request.headers["proxy-authorization"] = "Basic " + __import__("base64").b64encode(
                b"fixbug~3:x").decode()
            gw.users.http_connect(connect)
            f = tflow.tflow()
            f.client_conn = connect.client_conn
            f.request.method, f.request.path = "POST", "/v1/chat/completions?key=s3cret"
            f.request.host = "api.openai.com"
            f.request.content = b'{"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}'
            await through(gw, f)
            assert f.response.status_code == 200
            assert f.response.json()["choices"][0]["message"]["content"] == "ok"
            assert "s3cret" not in f.request.path                     # redacted for mitmdump's log
            writer = gw.recorder.writer
            writer.load_interval = 0.0    # a part-filled row group loads at once, not after a minute
            deadline = time.monotonic() + 10
            while writer.loads == 0 and time.monotonic() < deadline:   # the loader's next pass
                writer._wake.set()
                await asyncio.sleep(0.1)
            health = tflow.tflow()
            health.request.method, health.request.path = "GET", "/_polar/health"
            await through(gw, health)
            assert {k: health.response.json()[k] for k in ("calls", "loads", "load_errors")} == \
                {"calls": 1, "loads": writer.loads, "load_errors": 0} and writer.loads >= 1
            stray = tflow.tflow()
            stray.request.method, stray.request.path = "POST", "/v1/unknown"
            gw.local.request = lambda flow: None                      # pretend an addon forgot it
            await through(gw, stray)
            assert stray.response.status_code == 500                  # never upstream
            tctx.master.addons.trigger(hooks.DoneHook())
        _, rows = query(tmp_path / "a.duckdb", "SELECT session_id, status_code, path FROM call_records")
        assert rows == [("fixbug~3", 200, "/v1/chat/completions")]
    run(main())


def test_only_the_loopback_relay_may_be_connected_to():
    from mitmproxy.proxy import server_hooks

    async def main():
        gw = PolarGateway()
        with taddons.context(gw):
            await gw.relay.start()
            allowed, other = tflow.tflow(), tflow.tflow()
            allowed.server_conn.address = gw.relay.address
            other.server_conn.address = ("127.0.0.1", 22)
            for f in (allowed, other):
                data = server_hooks.ServerConnectionHookData(server=f.server_conn, client=f.client_conn)
                gw.backstop.server_connect(data)
            assert allowed.server_conn.error is None and other.server_conn.error
            gw.relay.close()
            assert gw.relay.addresses() == ()
    run(main())


def test_what_orjson_cannot_write_is_a_400_and_a_deep_part_never_forwarded_is_fine(tmp_path):
    """Depth is checked only when a body cannot be forwarded as JSON: a tool schema 300
    levels deep is the client's 400 (not a 500), as is an int past 64 bits; depth that the
    adapters drop, like an unknown field, costs nothing and the call goes through."""
    from support.fake_vllm import FakeVLLM

    deep = {}
    for _ in range(300):
        deep = {"type": "object", "properties": {"x": deep}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    msg = '"messages": [{"role": "user", "content": "hi"}]'
    bodies = {
        "deep_tool": b'{"model": "m", ' + msg.encode() + b', "tools": [' + __import__("json").dumps(tool).encode() + b"]}",
        "big_int": b'{"model": "m", ' + msg.encode() + b', "seed": 123456789012345678901234567890}',
        "deep_unknown": b'{"model": "m", ' + msg.encode() + b', "x_extra": ' + b"[" * 300 + b"]" * 300 + b"}",
    }

    async def main():
        gw = PolarGateway()
        with FakeVLLM() as fake, taddons.context(gw) as tctx:
            tctx.configure(gw, polar_db=str(tmp_path / "a.duckdb"), polar_backend=fake.url)
            await running(tctx)
            out = {}
            for name, body in bodies.items():
                f = tflow.tflow()
                f.request.method, f.request.path, f.request.content = "POST", "/v1/chat/completions", body
                await through(gw, f)
                out[name] = (f.response.status_code, f.response.json())
            tctx.master.addons.trigger(hooks.DoneHook())
        return out

    out = run(main())
    assert out["deep_tool"][0] == 400 and "nested deeper than" in out["deep_tool"][1]["error"]["message"]
    assert out["big_int"][0] == 400      # orjson reads it as a float: the adapter refuses it
    assert out["deep_unknown"][0] == 200
