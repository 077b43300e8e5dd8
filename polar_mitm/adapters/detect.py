"""Which provider API style a request speaks: path first, then headers, then body shape."""

from __future__ import annotations

import re
from typing import Any, Mapping

ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, GOOGLE = (
    "anthropic", "openai_chat", "openai_responses", "google")
STYLES = (ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, GOOGLE)

_GOOGLE_PATH = re.compile(r"/models/(?P<model>[^/:]+):(?P<method>generateContent|streamGenerateContent)$")
# Gemini CLI with Google login talks to Code Assist: the model is inside the body.
_OTHER_ENDPOINT = re.compile(r"(:[A-Za-z]+|/count_tokens|/embeddings|/tokenize|/completions)$")
CODE_ASSIST_PATH = re.compile(r"/v1internal:(?P<method>generateContent|streamGenerateContent)$")


def split_path(path: str) -> tuple[str, str]:
    """mitmproxy's request.path includes the query (Claude Code sends ?beta=true)."""
    base, _, query = path.partition("?")
    return base.rstrip("/") or "/", query


def style_from_path(path: str) -> str | None:
    base, _ = split_path(path)
    if base.endswith("/messages") and not base.endswith("/chat/messages"):
        return ANTHROPIC
    if base.endswith("/chat/completions"):
        return OPENAI_CHAT
    if base.endswith("/responses"):
        return OPENAI_RESPONSES
    if _GOOGLE_PATH.search(base) or CODE_ASSIST_PATH.search(base):
        return GOOGLE
    return None


def google_path(path: str) -> tuple[str, bool, bool] | None:
    """(model, streaming, alt=sse) for a generateContent path, else None."""
    base, query = split_path(path)
    m = _GOOGLE_PATH.search(base)
    if not m:
        return None
    params = dict(p.partition("=")[::2] for p in query.split("&") if p)
    return m["model"], m["method"] == "streamGenerateContent", params.get("alt") == "sse"


def is_count_tokens(path: str) -> bool:
    base, _ = split_path(path)
    return base.endswith("/messages/count_tokens") or base.endswith(":countTokens")


def detect(method: str, path: str, headers: Mapping[str, str] | None = None,
           body: Any = None) -> str | None:
    """The style of a model call, or None for anything else (telemetry, model lists...)."""
    if method.upper() != "POST":
        return None
    by_path = style_from_path(path)
    if by_path:
        return by_path
    base, _ = split_path(path)
    if _OTHER_ENDPOINT.search(base):  # countTokens, embeddings...: API calls, not generation
        return None
    h = {k.lower(): v for k, v in (headers or {}).items()}
    if not isinstance(body, dict):
        return None
    if "anthropic-version" in h and "messages" in body:
        return ANTHROPIC
    if "x-goog-api-key" in h and "contents" in body:
        return GOOGLE
    if "contents" in body:
        return GOOGLE
    if "input" in body and "model" in body:
        return OPENAI_RESPONSES
    if "messages" in body and "model" in body:
        if "system" in body or ("max_tokens" in body and "anthropic-version" in h):
            return ANTHROPIC
        return OPENAI_CHAT
    return None
