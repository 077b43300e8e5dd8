"""Upstream failures reach the harness in its own provider's error shape, and are
recorded as failed calls. The backend here is down, slow, broken or a small stand-in.

The gateway runs in-process here (tests/support/inprocess_proxy.py: mitmproxy's proxy server, the
addon and mitmdump's log, in a thread): the SDKs still reach it over sockets. The launcher's
test starts a real mitmdump."""

import functools
import gzip
import re
import socket
import time
import zlib
from pathlib import Path

import anthropic
import httpx
import orjson
import zstandard
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors, types

from support.fake_vllm import FakeVLLM
from polar_mitm.stack import launch
from polar_mitm.store import query

MSG = [{"role": "user", "content": "hi"}]


def clients(proxy):
    return (openai.OpenAI(base_url=proxy.base_url + "/v1", api_key="polar-fail~1", max_retries=0, timeout=30),
            anthropic.Anthropic(base_url=proxy.base_url, api_key="polar-fail~2", max_retries=0, timeout=30),
            genai.Client(api_key="polar-fail~3", http_options=types.HttpOptions(
                base_url=proxy.base_url, retry_options=types.HttpRetryOptions(attempts=1))))


def call_all(proxy):
    oa, an, gg = clients(proxy)
    errors = {}
    with pytest.raises(openai.APIStatusError) as e:
        oa.chat.completions.create(model="m", messages=MSG)
    errors["openai_chat"] = e.value
    with pytest.raises(openai.APIStatusError) as e:
        oa.responses.create(model="m", input="hi", stream=True)
    errors["openai_responses"] = e.value
    with pytest.raises(anthropic.APIStatusError) as e:
        an.messages.create(model="claude", max_tokens=5, messages=MSG)
    errors["anthropic"] = e.value
    with pytest.raises(genai_errors.APIError) as e:
        gg.models.generate_content(model="gemini-2.5-flash", contents="hi")
    errors["google"] = e.value
    return errors


def failed_rows(proxy):
    return query(proxy.db, "SELECT style, status_code, error_kind, error FROM calls ORDER BY style")[1]


def test_backend_down(start_inprocess_proxy):
    dead = f"http://127.0.0.1:{launch.free_port()}"   # nothing listens there
    proxy = start_inprocess_proxy(dead, ["polar_served_model=m"])
    errors = call_all(proxy)
    assert errors["openai_chat"].status_code == 503 and errors["openai_chat"].body["type"] == "server_error"
    assert errors["openai_responses"].status_code == 503
    assert errors["anthropic"].status_code == 529
    assert errors["anthropic"].body["error"]["type"] == "overloaded_error"
    assert errors["google"].code == 503 and errors["google"].status == "UNAVAILABLE"
    rows = failed_rows(proxy)
    assert [r[0] for r in rows] == ["anthropic", "google", "openai_chat", "openai_responses"]
    assert all(r[2] == "overloaded" and "unavailable" in r[3] for r in rows)


def test_backend_timeout(start_inprocess_proxy):
    with FakeVLLM(delay=3) as fake:
        proxy = start_inprocess_proxy(fake.url, ["polar_backend_timeout=1"])
        errors = call_all(proxy)
    assert errors["openai_chat"].status_code == 504
    assert errors["anthropic"].status_code == 504 and errors["anthropic"].body["error"]["type"] == "timeout_error"
    assert errors["google"].code == 504 and errors["google"].status == "DEADLINE_EXCEEDED"
    assert {r[2] for r in failed_rows(proxy)} == {"timeout"}


@pytest.mark.parametrize("mode,status,kind", [("500", 502, "backend_error"),
                                               ("badjson", 502, "backend_error"),
                                               ("odd", 502, "backend_error"),  # message: null
                                               ("context", 400, "context_too_long")])
