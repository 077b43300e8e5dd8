"""Provider API adapters: pure functions between provider wire formats and one chat shape.

Each style module exposes STYLE, to_chat(body, path), from_chat(result, request),
stream(result, request) -> list[bytes], error(status, message, kind) -> dict.
"""

from __future__ import annotations

from types import ModuleType

from . import anthropic, google, openai_chat, openai_responses
from .chat import AdapterError, MalformedRequest, UnsupportedContent
from .detect import STYLES, detect

ADAPTERS: dict[str, ModuleType] = {m.STYLE: m for m in (anthropic, openai_chat,
                                                         openai_responses, google)}


def adapter(style: str) -> ModuleType:
    return ADAPTERS[style]


def backend_request(style: str, path: str, request_text: str, backend_params: dict) -> dict:
    """The body vLLM got for a recorded call, rebuilt from what the store keeps: the
    harness's request text (adapted again, purely) and the stored non-message params (less
    `harness`: what the harness asked for its sampling, which vLLM did not get)."""
    import orjson

    from .backend import to_backend
    normalized = adapter(style).to_chat(orjson.loads(request_text), path)
    rebuilt = to_backend(normalized, backend_params.get("model", ""))
    return {**{k: v for k, v in backend_params.items() if k != "harness"},
            **{k: rebuilt[k] for k in ("messages", "tools") if k in rebuilt}}


def stream_content_type(request: dict) -> str:
    # Google without alt=sse streams one JSON array instead of SSE.
    if request["style"] == "google" and not request["provider"].get("alt_sse"):
        return "application/json"
    return "text/event-stream"


# SSE comment lines keep connections and body timeouts alive and every SSE parser skips
# them; Google's SDKs choke on them (they match `^\s*data: ` on their buffer) but skip
# whitespace, which a JSON-array stream allows too; OpenAI Responses needs data-bearing events.
COMMENT_KEEPALIVE = b": keepalive\n\n"


def stream_keepalive(request: dict, created: int) -> tuple[bytes, bytes, int]:
    """(head, tick, leading events of the answer to leave out): what keeps a streaming
    client waiting for a long generation, in its provider's shape. For OpenAI Responses
    the caller fixes request["response_id"] first, so the answer keeps the head's id."""
    if request["style"] == "openai_responses":
        return openai_responses.stream_keepalive(request, created)
    if request["style"] == "google":
        return b"", b"\n", 0
    return b"", COMMENT_KEEPALIVE, 0


__all__ = ["ADAPTERS", "AdapterError", "MalformedRequest", "UnsupportedContent", "STYLES",
           "adapter", "backend_request", "detect", "stream_content_type", "stream_keepalive"]
