"""What became of a model call, and the record built from it, once.

A call starts with what its request says (RequestFacts) and ends in one of two outcomes:
Served (vLLM answered, and the harness gets that answer in its own format) or Failed (a body
the adapters refuse, a backend that fails or times out, a bug), each carrying what the call
reached. call_record makes the stored record from the two, and nothing else writes one.
Requests that are not model calls are answered locally (local_answers.py) and recorded
nowhere, so they have no outcome here."""

from __future__ import annotations

from typing import Any, NamedTuple

from polar_mitm.adapters.chat import FinishReason, Usage
from polar_mitm.store import CallRecord

from .bodies import bounded

ABANDONED = "the client went away before the answer"


class Answer(NamedTuple):
    """What the harness gets: made in the request hook, or sent on by the stream relay."""
    status: int
    content: bytes
    headers: dict[str, str]


class RequestFacts(NamedTuple):
    """What a call's start knows. stream, requested_model and dropped are None where the
    body has no chat shape (the call then fails without reaching vLLM)."""
    call_id: str
    style: str
    method: str
    path: str                    # query secrets (key=) removed
    started_at: float            # wall time (time.time())
    # The harness's bytes as sent (the conversation is stored once, and its normalized form
    # is what the pure adapters make of it), or a note where the body could not be read.
    request_text: str | bytes
    stream: bool | None = None
    requested_model: str | None = None
    dropped: list[str] | None = None


class Dispatch(NamedTuple):
    """What vLLM was asked for: the model it serves, and what it got besides the conversation
    (sampling, max_tokens as fitted, flags; under `harness`, the harness's own sampling)."""
    served_model: str
    backend_params: dict[str, Any]


class Waits(NamedTuple):
    """Milliseconds before the backend (the policy gate and the backend's slots) and in it;
    0.0 for a wait the call never reached or never finished."""
    queue_ms: float = 0.0
    backend_ms: float = 0.0


class Served(NamedTuple):
    """vLLM answered: what it sampled, and the answer in the harness's format."""
    answer: Answer
    response_json: dict[str, Any]        # the provider-shaped answer
    dispatch: Dispatch
    waits: Waits
    policy_version: int | None           # the weights that sampled it (None: not known)
    prompt_token_ids: bytes              # vLLM's prompt ids, as its JSON text
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    usage: Usage
    # the engine's version of each sampled token (None: the chat route gave no spans)
    token_versions: list[int | None] | None = None


class Failed(NamedTuple):
    """The call failed; the harness gets an error in its provider's shape."""
    answer: Answer
    response_json: dict[str, Any]        # the error body
    error: str                           # the whole reason, for the record (a bug's text included)
    kind: str                            # invalid_request, too_large, backend_error, timeout, request_failed, ...
    dispatch: Dispatch | None = None     # None: it failed before vLLM was asked
    waits: Waits = Waits()


Outcome = Served | Failed


def call_record(facts: RequestFacts, outcome: Outcome, *, abandoned: bool) -> CallRecord:
    """The call's record. abandoned: the harness went away before the answer (its timeout,
    or it was stopped): a served call is then kept with that error and never trained on."""
    dispatch = outcome.dispatch
    if isinstance(outcome, Served):
        usage = outcome.usage
        return CallRecord(
            call_id=facts.call_id, style=facts.style, method=facts.method, path=facts.path,
            stream=facts.stream, requested_model=facts.requested_model,
            served_model=outcome.dispatch.served_model, status_code=outcome.answer.status,
            request_text=facts.request_text, backend_params=outcome.dispatch.backend_params,
            response_json=outcome.response_json, prompt_token_ids=outcome.prompt_token_ids,
            token_ids=outcome.token_ids, logprobs=outcome.logprobs, finish_reason=outcome.finish_reason,
            prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
            usage_json=usage, queue_ms=outcome.waits.queue_ms, backend_ms=outcome.waits.backend_ms,
            error=ABANDONED if abandoned else None, error_kind="abandoned" if abandoned else None,
            policy_version=outcome.policy_version, dropped=facts.dropped, started_at=facts.started_at,
            token_versions=outcome.token_versions)
    return CallRecord(
        call_id=facts.call_id, style=facts.style, method=facts.method, path=facts.path,
        stream=facts.stream, requested_model=facts.requested_model,
        served_model=dispatch.served_model if dispatch else None, status_code=outcome.answer.status,
        # no tokens came back: a bounded head is enough to see what was wrong, and a huge
        # bad body cannot grow the database by its size
        request_text=bounded(facts.request_text),
        backend_params=dispatch.backend_params if dispatch else None, response_json=outcome.response_json,
        queue_ms=outcome.waits.queue_ms, backend_ms=outcome.waits.backend_ms,
        error=outcome.error, error_kind=outcome.kind, dropped=facts.dropped, started_at=facts.started_at)
