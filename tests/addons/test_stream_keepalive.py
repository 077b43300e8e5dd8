"""A streaming client is kept alive while the backend generates: past polar_stream_keepalive
seconds its SSE headers go out, then a keepalive comment each interval, then the answer. The
official SDKs read such a stream as usual, the call is recorded once, an error after the
headers becomes an SSE error event, and quick or non-streaming calls are answered whole."""

from __future__ import annotations

import ssl
import time

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from support.fake_vllm import FakeVLLM
from polar_mitm.store import query

DELAY, KEEPALIVE = 2.5, 0.5
MSG = [{"role": "user", "content": "hi"}]


def stream_timeline(proxy, user: str, body: dict, path: str = "/v1/chat/completions", headers=None):
    """(seconds to the headers, [(seconds, chunk)]) of a streaming call in regular mode."""
    t0 = time.monotonic()
    chunks = []
    ca = ssl.create_default_context(cafile=proxy.ca)
    with httpx.Client(proxy=proxy.proxy_url(user), verify=ca, trust_env=False, timeout=60) as c:
        with c.stream("POST", f"https://api.openai.com{path}", json=body,
                      headers={"authorization": "Bearer x", **(headers or {})}) as r:
            head = time.monotonic() - t0
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for chunk in r.iter_raw():
                chunks.append((time.monotonic() - t0, chunk))
    return head, chunks


def test_a_long_generation_gets_headers_then_keepalives_then_the_answer(start_proxy):
    with FakeVLLM(delay=DELAY) as fake:
        proxy = start_proxy(fake.url, extra_sets=[f"polar_stream_keepalive={KEEPALIVE}"])
        head, chunks = stream_timeline(proxy, "ka~1", {"model": "m", "messages": MSG, "stream": True})
    assert head < DELAY - 1.0, f"headers came after {head:.2f}s"
    body = b"".join(c for _, c in chunks)
    keepalives = [t for t, c in chunks if c.startswith(b": keepalive")]
    assert len(keepalives) >= 2 and keepalives[0] < DELAY - 0.5, chunks
    assert body.count(b": keepalive\n\n") >= 2
    answer = body.replace(b": keepalive\n\n", b"")
    assert b'"content":"ok"' in answer and answer.rstrip().endswith(b"data: [DONE]")
    _, rows = query(proxy.db, "SELECT session_id, status_code, stream, error FROM call_records")
    assert rows == [("ka~1", 200, True, None)]


def test_the_sdks_read_a_kept_alive_stream(start_proxy, monkeypatch):
    with FakeVLLM(delay=DELAY) as fake:
        proxy = start_proxy(fake.url, extra_sets=[f"polar_stream_keepalive={KEEPALIVE}"])
        monkeypatch.setenv("SSL_CERT_FILE", proxy.ca)
        monkeypatch.setenv("NO_PROXY", "")
        monkeypatch.setenv("HTTPS_PROXY", proxy.proxy_url("ka~sdk"))
        oa = openai.OpenAI(api_key="x", max_retries=0, timeout=60)
        text = "".join(ev.choices[0].delta.content or "" for ev in
                       oa.chat.completions.create(model="m", messages=MSG, stream=True) if ev.choices)
        assert text == "ok"
        events = [e.type for e in oa.responses.create(model="m", input="hi", stream=True)]
        assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
        assert events.count("response.created") == 1 and "response.in_progress" in events[2:-1]  # the ticks
        with oa.responses.stream(model="m", input="hi") as s:
            assert s.get_final_response().output_text == "ok"
        an = anthropic.Anthropic(api_key="x", max_retries=0, timeout=60)
        with an.messages.stream(model="m", max_tokens=16, messages=MSG) as s:
            assert s.get_final_text() == "ok"
        gg = genai.Client(api_key="x", http_options=types.HttpOptions(
            retry_options=types.HttpRetryOptions(attempts=1),
            client_args={"verify": ssl.create_default_context(cafile=proxy.ca)}))
        text = "".join(c.text or "" for c in gg.models.generate_content_stream(model="m", contents="hi"))
        assert text == "ok"
        # base-URL (reverse) mode too
        monkeypatch.delenv("HTTPS_PROXY")
        an2 = anthropic.Anthropic(api_key="polar-ka~rev", base_url=proxy.base_url, max_retries=0, timeout=60)
        with an2.messages.stream(model="m", max_tokens=16, messages=MSG) as s:
            assert s.get_final_text() == "ok"
    _, rows = query(proxy.db, "SELECT session_id, status_code FROM call_records ORDER BY created_at")
    assert rows == [("ka~sdk", 200)] * 5 + [("ka~rev", 200)]


def test_an_error_after_the_headers_is_an_sse_error_event(start_proxy):
    with FakeVLLM(mode="500", delay=DELAY) as fake:
        proxy = start_proxy(fake.url, extra_sets=[f"polar_stream_keepalive={KEEPALIVE}"])
        _, chunks = stream_timeline(proxy, "ka~err", {"model": "m", "max_tokens": 8, "messages": MSG, "stream": True},
                                    path="/v1/messages", headers={"anthropic-version": "2023-06-01"})
        an = anthropic.Anthropic(api_key="polar-ka~err2", base_url=proxy.base_url, max_retries=0, timeout=60)
        with pytest.raises(anthropic.APIError):
            with an.messages.stream(model="m", max_tokens=16, messages=MSG) as s:
                s.get_final_text()
    body = b"".join(c for _, c in chunks)
    assert body.startswith(b": keepalive") and b"event: error\ndata: " in body
    assert b'"type":"error"' in body     # the provider's own error shape, after the 200
    _, rows = query(proxy.db, "SELECT session_id, status_code, error_kind FROM call_records ORDER BY session_id")
    assert [r[0] for r in rows] == ["ka~err", "ka~err2"] and all(r[1] >= 500 for r in rows)


def test_quick_and_non_streaming_calls_are_answered_whole(start_proxy, tmp_path):
    with FakeVLLM(delay=0.0) as fake:
        proxy = start_proxy(fake.url, extra_sets=[f"polar_stream_keepalive={KEEPALIVE}"])
        _, chunks = stream_timeline(proxy, "ka~quick", {"model": "m", "messages": MSG, "stream": True})
        assert not any(c.startswith(b": keepalive") for _, c in chunks)
    with FakeVLLM(delay=1.5) as fake:
        (tmp_path / "slow").mkdir()
        proxy = start_proxy(fake.url, extra_sets=[f"polar_stream_keepalive={KEEPALIVE}"], root=tmp_path / "slow")
        r = httpx.post(proxy.base_url + "/v1/chat/completions", json={"model": "m", "messages": MSG},
                       headers={"authorization": "Bearer polar-ka~whole"}, trust_env=False, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
        assert "content-length" in r.headers
