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
    harness's request text (adapted again, purely) and the stored non-message params."""
    import orjson

    from .backend import to_backend
    normalized = adapter(style).to_chat(orjson.loads(request_text), path)
    rebuilt = to_backend(normalized, backend_params.get("model", ""))
    return {**backend_params, **{k: rebuilt[k] for k in ("messages", "tools") if k in rebuilt}}


def stream_content_type(request: dict) -> str:
    # Google without alt=sse streams one JSON array instead of SSE.
    if request["style"] == "google" and not request["provider"].get("alt_sse"):
        return "application/json"
    return "text/event-stream"


__all__ = ["ADAPTERS", "AdapterError", "MalformedRequest", "UnsupportedContent", "STYLES",
           "adapter", "backend_request", "detect", "stream_content_type"]