def test_backend_errors(start_inprocess_proxy, mode, status, kind):
    with FakeVLLM(mode) as fake:
        proxy = start_inprocess_proxy(fake.url)
        errors = call_all(proxy)
    assert errors["openai_chat"].status_code == status
    assert errors["anthropic"].status_code == status
    assert errors["google"].code == status
    for e in errors.values():  # the backend's fault, said without Python's words
        text = e.response.text
        assert "NoneType" not in text and "Traceback" not in text and "attribute" not in text
    if kind == "context_too_long":
        assert errors["openai_chat"].body["code"] == "context_length_exceeded"
        assert errors["anthropic"].body["error"]["type"] == "invalid_request_error"
        assert "maximum context length" in errors["anthropic"].body["error"]["message"]
    assert {r[2] for r in failed_rows(proxy)} == {kind}


def test_malformed_request_is_provider_400_and_recorded(start_inprocess_proxy):
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url)
        r = httpx.post(proxy.base_url + "/v1/messages", content=b"{not json", trust_env=False,
                       headers={"x-api-key": "polar-bad~1", "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = httpx.post(proxy.base_url + "/v1/chat/completions", json={"model": "m", "messages": "hi"},
                       headers={"authorization": "Bearer polar-bad~2"}, trust_env=False)
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        assert fake.bodies == []  # nothing reached the backend
    rows = query(proxy.db, "SELECT session_id, status_code, error_kind, request_text FROM calls ORDER BY session_id")[1]
    assert [(r[0], r[1], r[2]) for r in rows] == [("bad~1", 400, "invalid_request"), ("bad~2", 400, "invalid_request")]
    assert rows[0][3] == '{not json'  # the raw body is kept


def test_non_model_traffic_answered_locally(start_inprocess_proxy):
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url)
        h = dict(trust_env=False, timeout=10)
        assert httpx.post(proxy.base_url + "/api/event_logging/v2/batch", json={"e": 1}, **h).status_code == 204
        assert httpx.get(proxy.base_url + "/api/claude_code/policy_limits", **h).status_code == 404
        assert httpx.head(proxy.base_url + "/", **h).status_code == 200
        models = httpx.get(proxy.base_url + "/v1/models", **h).json()
        assert models["data"][0]["id"] == "fake-model"
        ws = httpx.get(proxy.base_url + "/v1/responses", headers={"upgrade": "websocket", "connection": "upgrade"}, **h)
        assert ws.status_code == 404
        assert fake.bodies == []
    assert query(proxy.db, "SELECT count(*) FROM calls")[1] == [(0,)]


def test_calls_run_concurrently(start_inprocess_proxy):
    """Hooks await the backend and the writer: slow calls overlap instead of queueing."""
    import threading
    import time

    with FakeVLLM(delay=1.0) as fake:
        proxy = start_inprocess_proxy(fake.url)
        oa = openai.OpenAI(base_url=proxy.base_url + "/v1", api_key="polar-par~1", max_retries=0)
        t0 = time.monotonic()
        threads = [threading.Thread(target=oa.chat.completions.create,
                                    kwargs={"model": "m", "messages": MSG}) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
    assert elapsed < 3.0, elapsed  # four 1 s backend calls, served side by side
    assert query(proxy.db, "SELECT count(*), count(DISTINCT seq) FROM calls")[1] == [(4, 4)]


def test_sampling_overrides_and_model_hosts(start_inprocess_proxy):
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url, ["polar_sampling=temperature=1.0,max_tokens=5,top_p=1"])
        oa = openai.OpenAI(base_url=proxy.base_url + "/v1", api_key="polar-s~1", max_retries=0)
        oa.chat.completions.create(model="m", messages=MSG, max_tokens=100, temperature=0.2)
        oa.chat.completions.create(model="m", messages=MSG, max_tokens=3)
        first, second = fake.bodies
        assert (first["temperature"], first["top_p"], first["max_tokens"]) == (1.0, 1, 5)
        assert second["max_tokens"] == 3  # a cap, never a raise
        assert first["return_token_ids"] is True and first["logprobs"] is True and first["stream"] is False
    with FakeVLLM() as fake:
        other = start_inprocess_proxy(fake.url, [r"polar_model_hosts=^api\.anthropic\.com$"], root=proxy.db.parent / "h")
        r = httpx.post(other.base_url + "/v1/chat/completions", json={"model": "m", "messages": MSG},
                       trust_env=False)
        assert r.status_code == 204 and fake.bodies == []  # 127.0.0.1 is not a model host here
    with FakeVLLM() as fake:
        only = start_inprocess_proxy(fake.url, [r"polar_model_paths=^/v1/messages$"], root=proxy.db.parent / "p")
        r = httpx.post(only.base_url + "/v1/chat/completions", json={"model": "m", "messages": MSG},
                       trust_env=False)
        assert r.status_code == 204 and fake.bodies == []
        r = httpx.post(only.base_url + "/v1/messages?beta=true", trust_env=False,
                       json={"model": "m", "max_tokens": 5, "messages": MSG})
        assert r.status_code == 200 and len(fake.bodies) == 1


