"""Request bodies as the proxy reads them: bounded decompression, depth checks, and what a
rejected call keeps. Pure functions over mitmproxy requests."""

from __future__ import annotations

import io
import zlib

import orjson
import zstandard
from mitmproxy import http

from polar_mitm.adapters.chat import AdapterError


class BodyTooLarge(AdapterError):
    status, kind = 413, "too_large"


def has_image(body: dict) -> bool:
    return any(isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in body["messages"])


def header_dict(req: http.Request) -> dict[str, str]:
    """The request's headers, names lowercased, a repeated one joined as mitmproxy joins it.
    dict(req.headers) scans every field once per name: ~100 us a request, this ~7."""
    out: dict[str, str] = {}
    for raw_name, raw_value in req.headers.fields:
        name = raw_name.decode("utf-8", "surrogateescape").lower()
        value = raw_value.decode("utf-8", "surrogateescape")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def is_websocket(req: http.Request) -> bool:
    return req.headers.get("upgrade", "").lower() == "websocket"


MAX_BODY_DEPTH = 200    # orjson writes 254 levels at most; no real request comes near
_ORJSON_MAX_DEPTH = 255  # the first level orjson.dumps refuses


def depth_ok(value, limit: int = MAX_BODY_DEPTH) -> bool:
    """Whether no list or object lies more than `limit` levels deep (the value itself is
    level 1). orjson counts the levels in C: wrapped in enough lists, the value is refused
    exactly when it is too deep; a third of the time of a walk in Python on a 200 KB body."""
    wrapped = value
    for _ in range(_ORJSON_MAX_DEPTH - 1 - limit):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        return False
    return True


def decoded_body(req: http.Request, limit: int) -> bytes:
    """The body as its content-encoding says, never more than limit bytes, decompressed a
    piece at a time: mitmproxy's get_content() would expand a gzip bomb whole."""
    data = req.raw_content or b""
    codings = [c.strip().lower() for c in req.headers.get("content-encoding", "").split(",")]
    for coding in reversed([c for c in codings if c and c != "identity"]):
        if len(data) > limit:
            break
        try:
            if coding in ("gzip", "x-gzip", "deflate"):
                data = _inflate(data, coding, limit)
            elif coding == "zstd":
                reader = zstandard.ZstdDecompressor(max_window_size=1 << 25).stream_reader(io.BytesIO(data),
                                                                     read_across_frames=True)
                out = bytearray()
                while chunk := reader.read(min(1 << 20, limit + 1 - len(out))):
                    out += chunk
                    if len(out) > limit:
                        raise BodyTooLarge(f"request body is larger than polar_max_body ({limit} bytes)")
                data = bytes(out)
            else:  # br has no bounded decoder here; no harness compresses requests with it
                raise AdapterError(f"content-encoding {coding!r} is not accepted for requests",
                                   status=415)
        except (zlib.error, zstandard.ZstdError) as e:
            raise AdapterError(f"the request body is not valid {coding}: {e}") from None
    if len(data) > limit:
        raise BodyTooLarge(f"request body is larger than polar_max_body ({limit} bytes)")
    return data


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    # deflate comes zlib-wrapped or raw (as mitmproxy accepts); gzip may have several members
    if coding == "deflate":
        wbits = 15 if len(data) > 1 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0 else -15
    else:
        wbits = 31
    out, d = bytearray(), zlib.decompressobj(wbits)
    while True:
        out += d.decompress(data, limit + 1 - len(out))   # at most what would still fit, plus one
        if len(out) > limit:
            raise BodyTooLarge(f"request body is larger than polar_max_body ({limit} bytes)")
        data = d.unconsumed_tail
        if not data and d.eof and d.unused_data and wbits == 31:
            data, d = d.unused_data, zlib.decompressobj(wbits)
        elif not data:
            break
    if not d.eof:
        raise zlib.error("truncated stream")
    return bytes(out)


REJECTED_TEXT_CHARS = 1 << 20


def bounded(text: str | bytes) -> str:
    """A call rejected before the model saw it keeps the first MiB of its body: enough to
    see what was wrong, while a huge bad body cannot grow the database by its size."""
    if isinstance(text, bytes):
        if len(text) <= REJECTED_TEXT_CHARS:
            return text.decode("utf-8", errors="replace")
        return (text[:REJECTED_TEXT_CHARS].decode("utf-8", errors="replace")
                + f"\n<{len(text) - REJECTED_TEXT_CHARS} more bytes not kept>")
    if len(text) <= REJECTED_TEXT_CHARS:
        return text
    return text[:REJECTED_TEXT_CHARS] + f"\n<{len(text) - REJECTED_TEXT_CHARS} more characters not kept>"
