"""Keepalive for long generations. mitmproxy sends an answer made in a `request` hook only
once it is whole, so a streaming call whose backend is still generating after
polar_stream_keepalive seconds is handed to this loopback relay instead: mitmproxy connects
to it (the one server connection the backstop allows) and streams what it sends. The relay
sends the SSE headers at once, then a keepalive each interval in the client's provider's
shape (adapters.stream_keepalive: comment lines; blank lines for Google; for OpenAI
Responses, response.created and repeated response.in_progress events, since Codex's idle
timer counts events), and then the answer, whose recording is unchanged. An answer that
turns out to be an error goes out as an SSE `error` event, since the 200 is already sent.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

from mitmproxy import http

from polar_mitm.adapters.chat import StreamKeepalive

log = logging.getLogger("polar")

META = "polar_relay"


@dataclass
class Job:
    answer: asyncio.Future          # -> (status, content, headers)
    content_type: str
    interval: float
    head: bytes                     # sent with the headers
    tick: bytes                     # sent each interval
    skip_events: int                # leading SSE events of the answer the head stood for


class StreamRelay:
    def __init__(self):
        self.address: tuple[str, int] | None = None
        self._server: asyncio.Server | None = None
        self._jobs: dict[str, Job] = {}
        self.handed_over = 0

    def addresses(self) -> tuple:
        return (self.address,) if self.address else ()

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.address = self._server.sockets[0].getsockname()[:2]

    def close(self) -> None:
        server, self._server, self.address = self._server, None, None
        if server is not None:
            server.close()

    def hand_over(self, flow: http.HTTPFlow, answer: asyncio.Future, content_type: str, interval: float,
                  keepalive: StreamKeepalive) -> None:
        """Send this flow to the relay; the client gets headers now and the answer later.
        keepalive: (head, tick, skip_events) in the client's provider's shape
        (adapters.stream_keepalive)."""
        if self.address is None:
            raise RuntimeError("the stream relay is not running")
        token = secrets.token_urlsafe(18)
        self._jobs[token] = Job(answer, content_type, interval, *keepalive)
        # A client gone before mitmproxy reached the relay leaves the job behind: drop it later.
        loop = asyncio.get_running_loop()
        answer.add_done_callback(lambda _: loop.call_later(120, self._jobs.pop, token, None))
        req = flow.request
        flow.metadata[META] = (req.scheme, req.host, req.port, req.path, req.method)
        host, port = self.address
        req.scheme, req.host, req.port, req.method, req.path = "http", host, port, "GET", f"/{token}"
        req.content = b""
        self.handed_over += 1

    @staticmethod
    def responseheaders(flow: http.HTTPFlow) -> None:
        if META in flow.metadata and flow.response is not None:
            flow.response.stream = True
            # The log and any flow view show what the harness asked for, not the relay.
            req = flow.request
            req.scheme, req.host, req.port, req.path, req.method = flow.metadata[META]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            token = head.split(b" ", 2)[1].decode().lstrip("/")
            job = self._jobs.pop(token, None)
            if job is None:
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + job.content_type.encode() +
                         b"\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            if job.head:
                writer.write(_chunk(job.head))
            await writer.drain()
            while True:
                done, _ = await asyncio.wait({job.answer}, timeout=job.interval)
                if done:
                    break
                writer.write(_chunk(job.tick))
                await writer.drain()
            status, content, _headers = job.answer.result()
            if status == 200:
                content = _without_events(content, job.skip_events)
            elif job.content_type == "text/event-stream":
                content = b"event: error\ndata: " + content + b"\n\n"
            writer.write(_chunk(content))
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                IndexError, UnicodeDecodeError) as e:
            log.info("polar: relay connection ended early: %s", e)   # the call is recorded all the same
        finally:
            writer.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _without_events(sse: bytes, n: int) -> bytes:
    """The SSE text after its first n events (events end with a blank line)."""
    at = 0
    for _ in range(n):
        end = sse.find(b"\n\n", at)
        if end < 0:
            return sse
        at = end + 2
    return sse[at:]

