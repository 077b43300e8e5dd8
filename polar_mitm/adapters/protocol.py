"""The contract every provider style module fulfils (anthropic, openai_chat, openai_responses,
google). The modules themselves are the implementations: the registry in __init__ is typed
with this Protocol, so mypy checks each module against it."""

from __future__ import annotations

from typing import Any, Protocol

from .chat import ChatRequest, ChatResult, StreamKeepalive


class Adapter(Protocol):
    STYLE: str
    # The status of an "overloaded" answer, which clients retry (Anthropic's own is 529).
    OVERLOADED_STATUS: int

    def to_chat(self, body: Any, path: str = "") -> ChatRequest:
        """The provider's request body (at that path) in the chat shape; raises AdapterError."""
        ...

    def from_chat(self, result: ChatResult, request: ChatRequest) -> dict[str, Any]:
        """The whole answer, as the provider's JSON body."""
        ...

    def stream(self, result: ChatResult, request: ChatRequest) -> list[bytes]:
        """The answer as the provider streams it (SSE events, or Google's JSON array)."""
        ...

    def error(self, status: int, message: str, kind: str | None = None) -> dict[str, Any]:
        """An error body in the provider's shape (kind: chat.kind_for_status's kinds)."""
        ...

    def stream_content_type(self, request: ChatRequest) -> str:
        """The content type of stream()'s bytes."""
        ...

    def stream_keepalive(self, request: ChatRequest, created: int) -> StreamKeepalive:
        """What keeps a streaming client waiting for a long generation."""
        ...