def test_launcher_refuses_a_proxy_whose_addon_did_not_load(tmp_path):
    """A mitmdump without a working addon would forward harness traffic to the real hosts."""
    with pytest.raises(RuntimeError, match="polar addon is not answering|exited early"):
        started = launch.start_proxy(db=tmp_path / "x.duckdb", backend="http://127.0.0.1:1",
                                     port=launch.free_port(), confdir=tmp_path / "conf",
                                     log_path=tmp_path / "log", extra_sets=["polar_backend_timeout=0"])
        started.stop()  # not reached when the launcher refuses, as it must


def test_max_tokens_capped_at_the_backend_context(start_inprocess_proxy):
    """Claude Code asks for max_tokens=64000; vLLM refuses any max_tokens above its context
    length (it clamps smaller ones to what is left), so the proxy caps at the listed one."""
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url)
        an = anthropic.Anthropic(api_key="polar-cap~1", base_url=proxy.base_url, max_retries=0, timeout=30)
        an.messages.create(model="claude-opus-4-8", max_tokens=64000, messages=MSG)
        an.messages.create(model="claude-opus-4-8", max_tokens=100, messages=MSG)
        prompt = fake.prompt_tokens(fake.bodies[0]["messages"])
        assert [b["max_tokens"] for b in fake.bodies] == [4096 - prompt, 100]


def test_max_tokens_leaves_room_for_a_long_prompt(start_inprocess_proxy):
    """Claude Code's 64000 on a prompt that fills most of the context: capped at what the
    context leaves after the prompt (vLLM refuses prompt + max_tokens above its length)."""
    long = [{"role": "user", "content": "fix the failing test " * 600}]   # ~3000 of 4096 tokens
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url)
        an = anthropic.Anthropic(api_key="polar-long~1", base_url=proxy.base_url, max_retries=0, timeout=30)
        r = an.messages.create(model="claude-opus-4-8", max_tokens=64000, messages=long)
        assert r.content[0].text == "ok"
        prompt = fake.prompt_tokens(fake.bodies[0]["messages"])
        assert prompt > 2500 and fake.bodies[0]["max_tokens"] == 4096 - prompt
        assert len(fake.tokenized) == 1
    assert query(proxy.db, "SELECT status_code FROM calls")[1] == [(200,)]


def test_max_tokens_needs_no_count_when_it_fits(start_inprocess_proxy):
    """A request whose bytes and max_tokens fit the context costs no /tokenize round trip."""
    with FakeVLLM(max_model_len=32768) as fake:
        proxy = start_inprocess_proxy(fake.url)
        oa = openai.OpenAI(base_url=proxy.base_url + "/v1", api_key="polar-fit~1", max_retries=0)
        oa.chat.completions.create(model="m", messages=MSG, max_tokens=1000)
        assert fake.bodies[0]["max_tokens"] == 1000 and fake.tokenized == []


