"""The gateway addon in-process, with mitmproxy's own test helpers: milliseconds, no
mitmdump. (TLS, the CA and the proxy modes stay in the mitmdump end-to-end tests.)"""

import asyncio

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons, tflow

from polar_mitm.addons.gateway import PolarGateway


def run(coro):
    return asyncio.run(coro)


def test_options_changed_with_set_take_effect(tmp_path):
    async def main():
        gw = PolarGateway()
        with taddons.context(gw) as tctx:
            tctx.configure(gw, polar_db=str(tmp_path / "a.duckdb"), polar_backend_timeout=5,
                           polar_max_concurrency=2, polar_sampling="temperature=1.0")
            first = gw._http()
            assert first.timeout.read == 5 and gw._slots is not None
            tctx.configure(gw, polar_backend_timeout=7, polar_max_concurrency=0)
            second = gw._http()
            assert second is not first and second.timeout.read == 7 and gw._slots is None
            assert gw.overrides == {"temperature": 1.0}
            tctx.configure(gw, polar_sampling="max_tokens=64")
            assert gw.overrides == {"max_tokens": 64}
            gw.done()
            assert gw.client is None
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
    run(main())


def test_server_connections_are_never_opened():
    async def main():
        gw = PolarGateway()
        with taddons.context(gw):
            f = tflow.tflow()
            from mitmproxy.proxy import server_hooks
            data = server_hooks.ServerConnectionHookData(server=f.server_conn, client=f.client_conn)
            gw.server_connect(data)
            assert data.server.error
    run(main())


def test_local_answers_and_health(tmp_path):
    async def main():
        gw = PolarGateway()
        with taddons.context(gw) as tctx:
            tctx.configure(gw, polar_db=str(tmp_path / "a.duckdb"))
            health = tflow.tflow()
            health.request.method, health.request.path = "GET", "/_polar/health"
            await gw.request(health)
            assert health.response.status_code == 200 and b'"polar":"ok"' in health.response.content
            telemetry = tflow.tflow()
            telemetry.request.method, telemetry.request.path = "POST", "/api/event_logging/batch"
            telemetry.request.content = b'{"events": []}'
            await gw.request(telemetry)
            assert telemetry.response.status_code == 204
            gw.done()
    run(main())
