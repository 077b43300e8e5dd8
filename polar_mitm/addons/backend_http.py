"""A small HTTP/1.1 client for the model backend, on asyncio streams.

The backend is one trusted server (vLLM) on a fast link, asked for large JSON bodies a few
hundred times a second. A general client (httpx) spent about 3 ms of the event loop's CPU
on each call (its layers, tracing, anyio); this one sends the request in one write and
reads the answer with Content-Length or chunked framing, over a pool of keep-alive
connections. A reused connection that the server closed meanwhile is retried once on a
fresh one, only when no byte of an answer came back (the server saw no request)."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
READ_BUFFER = 1 << 20   # answers of a few hundred KB arrive without pausing the socket


class HTTPError(Exception):
    """The backend could not be reached, or broke the connection mid-answer."""


class HTTPTimeout(HTTPError):
    pass


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]   # names lower-cased
    content: bytes


class _Stale(Exception):
    """A kept-alive connection was closed by the server before it answered."""


class BackendHTTP:
    def __init__(self, base_url: str, *, timeout: float, connect_timeout: float = 10.0,
                 max_idle: int = 32):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        default_port = self.port == (443 if self.ssl else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.opened = 0           # connections made, for tests and health
        self.closed = False

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None, timeout: float | None = None) -> Response:
        head = [f"{method} {self.prefix}{path} HTTP/1.1", f"host: {self.host_header}"]
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v}")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"content-length: {len(body or b'')}")
        # head and body go out as two writes: a 200 KB body is not copied to join them
        message = (("\r\n".join(head) + "\r\n\r\n").encode("latin-1"), body or b"")
        try:
            async with asyncio.timeout(timeout or self.timeout):
                for attempt in range(2):
                    conn, reused = await self._acquire()
                    try:
                        return await self._exchange(conn, message, method, reused)
                    except _Stale:
                        continue   # the server had closed it; it never saw this request
                raise HTTPError("the backend closed kept-alive connections twice")
        except TimeoutError:
            raise HTTPTimeout(f"no answer within {timeout or self.timeout}s") from None
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            raise HTTPError(f"{type(e).__name__}: {e}") from None

    async def _acquire(self) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], bool]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return (reader, writer), True
            writer.close()
        async with asyncio.timeout(self.connect_timeout):
            conn = await asyncio.open_connection(self.host, self.port, ssl=self.ssl,
                                                 limit=READ_BUFFER)
        self.opened += 1
        return conn, False

    async def _exchange(self, conn, message: tuple[bytes, bytes], method: str, reused: bool) -> Response:
        reader, writer = conn
        keep = False
        try:
            writer.write(message[0])
            if message[1]:
                writer.write(message[1])
            try:
                line = await reader.readuntil(b"\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                if reused and not getattr(e, "partial", b""):
                    raise _Stale() from None
                raise
            version, status, _ = _status_line(line)
            headers = await _read_headers(reader)
            if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                content = b""
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                content = await _read_chunked(reader)
            elif "content-length" in headers:
                content = await reader.readexactly(int(headers["content-length"]))
            else:   # the answer ends when the server closes the connection
                content = await reader.read(-1)
                headers["connection"] = "close"
            connection = headers.get("connection", "").lower()
            keep = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
            return Response(status, headers, content)
        finally:
            if keep and not self.closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
            else:
                writer.close()

    async def aclose(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()


def _status_line(line: bytes) -> tuple[str, int, str]:
    parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP status line: {line[:80]!r}")
    return parts[0], int(parts[1]), parts[2] if len(parts) > 2 else ""


async def _read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    headers: dict[str, str] = {}
    size = 0
    while (raw := await reader.readuntil(b"\r\n")) != b"\r\n":
        size += len(raw)
        if size > MAX_HEAD_BYTES:
            raise ValueError("the answer's header is too large")
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep:
            raise ValueError(f"malformed header line: {raw[:80]!r}")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":   # trailers
                pass
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)
