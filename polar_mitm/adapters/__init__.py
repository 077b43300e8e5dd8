"""Provider API adapters: pure functions between provider wire formats and one chat shape.

Each style module implements the Adapter protocol (protocol.py); ADAPTERS maps a style to
its module, and mypy checks every module against the protocol through that mapping.
"""

from __future__ import annotations

from typing import Any

import orjson

from . import anthropic, google, openai_chat, openai_responses
from .backend import to_backend
from .chat import AdapterError, ChatRequest, MalformedRequest, StreamKeepalive, UnsupportedContent
from .detect import STYLES, detect
from .protocol import Adapter

ADAPTERS: dict[str, Adapter] = {anthropic.STYLE: anthropic, openai_chat.STYLE: openai_chat,
                                openai_responses.STYLE: openai_responses, google.STYLE: google}


def adapter(style: str) -> Adapter:
    return ADAPTERS[style]


def backend_request(style: str, path: str, request_text: str, backend_params: dict[str, Any]) -> dict[str, Any]:
    """The body vLLM got for a recorded call, rebuilt from what the store keeps: the
    harness's request text (adapted again, purely) and the stored non-message params (less
    `harness`: what the harness asked for its sampling, which vLLM did not get)."""
    normalized = adapter(style).to_chat(orjson.loads(request_text), path)
    rebuilt = to_backend(normalized, backend_params.get("model", ""))
    return {**{k: v for k, v in backend_params.items() if k != "harness"},
            **{k: rebuilt[k] for k in ("messages", "tools") if k in rebuilt}}


def stream_content_type(request: ChatRequest) -> str:
    return adapter(request["style"]).stream_content_type(request)


def stream_keepalive(request: ChatRequest, created: int) -> StreamKeepalive:
    """(head, tick, leading events of the answer to leave out) in the request's provider's
    shape. For OpenAI Responses the caller fixes request["response_id"] first, so the answer
    keeps the head's id."""
    return adapter(request["style"]).stream_keepalive(request, created)


__all__ = ["ADAPTERS", "Adapter", "AdapterError", "MalformedRequest", "UnsupportedContent", "STYLES",
           "adapter", "backend_request", "detect", "stream_content_type", "stream_keepalive"]
