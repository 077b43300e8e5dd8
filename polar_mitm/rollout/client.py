"""A rollout server over HTTP, as the loop uses it: submit tasks, read their scored groups,
set the policy every node serves and wait until they all serve it. The same client for a
server in this process and one on another machine."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import httpx

from .protocol import (Group, GroupsReply, GroupsRequest, PolicyReport, PolicyRequest, PolicyStatus, PolicyTarget,
                       WeightPull)
from .spec import TaskRequest
from .web_guard import auth_headers, client_token


class ServerError(RuntimeError):
    pass


class ServerClient:
    """token: the server's bearer token (a server beyond loopback asks for one); None: the
    token_file's, else $POLAR_ROLLOUT_TOKEN_FILE's, else none (a server on loopback)."""

    def __init__(self, url: str, timeout: float = 120.0, token: str | None = None,
                 token_file: str | os.PathLike | None = None):
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), trust_env=False,
                                 headers=auth_headers(client_token(token, token_file)))

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        """503 means "not saved yet, retry" (the server's database was busy)."""
        r = None
        for attempt in range(6):
            try:
                r = self.http.request(method, self.url + path, json=body)
            except httpx.TransportError as e:
                if attempt == 5:
                    raise ServerError(f"the rollout server at {self.url} does not answer: {e}") from None
            else:
                if r.status_code != 503:
                    return r
            time.sleep(0.5 * 2 ** attempt)
        raise ServerError(f"the rollout server at {self.url} stayed busy: {r.text[:300] if r is not None else ''}")

    def submit(self, spec: TaskRequest) -> bool:
        """Queue a task; False when it is there already (a rerun resumes it)."""
        r = self._call("POST", "/tasks", {k: v for k, v in spec.to_json().items() if v is not None})
        if r.status_code == 409:
            return False
        if r.status_code != 202:
            raise ServerError(f"{spec.task_id}: the rollout server refused it: {r.text[:500]}")
        return True

    def groups(self, task_ids: list[str]) -> list[Group]:
        r = self._call("POST", "/groups", GroupsRequest(task_ids=task_ids))
        if r.status_code != 200:
            raise ServerError(f"the rollout server's groups: {r.text[:500]}")
        reply: GroupsReply = r.json()
        return reply["groups"]

    def policy_status(self) -> PolicyStatus:
        return self._call("GET", "/policy").json()

    def sync_nodes(self, version: int, checkpoint: str, asleep: bool = False, timeout: float = 900.0,
                   check: Callable[[], None] = lambda: None,
                   pull: WeightPull | None = None) -> dict[str, PolicyReport]:
        """Every live node serves (version, checkpoint), or sleeps: set the target, then wait
        for their reports. Returns each node's report; a node's failure raises ServerError."""
        request = PolicyRequest(version=version, checkpoint=checkpoint, asleep=asleep)
        if pull is not None:
            request["pull"] = pull
        r = self._call("POST", "/policy", request)
        if r.status_code != 200:
            raise ServerError(f"the rollout server did not take the policy: {r.text[:500]}")
        target: PolicyTarget = r.json()
        deadline = time.monotonic() + timeout
        while True:
            nodes = {k: n for k, n in self.policy_status()["nodes"].items() if not n["lost"]}
            done = {k: p for k, n in nodes.items() if (p := n["policy"]) and p.get("target") == target["id"]}
            failed = {k: p.get("error") for k, p in done.items() if p.get("error")}
            if failed:
                raise ServerError("; ".join(f"node {k}: {e}" for k, e in failed.items()))
            if nodes and len(done) == len(nodes):
                return done
            if time.monotonic() > deadline:
                waiting = sorted(set(nodes) - set(done)) or ["(no node has registered)"]
                raise ServerError(f"no sync to version {version} after {timeout:.0f}s from: {', '.join(waiting)}")
            check()
            time.sleep(0.1)
