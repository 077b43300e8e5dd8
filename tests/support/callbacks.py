"""The receiver of the rollout server's task callbacks (a task's callback_url): it keeps every
scored group it is posted."""

from __future__ import annotations

import json
import threading
import time

from support.http_stub import Reply, Request, StubServer


class Callbacks(StubServer):
    """Receives scored groups at `url`; answers the first `fail` posts with a 500 (a flaky
    receiver: the server retries). groups: the accepted bodies, in order; posts: every post,
    failed ones too; arrived: task id -> when (time.monotonic()) its group was accepted."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.groups: list[dict] = []
        self.posts = 0
        self.arrived: dict[str, float] = {}
        self._lock = threading.Lock()
        super().__init__(self._receive)
        self.url += "/groups"

    def _receive(self, request: Request) -> Reply:
        body = json.loads(request.body)
        with self._lock:
            self.posts += 1
            ok = self.posts > self.fail
            if ok:
                self.groups.append(body)
                self.arrived[body["task_id"]] = time.monotonic()
        return Reply(200 if ok else 500)
