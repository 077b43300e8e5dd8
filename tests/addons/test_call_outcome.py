"""The call record is made once, from what became of the call (addons/call_outcome.py): what
each outcome stores, column by column. The gateway tests store the same records end to end."""

from polar_mitm.addons.bodies import REJECTED_TEXT_CHARS
from polar_mitm.addons.call_outcome import (ABANDONED, Answer, Dispatch, Failed, RequestFacts, Served, Waits,
                                            call_record)
from polar_mitm.store.records import CALL_FIELDS

FACTS = RequestFacts("c1", "openai_chat", "POST", "/v1/chat/completions", 1700000000.5, b'{"model": "m"}',
                     stream=False, requested_model="m", dropped=["user"])
USAGE = {"prompt_tokens": 3, "completion_tokens": 2}
SERVED = Served(Answer(200, b'{"id": "x"}', {"content-type": "application/json"}), {"id": "x"},
                Dispatch("policy", {"model": "policy", "temperature": 1.0, "harness": {}}), Waits(1.5, 20.0),
                4, b"[1, 2, 3]", [7, 8], [-0.1, -0.2], "stop", USAGE, [4, 5])
ERROR_BODY = {"error": {"message": "the model backend is unavailable", "type": "api_error"}}


def failed(**kw) -> Failed:
    return Failed(Answer(502, b"{}", {}), ERROR_BODY, "the model backend is unavailable (connection refused)",
                  "backend_error", **kw)


def test_a_served_call_stores_what_was_asked_sampled_and_answered():
    assert call_record(FACTS, SERVED, abandoned=False).columns() == {
        "call_id": "c1", "style": "openai_chat", "method": "POST", "path": "/v1/chat/completions",
        "stream": False, "requested_model": "m", "served_model": "policy", "status_code": 200,
        "request_text": b'{"model": "m"}',
        "backend_params": {"model": "policy", "temperature": 1.0, "harness": {}},
        "response_json": {"id": "x"}, "prompt_token_ids": b"[1, 2, 3]", "token_ids": [7, 8],
        "logprobs": [-0.1, -0.2], "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2,
        "usage_json": USAGE, "queue_ms": 1.5, "backend_ms": 20.0, "total_ms": None, "error": None,
        "error_kind": None, "policy_version": 4, "dropped": ["user"], "started_at": 1700000000.5,
        "token_versions": [4, 5]}


def test_a_served_call_whose_client_went_away_is_kept_with_that_reason():
    record = call_record(FACTS, SERVED, abandoned=True)
    assert (record.status_code, record.error, record.error_kind) == (200, ABANDONED, "abandoned")
    assert record.token_ids == [7, 8] and record.policy_version == 4   # kept, never trained on (the reader)


def test_a_call_that_never_reached_vllm_keeps_a_bounded_head_of_its_body():
    huge = RequestFacts("c2", "anthropic", "POST", "/v1/messages", 1.0, b"x" * (REJECTED_TEXT_CHARS + 10))
    rejected = Failed(Answer(400, b"{}", {}), ERROR_BODY, "request body must be a JSON object", "invalid_request")
    record = call_record(huge, rejected, abandoned=True)   # its own error wins over the client's leaving
    assert record.request_text == "x" * REJECTED_TEXT_CHARS + "\n<10 more bytes not kept>"
    assert (record.status_code, record.error, record.error_kind) == (400, "request body must be a JSON object",
                                                                     "invalid_request")
    assert record.response_json == ERROR_BODY
    assert (record.stream, record.requested_model, record.dropped) == (None, None, None)
    assert (record.served_model, record.backend_params, record.queue_ms, record.backend_ms) == (None, None, 0.0, 0.0)
    assert all(getattr(record, f) is None for f in ("prompt_token_ids", "token_ids", "logprobs", "finish_reason",
                                                    "usage_json", "policy_version"))


def test_a_backend_failure_keeps_what_vllm_was_asked_and_how_long_it_waited():
    dispatch = Dispatch("policy", {"model": "policy"})
    record = call_record(FACTS, failed(dispatch=dispatch, waits=Waits(queue_ms=2.5)), abandoned=False)
    assert (record.served_model, record.backend_params) == ("policy", {"model": "policy"})
    assert (record.queue_ms, record.backend_ms) == (2.5, 0.0)   # the backend's own wait never finished
    assert (record.status_code, record.error_kind) == (502, "backend_error")
    assert record.request_text == '{"model": "m"}' and record.stream is False and record.dropped == ["user"]
    assert record.token_ids is None and record.policy_version is None


def test_every_column_comes_from_the_outcome_or_the_request():
    """A column added to the record and to neither outcome would stay None for every call."""
    served, failed_call = call_record(FACTS, SERVED, abandoned=True), call_record(FACTS, failed(), abandoned=False)
    unset = {f for f in CALL_FIELDS if getattr(served, f) is None and getattr(failed_call, f) is None}
    assert unset == {"total_ms"}   # the writer stamps it at the durable append
