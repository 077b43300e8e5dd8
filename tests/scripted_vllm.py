"""A scripted stand-in for vLLM's token API, for the harness CLIs whose prompts are longer than
SmolLM2's context. It answers like vLLM's /v1/chat/completions with return_token_ids and
logprobs: the first turn that offers tools gets a call of the harness's own shell tool (picked
from the advertised tools, arguments built from its schema), later turns get text, and
JSON-schema requests (Gemini's router, Claude's title) get an object that fits the schema.

Token ids are the bytes of the messages' JSON, so turn N's prompt extends turn N-1's as a
real tokenizer's would."""

from __future__ import annotations

import itertools
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson

SHELL_TOOLS = ("Bash", "bash", "run_shell_command", "exec_command", "shell_command", "shell", "local_shell")
MARKER = "polar-tool-ok"
COMMAND = f"echo {MARKER} > polar_proof.txt && cat polar_proof.txt"


def _fit(schema: dict):
    """A value that satisfies a (simple) JSON schema; upper-case Google types too."""
    t = str(schema.get("type", "object")).lower()
    if "enum" in schema:
        return schema["enum"][0]
    if t == "object":
        props = schema.get("properties") or {}
        return {k: _fit(v) for k, v in props.items()}
    return {"string": "ok", "integer": 1, "number": 1, "boolean": True, "array": []}.get(t, "ok")


def _args(schema: dict) -> dict:
    props = (schema or {}).get("properties") or {}
    out = {}
    for name in (schema or {}).get("required") or []:
        out[name] = _fit(props.get(name) or {})
    key = "cmd" if "cmd" in props else "command"
    out[key] = COMMAND
    return out


class ScriptedVLLM:
    def __init__(self, max_model_len: int = 262144):
        self.max_model_len = max_model_len
        self.delay = 0.0          # seconds each completion takes (a long generation)
        self.bodies: list[dict] = []
        self._ids = itertools.count(1)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, status, obj):
                data = orjson.dumps(obj)
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the proxy gave up on this call (its harness timed out)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [
                        {"id": "scripted", "max_model_len": fake.max_model_len}]})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path == "/tokenize":
                    n = len(fake.prompt_ids(body.get("messages") or []))
                    return self._send(200, {"count": n, "max_model_len": fake.max_model_len, "tokens": []})
                fake.bodies.append(body)
                time.sleep(fake.delay)
                self._send(200, fake.answer(body))

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    @staticmethod
    def prompt_ids(messages) -> list[int]:
        return list(orjson.dumps(messages))

    def answer(self, body: dict) -> dict:
        messages = body.get("messages") or []
        tools = {t["function"]["name"]: t["function"] for t in body.get("tools") or []}
        shell = next((n for n in SHELL_TOOLS if n in tools), None)
        had_result = any(m.get("role") == "tool" for m in messages)
        rf = body.get("response_format") or {}
        msg: dict = {"role": "assistant", "content": None}
        if rf.get("type") == "json_schema":
            msg["content"] = orjson.dumps(_fit(rf["json_schema"].get("schema") or {})).decode()
        elif shell and not had_result:
            args = _args(tools[shell].get("parameters") or {})
            msg["tool_calls"] = [{"id": f"call_{next(self._ids)}", "type": "function",
                                  "function": {"name": shell, "arguments": orjson.dumps(args).decode()}}]
        else:
            msg["content"] = "Done: the command printed " + (MARKER if had_result else "nothing") + "."
        text = msg["content"] or orjson.dumps(msg.get("tool_calls")).decode()
        out_ids = list(text.encode())[:64] + [0]
        prompt = self.prompt_ids(messages)
        return {"id": f"chatcmpl-{next(self._ids)}", "object": "chat.completion", "created": 1,
                "model": body.get("model", "scripted"), "prompt_token_ids": prompt,
                "choices": [{"index": 0, "message": msg,
                             "finish_reason": "tool_calls" if msg.get("tool_calls") else "stop",
                             "token_ids": out_ids,
                             "logprobs": {"content": [{"token": "x", "logprob": -0.1} for _ in out_ids]}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out_ids),
                          "total_tokens": len(prompt) + len(out_ids)}}

    def __enter__(self):
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._httpd.shutdown()
        self._httpd.server_close()