def test_stream_options_not_an_object_is_a_400(start_inprocess_proxy):
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url)
        r = httpx.post(proxy.base_url + "/v1/chat/completions", trust_env=False, timeout=30,
                       headers={"authorization": "Bearer polar-so~1"},
                       json={"model": "m", "messages": MSG, "stream": True, "stream_options": "yes"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "stream_options" in r.json()["error"]["message"] and fake.bodies == []
    assert query(proxy.db, "SELECT status_code, error_kind FROM calls")[1] == [(400, "invalid_request")]


@functools.cache
def bomb(coding: str, size: int = 200 << 20) -> bytes:
    """size bytes of zeros, compressed a MiB at a time (about 200 KB for gzip)."""
    zero = bytes(1 << 20)
    if coding == "zstd":
        c = zstandard.ZstdCompressor().compressobj()
        return b"".join(c.compress(zero) for _ in range(size >> 20)) + c.flush()
    c = zlib.compressobj(6, zlib.DEFLATED, 31 if coding == "gzip" else 15)
    return b"".join(c.compress(zero) for _ in range(size >> 20)) + c.flush()


def peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) / 1024


def reset_peak_rss(pid: int) -> None:
    """The peak starts again from what the process holds now (the proxy runs in this
    process: its peak so far is other tests')."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


@pytest.mark.parametrize("coding", ["gzip", "deflate", "zstd"])
def test_compressed_bomb_is_a_413_in_bounded_memory(start_inprocess_proxy, coding):
    """200 MB of zeros in a few hundred KB: decompressed a piece at a time, up to
    polar_max_body, never whole."""
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url, ["polar_max_body=8m"])
        pid = proxy.pid
        bomb(coding)                 # made (and cached) before the peak is taken
        reset_peak_rss(pid)
        before = peak_rss_mb(pid)
        t0 = time.monotonic()
        r = httpx.post(proxy.base_url + "/v1/messages", content=bomb(coding), trust_env=False, timeout=60,
                       headers={"x-api-key": "polar-bomb~1", "anthropic-version": "2023-06-01",
                                "content-type": "application/json", "content-encoding": coding})
        elapsed = time.monotonic() - t0
        grew = peak_rss_mb(pid) - before
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        assert elapsed < 5, elapsed
        assert grew < 100, f"mitmdump's peak memory grew {grew:.0f} MB"
        assert fake.bodies == []
    rows = query(proxy.db, "SELECT session_id, status_code, error_kind, request_text FROM calls")[1]
    assert [r[:3] for r in rows] == [("bomb~1", 413, "too_large")]
    assert rows[0][3].startswith('<request body not kept')   # the bomb itself is not stored


def test_compressed_request_within_the_limit_is_served(start_inprocess_proxy):
    body = orjson.dumps({"model": "m", "messages": MSG})
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url, ["polar_max_body=8m"])
        for coding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                             ("zstd", zstandard.ZstdCompressor().compress(body))):
            r = httpx.post(proxy.base_url + "/v1/chat/completions", content=data, trust_env=False,
                           headers={"authorization": "Bearer polar-z~1", "content-type": "application/json",
                                    "content-encoding": coding}, timeout=30)
            assert r.status_code == 200, (coding, r.text)
        assert len(fake.bodies) == 3 and fake.bodies[0]["messages"] == MSG


def test_body_over_the_limit_is_not_read_and_is_recorded(start_inprocess_proxy):
    """A raw body over polar_max_body: mitmproxy's body_size_limit stops reading it (its own
    413); the call is still recorded as failed."""
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url, ["polar_max_body=1m"])
        s = socket.create_connection(("127.0.0.1", proxy.reverse_port), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer polar-big~1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 209715200\r\n\r\n" + b"[" * 65536)
        answer = s.recv(4096)
        s.close()
        assert answer.startswith(b"HTTP/1.1 413")
        assert fake.bodies == []
    rows = query(proxy.db, "SELECT session_id, status_code, error_kind FROM calls")[1]
    assert rows == [("big~1", 413, "too_large")]


def test_max_body_is_validated():
    from mitmproxy import exceptions
    from mitmproxy.addons.proxyserver import Proxyserver
    from mitmproxy.test import taddons

    from polar_mitm.addons.gateway import PolarGateway

    gw = PolarGateway()
    with taddons.context(Proxyserver(), gw) as tctx:
        tctx.configure(gw, polar_max_body="2m")
        assert gw.model_calls.max_body == 2 << 20 and tctx.options.body_size_limit == str(2 << 20)
        with pytest.raises(exceptions.OptionsError, match="polar_max_body"):
            tctx.configure(gw, polar_max_body="lots")


def test_a_deep_body_is_a_400_and_fails_no_other_call(start_inprocess_proxy):
    """A body nested 300 levels deep (orjson writes 254) used to kill the writer thread,
    fail the other sessions' calls of its batch with 503, and get a retryable 503 itself."""
    import concurrent.futures

    deep = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 300 + b"]" * 300 + b"}]}"
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url)

        def send(i):
            body = orjson.dumps({"model": "m", "messages": MSG}) if i != 3 else deep
            return httpx.post(proxy.base_url + "/v1/chat/completions", content=body,
                              headers={"authorization": f"Bearer polar-deep~{i}",
                                       "content-type": "application/json"},
                              trust_env=False, timeout=30).status_code

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(send, range(48)))
        assert statuses[3] == 400 and statuses.count(200) == 47
        assert send(99) == 200                         # the writer is alive
    rows = query(proxy.db, "SELECT session_id, status_code, length(request_text) FROM calls")[1]
    assert len(rows) == 49
    assert {r[1] for r in rows if r[0] == "deep~3"} == {400}
    assert [r[2] for r in rows if r[0] == "deep~3"][0] > 300   # its body is kept as sent


