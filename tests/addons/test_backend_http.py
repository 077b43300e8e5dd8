"""The backend client's HTTP/1.1 framing and connection reuse, against raw asyncio servers."""

import asyncio

import pytest

from polar_mitm.addons.backend_http import BackendHTTP, HTTPError, HTTPTimeout


async def serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def read_request(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


def run(coro):
    return asyncio.run(coro)


def test_content_length_chunked_and_keepalive_reuse():
    seen = []

    async def handler(reader, writer):
        while True:
            try:
                head, body = await read_request(reader)
            except asyncio.IncompleteReadError:
                break
            seen.append((head.split(b"\r\n")[0], body))
            if b"/chunked" in head:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nX-A: 1\r\n\r\n"
                             b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def main():
        server, port = await serve(handler)
        client = BackendHTTP(f"http://127.0.0.1:{port}/prefix", timeout=5)
        big = b"x" * 3_000_000
        r = await client.request("POST", "/echo", big, {"content-type": "application/json"})
        assert (r.status, r.content) == (201, big)
        r = await client.request("GET", "/chunked")
        assert (r.status, r.content, r.headers["x-a"]) == (200, b"hello world", "1")
        assert client.opened == 1            # one kept-alive connection for both
        assert seen[0][0] == b"POST /prefix/echo HTTP/1.1" and seen[1][0] == b"GET /prefix/chunked HTTP/1.1"
        await client.aclose()
        server.close()
    run(main())


def test_a_closed_kept_alive_connection_is_retried_once_on_a_fresh_one():
    count = {"requests": 0}

    async def handler(reader, writer):
        await read_request(reader)
        count["requests"] += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()            # without saying connection: close

    async def main():
        server, port = await serve(handler)
        client = BackendHTTP(f"http://127.0.0.1:{port}", timeout=5)
        for _ in range(3):
            r = await client.request("POST", "/v1/chat/completions", b"{}")
            assert r.content == b"ok"
            await asyncio.sleep(0.05)
        assert count["requests"] == 3 and client.opened == 3
        await client.aclose()
        server.close()
    run(main())


def answer_and_close(raw: bytes):
    """A server that reads one request, writes `raw` and closes the connection."""
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(raw)
        await writer.drain()
        writer.close()
    return handler


def test_connection_close_and_read_until_eof():
    async def main():
        server, port = await serve(answer_and_close(b"HTTP/1.0 200 OK\r\n\r\nuntil the end"))
        client = BackendHTTP(f"http://127.0.0.1:{port}", timeout=5)
        r = await client.request("GET", "/x")
        assert r.content == b"until the end" and not client._idle
        server.close()
    run(main())


def test_errors_and_timeouts_are_typed():
    async def silent(reader, writer):
        await asyncio.sleep(10)

    broken = answer_and_close(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
    garbage = answer_and_close(b"SSH-2.0-OpenSSH\r\n\r\n")

    async def main():
        server, port = await serve(silent)
        with pytest.raises(HTTPTimeout):
            await BackendHTTP(f"http://127.0.0.1:{port}", timeout=0.3).request("GET", "/")
        server.close()
        for handler in (broken, garbage):
            server, port = await serve(handler)
            with pytest.raises(HTTPError):
                await BackendHTTP(f"http://127.0.0.1:{port}", timeout=5).request("GET", "/")
            server.close()
        server, port = await serve(silent)
        server.close()
        await server.wait_closed()
        with pytest.raises(HTTPError):   # nothing listens
            await BackendHTTP(f"http://127.0.0.1:{port}", timeout=5).request("GET", "/")
        with pytest.raises(ValueError):
            BackendHTTP("ftp://x", timeout=1)
    run(main())
