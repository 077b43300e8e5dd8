"""What a caller hands the writer for each call: the session it belongs to and the call's
columns. Plain data: the writer numbers the call (seq), stamps created_at (and total_ms,
from the caller's start time), and lines.py turns the columns into the call's log line."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

# A JSON column's value, stored as written.
JsonObject = Mapping[str, Any]


@dataclass(slots=True)
class SessionInfo:
    """The session a call belongs to: one harness run (the sessions table)."""
    session_id: str
    task_id: str | None = None      # sessions of one task form a GRPO group
    source: str | None = None       # proxy_user | api_key | key_hash | default
    client: str | None = None       # the peer address of its calls
    user_agent: str | None = None

    def columns(self) -> dict[str, Any]:
        """The session's columns, in the line format's order."""
        return {"session_id": self.session_id, "task_id": self.task_id, "source": self.source,
                "client": self.client, "user_agent": self.user_agent}


@dataclass(slots=True)
class CallRecord:
    """One call as recorded: what the harness sent, what vLLM got and sampled, what the
    harness got back. None: not known (a call that failed before it got that far)."""
    call_id: str
    style: str | None = None                 # anthropic | openai_chat | openai_responses | google
    method: str | None = None
    path: str | None = None                  # query secrets (key=) removed
    stream: bool | None = None
    requested_model: str | None = None
    served_model: str | None = None
    status_code: int | None = None           # what the harness got
    # The harness's body as sent (bytes are decoded off the event loop, by the writer)
    request_text: str | bytes | None = None
    backend_params: JsonObject | None = None  # what vLLM got besides messages and tools
    response_json: JsonObject | None = None   # the provider-shaped answer (or error body)
    # vLLM's prompt ids, as its JSON text (bytes) or as a list
    prompt_token_ids: bytes | list[int] | None = None
    token_ids: list[int] | None = None       # sampled, EOS included
    logprobs: list[float] | None = None      # aligned with token_ids
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_json: JsonObject | None = None
    queue_ms: float | None = None            # waits before the backend (the writer adds its own)
    backend_ms: float | None = None
    total_ms: float | None = None            # set by the writer from submit's t0, if given
    error: str | None = None
    error_kind: str | None = None
    policy_version: int | None = None        # the weights that sampled it (None: not known)
    dropped: list[str] | None = None         # provider fields not forwarded
    started_at: float | None = None          # wall time (time.time())
    # the engine's version of each sampled token (None entries: not polar-mitm's weights);
    # None: no spans from the backend (the chat fallback), every token is policy_version's
    token_versions: list[int | None] | None = None

    def columns(self) -> dict[str, Any]:
        """Every field by name (not a deep copy, as dataclasses.asdict would make)."""
        return {name: getattr(self, name) for name in CALL_FIELDS}


CALL_FIELDS = tuple(f.name for f in fields(CallRecord))