def test_a_query_key_never_reaches_the_log(start_inprocess_proxy):
    """mitmdump prints every flow's URL: Google's ?key= used to show there."""
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url)
        r = httpx.post(proxy.base_url + "/v1beta/models/gemini-2.5-flash:generateContent?key=polar-logkey~1&alt=json",
                       json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
                       trust_env=False, timeout=30)
        assert r.status_code == 200, r.text
        httpx.get(proxy.base_url + "/v1beta/models?key=sk-secretvalue", trust_env=False, timeout=30)
    proxy.stop()
    log_text = Path(proxy.log).read_text()
    assert "gemini-2.5-flash" in log_text and "/v1beta/models" in log_text   # flows are logged
    assert "logkey" not in log_text and "polar-lo" not in log_text and "sk-secr" not in log_text
    assert query(proxy.db, "SELECT session_id, path FROM calls")[1] == [
        ("logkey~1", "/v1beta/models/gemini-2.5-flash:generateContent?alt=json")]


def test_a_rejected_huge_body_barely_grows_the_database(start_inprocess_proxy):
    """A rejected 20 MB request used to add 46 MB to the file."""
    with FakeVLLM() as fake:
        proxy = start_inprocess_proxy(fake.url)
        h = {"authorization": "Bearer polar-huge~1", "content-type": "application/json"}
        url = proxy.base_url + "/v1/chat/completions"
        assert httpx.post(url, json={"model": "m", "messages": MSG}, headers=h, trust_env=False).status_code == 200
        query(proxy.db, "SELECT 1")   # loaded and checkpointed
        before = sum(p.stat().st_size for p in proxy.db.parent.glob(proxy.db.name + "*") if p.is_file())
        huge = orjson.dumps({"model": "m", "messages": "x" * (20 << 20)})
        r = httpx.post(url, content=huge, headers=h, trust_env=False, timeout=60)
        assert r.status_code == 400
        assert query(proxy.db, "SELECT count(*), max(length(request_text)) FROM calls")[1][0][1] < 1.1 * (1 << 20)
        after = sum(p.stat().st_size for p in proxy.db.parent.glob(proxy.db.name + "*") if p.is_file())
    assert after - before < 4 << 20, f"the file grew {(after - before) >> 20} MB"
