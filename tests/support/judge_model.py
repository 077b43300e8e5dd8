"""A stand-in for the judge's model: an OpenAI-compatible chat endpoint whose answer the test
writes (the judge's verdict, or garbage), or which fails with a status. It keeps the requests
and their headers."""

from __future__ import annotations

import json
from typing import Callable

from support.http_stub import Reply, Request, StubServer

NOT_FOUND = Reply(404, b'{"error": "not found"}')


class StandIn(StubServer):
    """An OpenAI-compatible chat endpoint on 127.0.0.1 that answers `reply(request body)`."""

    def __init__(self, reply: Callable[[dict], str], status: int = 200):
        self.reply, self.status = reply, status
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        super().__init__(self._answer)

    def _answer(self, request: Request) -> Reply:
        if request.method == "GET":
            if request.path == "/v1/models":
                return Reply(200, json.dumps({"object": "list", "data": [{"id": "judge-m"}, {"id": "other"}]}).encode())
            return NOT_FOUND
        body = json.loads(request.body)
        self.requests.append(body)
        self.headers.append(request.headers)
        if request.path != "/v1/chat/completions":
            return NOT_FOUND
        if self.status != 200:
            return Reply(self.status, b'{"error": {"message": "overloaded"}}')
        return Reply(200, json.dumps({"id": "x", "object": "chat.completion", "model": body["model"],
                                      "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                          "role": "assistant", "content": self.reply(body)}}]}).encode())
