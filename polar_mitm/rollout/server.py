"""The rollout server: tasks in, scored GRPO groups out.

Each task becomes num_samples sessions named TASK~i. Gateway nodes pull them in their
heartbeats (as many as they have free places: load-based), report every state change, and
the server mirrors all of it in DuckDB (rollout_tasks, rollout_sessions, rollout_events), so
a restarted server resumes: sessions on live nodes carry on, the rest are rescheduled or
failed with a reason. A node that stops sending heartbeats is declared lost and its
sessions run again under a new attempt name (TASK~i.rN) so that no two attempts share calls.

The server also carries the policy every node should serve (set_policy: a version, its
checkpoint, asleep or not). Nodes hear the target in their heartbeats, sync their own
gateway and vLLM to it (node.py), and report what they serve in the next heartbeat;
policy_status() shows who is there yet. So the loop syncs every node the same way, on one
machine or many.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from ..store import rollouts as store
from .spec import TaskError, TaskRequest, parse_task, task_from_json

log = logging.getLogger("polar.rollout")

TERMINAL = frozenset({"done", "timed_out", "failed", "cancelled", "lost"})
FINISHED = frozenset({"done", "timed_out"})      # what early_stop counts
NODE_STATES = ("assigned", "init", "ready", "run", "post_run")
ORDER = ("pending",) + NODE_STATES + ("done", "timed_out", "failed", "cancelled", "lost")


@dataclass
class SessionState:
    session_id: str
    task_id: str
    sample: int
    attempt: int = 1
    state: str = "pending"
    node_id: str | None = None
    reward: float | None = None
    reason: str | None = None
    stats: dict | None = None
    assigned_at: float = 0.0
    cancel: bool = False

    def row(self) -> store.SessionRow:
        return store.SessionRow(session_id=self.session_id, task_id=self.task_id, sample=self.sample,
                                attempt=self.attempt, state=self.state, node_id=self.node_id,
                                reward=self.reward, reason=self.reason, stats=self.stats)


@dataclass
class TaskState:
    spec: TaskRequest
    order: int
    state: str = "queued"
    callback_state: str | None = None
    callback_tries: int = 0
    cancel_reason: str | None = None
    latest: dict[int, str] = field(default_factory=dict)     # sample -> its current session id
    attempts: list[str] = field(default_factory=list)        # every session id, in order made

    def row(self) -> store.TaskRow:
        return store.TaskRow(task_id=self.spec.task_id, spec=self.spec.to_json(), state=self.state,
                             priority=self.spec.priority, callback_state=self.callback_state,
                             callback_tries=self.callback_tries)


@dataclass
class NodeState:
    node_id: str
    last_seen: float
    previous_seen: float = 0.0
    load: dict = field(default_factory=dict)
    lost: bool = False
    in_flight: int = 0         # heartbeats being answered: a node waiting on us is alive
    policy: dict | None = None # what it serves: version, checkpoint, asleep, target, error
    db: str | None = None      # its proxy's database (calls and rewards)


class RolloutServer:
    def __init__(self, db: str, *, host: str = "127.0.0.1", port: int = 0, node_timeout: float = 10.0,
                 max_attempts: int = 3, flush_s: float = 0.2, callback_tries: int = 8,
                 callback_backoff: float = 0.5):
        self.db, self.node_timeout, self.max_attempts = str(db), node_timeout, max_attempts
        self.flush_s, self.max_callback_tries, self.callback_backoff = flush_s, callback_tries, callback_backoff
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._flush_lock = threading.Lock()
        self.tasks: dict[str, TaskState] = {}
        self.sessions: dict[str, SessionState] = {}
        # Those not finished yet (a finished one never runs again: a retry is a new session):
        # what heartbeats and the reaper look through, however many a long run has finished.
        self._open: dict[str, SessionState] = {}
        self.nodes: dict[str, NodeState] = {}
        self.policy: dict | None = None       # the target every node syncs to (set_policy)
        self._dirty_tasks: set[str] = set()
        self._dirty_sessions: set[str] = set()
        self._events: list[store.Event] = []
        self._callbacks: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://{host}:{self._httpd.server_address[1]}"
        self._client = httpx.Client(timeout=10.0, trust_env=False)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "RolloutServer":
        store.ensure(self.db)
        self._restore()
        for name, fn in (("http", self._httpd.serve_forever), ("journal", self._journal_loop),
                         ("reaper", self._reaper_loop), ("callbacks", self._callback_loop)):
            t = threading.Thread(target=fn, name=f"rollout-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._changed:
            self._changed.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)
        self.flush()
        self._client.close()

    def _restore(self) -> None:
        tasks, sessions = store.load(self.db)
        now = time.monotonic()
        with self._lock:
            for i, t in enumerate(tasks):
                ts = TaskState(task_from_json(t["spec"]), i, t["state"], t["callback_state"], t["callback_tries"])
                self.tasks[ts.spec.task_id] = ts
                if ts.callback_state == "pending":
                    self._callbacks.append(ts.spec.task_id)
            for r in sessions:
                s = SessionState(r["session_id"], r["task_id"], r["sample"], r["attempt"], r["state"],
                                 r["node_id"], r["reward"], r["reason"], r["stats"], assigned_at=now)
                self._add(s, self.tasks[s.task_id])
                if s.state in NODE_STATES and s.node_id:
                    # Its node gets node_timeout to report back before the session moves.
                    self.nodes.setdefault(s.node_id, NodeState(s.node_id, now, now))
                    self._event(s, s.state, "server restarted; waiting for its node to report")

    # -- Python API ----------------------------------------------------------------------
    def submit(self, task: TaskRequest | dict) -> list[str]:
        """Queue a task; returns its session ids once they are durable in the database."""
        spec = task if isinstance(task, TaskRequest) else parse_task(task)
        with self._lock:
            if spec.task_id in self.tasks:
                raise TaskError(f"task {spec.task_id} already exists")
            ts = TaskState(spec, len(self.tasks))
            self.tasks[spec.task_id] = ts
            self._dirty_tasks.add(spec.task_id)
            ids = []
            for i, sid in enumerate(spec.session_ids()):
                s = SessionState(sid, spec.task_id, i)
                self._add(s, ts)
                self._event(s, "pending", None)
                ids.append(sid)
        self.flush()
        return ids

    def cancel(self, task_id: str, reason: str = "cancelled by request") -> bool:
        with self._lock:
            ts = self.tasks.get(task_id)
            if ts is None:
                return False
            if ts.state in ("done", "cancelled"):
                return True
            ts.cancel_reason = reason
            self._stop_stragglers(ts, reason)
            self._check_task(ts)
        return True

    def task_status(self, task_id: str) -> dict | None:
        with self._lock:
            ts = self.tasks.get(task_id)
            if ts is None:
                return None
            return {"task_id": task_id, "state": ts.state, "callback_state": ts.callback_state,
                    "sessions": [self._public(self.sessions[sid]) for sid in self._task_sessions(task_id)]}

    def status(self) -> dict:
        with self._lock:
            counts: dict[str, int] = {}
            for ts in self.tasks.values():
                for sid in ts.latest.values():
                    st = self.sessions[sid].state
                    counts[st] = counts.get(st, 0) + 1
            rewards = [s.reward for s in self.sessions.values() if s.reward is not None]
            return {"tasks": {k: sum(1 for t in self.tasks.values() if t.state == k)
                              for k in ("queued", "running", "done", "cancelled")},
                    "sessions": {k: counts[k] for k in ORDER if k in counts},
                    "rewards": {"n": len(rewards), "mean": sum(rewards) / len(rewards) if rewards else None},
                    "nodes": {n.node_id: {"lost": n.lost, "seen_s_ago": round(time.monotonic() - n.last_seen, 1),
                                          **n.load} for n in self.nodes.values()}}

    def wait(self, task_ids: list[str] | None = None, timeout: float | None = None) -> bool:
        """Until the tasks are done or cancelled and their callbacks are settled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                ids = task_ids if task_ids is not None else list(self.tasks)
                if all(self.tasks[t].state in ("done", "cancelled")
                       and self.tasks[t].callback_state in (None, "sent", "failed") for t in ids):
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._stop.is_set():
                    return False
                self._changed.wait(timeout=min(0.5, left) if left is not None else 0.5)
        self.flush()
        return True

    # -- the policy the nodes serve ----------------------------------------------------------
    def set_policy(self, version: int, checkpoint: str, asleep: bool = False) -> dict:
        """The new target of every node (each gets a fresh id, so setting the same one again
        is a retry); nodes sync to it in their next heartbeats."""
        with self._lock:
            self.policy = {"id": secrets.token_hex(4), "version": int(version), "checkpoint": str(checkpoint),
                           "asleep": bool(asleep)}
            self._changed.notify_all()
            return dict(self.policy)

    def policy_status(self) -> dict:
        with self._lock:
            return {"target": self.policy,
                    "nodes": {n.node_id: {"lost": n.lost, "policy": n.policy, "db": n.db}
                              for n in self.nodes.values()}}

    # -- node protocol -------------------------------------------------------------------
    def heartbeat(self, body: dict) -> dict:
        node_id = str(body["node_id"])
        now = time.monotonic()
        with self._lock:
            node = self.nodes.get(node_id)
            if node is None:
                node = self.nodes[node_id] = NodeState(node_id, now, now)
                self._task_event(None, "node_registered", node_id, None)
            elif node.lost:
                node.lost = False
                self._task_event(None, "node_returned", node_id, None)
            node.previous_seen, node.last_seen, node.load = node.last_seen, now, body.get("load") or {}
            node.policy, node.db = body.get("policy") or node.policy, body.get("db") or node.db
            node.in_flight += 1
        try:
            with self._lock:
                reply = self._heard(node, body)
            # Durable before the node hears back: it drops the events it reported once
            # answered, and must not start a session a restarted server would not know of.
            self.flush()
            return reply
        finally:
            with self._lock:
                node.in_flight -= 1
                node.last_seen = time.monotonic()

    def _heard(self, node: NodeState, body: dict) -> dict:
        node_id, active = node.node_id, set(body.get("active") or [])
        reported, settled = set(), []
        for ev in body.get("events") or []:
            reported.add(ev.get("session_id"))
            if self._apply(node_id, ev):
                settled.append(ev["session_id"])
        cancel = [sid for sid in active
                  if sid not in self.sessions or self.sessions[sid].node_id != node_id
                  or self.sessions[sid].state in TERMINAL or self.sessions[sid].cancel]
        for s in self._live():
            if (s.node_id == node_id and s.state in NODE_STATES and s.session_id not in active
                    and s.session_id not in reported and s.assigned_at < node.previous_seen):
                self._requeue(s, f"node {node_id} no longer holds it")
        assign = self._assign(node, int((body.get("load") or {}).get("free", 0)))
        self._changed.notify_all()
        # settled: outcomes the server holds as their sample's (durable once this answer is
        # sent); the node stores a reward only then, so a superseded attempt never has one.
        return {"assign": assign, "cancel": cancel, "settled": settled, "policy": self.policy}

    def _apply(self, node_id: str, ev: dict) -> bool:
        """One reported state change; True when it is a final outcome the server holds."""
        s = self.sessions.get(ev.get("session_id"))
        state = ev.get("state")
        if s is None or s.node_id != node_id:
            return False   # stale: the session moved on (lost node, retried elsewhere)
        if s.state in TERMINAL:   # the same outcome again (our answer was lost) is still settled
            return s.state == state
        if state == "released":      # the node is shutting down: run it again
            self._requeue(s, ev.get("reason") or f"released by node {node_id}")
            return False
        if state not in ORDER:
            return False
        s.state = state
        if "reward" in ev:
            s.reward = ev["reward"]
        if ev.get("reason"):
            s.reason = ev["reason"]
        if ev.get("stats") is not None:
            s.stats = ev["stats"]
        self._event(s, state, ev.get("reason"))
        if state in TERMINAL:
            self._check_task(self.tasks[s.task_id])
        return state in TERMINAL

    def _assign(self, node: NodeState, free: int) -> list[dict]:
        if free <= 0:
            return []
        pending = [s for s in self._live() if s.state == "pending" and not s.cancel]
        pending.sort(key=lambda s: (-self.tasks[s.task_id].spec.priority, self.tasks[s.task_id].order, s.sample))
        out = []
        for s in pending[:free]:
            s.state, s.node_id, s.assigned_at = "assigned", node.node_id, time.monotonic()
            ts = self.tasks[s.task_id]
            if ts.state == "queued":
                ts.state = "running"
                self._dirty_tasks.add(ts.spec.task_id)
            self._event(s, "assigned", None)
            out.append({"session_id": s.session_id, "task": ts.spec.to_json(), "attempt": s.attempt})
        return out

    def _requeue(self, s: SessionState, reason: str) -> None:
        """The node does not have it (never got it, or restarted): run it again."""
        ts = self.tasks[s.task_id]
        if s.cancel:
            s.state, s.reason = "cancelled", ts.cancel_reason or "cancelled"
            self._event(s, s.state, s.reason)
        elif s.state in ("assigned", "init", "ready"):
            s.state, s.node_id, s.reason = "pending", None, reason   # no harness ran: same name
            self._event(s, "pending", reason)
        else:
            self._retry(s, reason)
        self._check_task(ts)

    def _retry(self, s: SessionState, reason: str) -> None:
        """A new attempt under a new name: the calls of the lost one stay apart, unrewarded."""
        ts = self.tasks[s.task_id]
        s.state, s.reason = "lost", reason
        self._event(s, "lost", reason)
        if s.attempt >= self.max_attempts or s.cancel:
            s.state = "failed" if not s.cancel else "cancelled"
            s.reason = f"{reason}; {s.attempt} attempts" if not s.cancel else (ts.cancel_reason or "cancelled")
            self._event(s, s.state, s.reason)
            return
        n = SessionState(f"{ts.spec.task_id}~{s.sample}.r{s.attempt + 1}", s.task_id, s.sample, s.attempt + 1)
        self._add(n, ts)
        self._event(n, "pending", f"retry of {s.session_id}")

    # -- tasks -----------------------------------------------------------------------
    def _task_sessions(self, task_id: str) -> list[str]:
        return list(self.tasks[task_id].attempts)

    def _add(self, s: SessionState, ts: TaskState) -> None:
        """A new session (or attempt), now the current one of its sample."""
        self.sessions[s.session_id] = s
        ts.latest[s.sample] = s.session_id
        ts.attempts.append(s.session_id)
        if s.state not in TERMINAL:
            self._open[s.session_id] = s

    def _live(self) -> list[SessionState]:
        """The sessions not finished, dropping from _open those that finished since."""
        live = []
        for sid, s in list(self._open.items()):
            if s.state in TERMINAL:
                del self._open[sid]
            else:
                live.append(s)
        return live

    def _stop_stragglers(self, ts: TaskState, reason: str) -> None:
        for sid in ts.latest.values():
            s = self.sessions[sid]
            if s.state in TERMINAL:
                continue
            s.cancel = True
            if s.state == "pending":
                s.state, s.reason = "cancelled", reason
                self._event(s, "cancelled", reason)

    def _check_task(self, ts: TaskState) -> None:
        latest = [self.sessions[sid] for sid in ts.latest.values()]
        finished = sum(1 for s in latest if s.state in FINISHED)
        if ts.spec.early_stop and finished >= ts.spec.early_stop and ts.cancel_reason is None:
            ts.cancel_reason = f"early stop: {finished} of {ts.spec.num_samples} sessions finished"
            self._stop_stragglers(ts, ts.cancel_reason)
        if ts.state in ("done", "cancelled") or not all(s.state in TERMINAL for s in latest):
            return
        user_cancel = ts.cancel_reason is not None and not ts.cancel_reason.startswith("early stop")
        ts.state = "cancelled" if user_cancel else "done"
        if ts.spec.callback_url:
            ts.callback_state = "pending"
            self._callbacks.append(ts.spec.task_id)
        self._dirty_tasks.add(ts.spec.task_id)
        self._task_event(ts.spec.task_id, ts.state, None, ts.cancel_reason)
        self._changed.notify_all()

    def group(self, task_id: str) -> dict:
        """The scored group, as posted to callback_url."""
        with self._lock:
            ts = self.tasks[task_id]
            return {"task_id": task_id, "state": ts.state, "metadata": ts.spec.metadata,
                    "sessions": [self._public(self.sessions[sid]) for sid in sorted(ts.latest.values())],
                    "attempts": [self._public(self.sessions[sid]) for sid in self._task_sessions(task_id)
                                 if sid not in ts.latest.values()]}

    @staticmethod
    def _public(s: SessionState) -> dict:
        return {"session_id": s.session_id, "sample": s.sample, "attempt": s.attempt, "state": s.state,
                "node_id": s.node_id, "reward": s.reward, "reason": s.reason, "stats": s.stats}

    # -- background loops ---------------------------------------------------------------
    def _reaper_loop(self) -> None:
        while not self._stop.wait(min(0.5, self.node_timeout / 4)):
            now = time.monotonic()
            with self._lock:
                for node in self.nodes.values():
                    if node.lost or node.in_flight or now - node.last_seen < self.node_timeout:
                        continue
                    node.lost = True
                    reason = f"node {node.node_id} lost: no heartbeat for {now - node.last_seen:.0f}s"
                    self._task_event(None, "node_lost", node.node_id, reason)
                    for s in self._live():
                        if s.node_id == node.node_id and s.state in NODE_STATES:
                            if s.cancel:
                                s.state, s.reason = "cancelled", self.tasks[s.task_id].cancel_reason
                                self._event(s, "cancelled", s.reason)
                            else:
                                self._retry(s, reason)
                            self._check_task(self.tasks[s.task_id])
                self._changed.notify_all()

    def _callback_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                due = list(dict.fromkeys(self._callbacks))
                self._callbacks.clear()
            for task_id in due:
                self._post_callback(task_id)
            self._stop.wait(0.1)

    def _post_callback(self, task_id: str) -> None:
        url = self.tasks[task_id].spec.callback_url
        body = self.group(task_id)
        for attempt in range(self.max_callback_tries):
            if self._stop.is_set():
                return
            ok = False
            try:
                r = self._client.post(url, json=body)
                ok = r.status_code < 300
            except httpx.HTTPError as e:
                log.warning("callback for %s failed: %s", task_id, e)
            with self._lock:
                ts = self.tasks[task_id]
                ts.callback_tries += 1
                if ok or attempt == self.max_callback_tries - 1:
                    ts.callback_state = "sent" if ok else "failed"
                self._dirty_tasks.add(task_id)
                self._task_event(task_id, f"callback_{'sent' if ok else 'failed'}", None, None)
                self._changed.notify_all()
            if ok:
                return
            self._stop.wait(self.callback_backoff * 2 ** attempt)

    # -- journal ---------------------------------------------------------------------
    def _event(self, s: SessionState, state: str, detail: str | None) -> None:
        self._dirty_sessions.add(s.session_id)
        self._events.append(store.Event(at=time.time(), task_id=s.task_id, session_id=s.session_id,
                                        state=state, node_id=s.node_id, detail=detail))

    def _task_event(self, task_id: str | None, state: str, node_id: str | None, detail: str | None) -> None:
        self._events.append(store.Event(at=time.time(), task_id=task_id or "", session_id=None,
                                        state=state, node_id=node_id, detail=detail))

    def _journal_loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            try:
                self.flush()
            except Exception:
                log.exception("saving rollout state failed; retrying")

    def flush(self) -> None:
        """Write every change since the last flush in one transaction."""
        with self._flush_lock:
            with self._lock:
                if not (self._dirty_tasks or self._dirty_sessions or self._events):
                    return
                tasks, sessions, events = self._dirty_tasks, self._dirty_sessions, self._events
                self._dirty_tasks, self._dirty_sessions, self._events = set(), set(), []
                batch = store.Batch(tasks=[self.tasks[t].row() for t in tasks],
                                    sessions=[self.sessions[s].row() for s in sessions], events=events)
            t0 = time.monotonic()
            try:
                store.save(self.db, batch)
                took = time.monotonic() - t0
                if took > 1.0:
                    log.warning("saving rollout state took %.1fs", took)
            except BaseException:
                with self._lock:   # keep them for the next try
                    self._dirty_tasks |= tasks
                    self._dirty_sessions |= sessions
                    self._events[:0] = events
                raise


def _handler(server: RolloutServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            n = int(self.headers.get("content-length") or 0)
            return json.loads(self.rfile.read(n) or b"null")

        def do_GET(self):
            parts = self.path.strip("/").split("/")
            if parts == ["status"]:
                return self._send(200, server.status())
            if parts[0] == "tasks" and len(parts) == 2:
                st = server.task_status(parts[1])
                return self._send(200, st) if st else self._send(404, {"error": {"message": "no such task"}})
            if parts == ["policy"]:
                return self._send(200, server.policy_status())
            if len(parts) == 3 and parts[0] == "tasks" and parts[2] == "group":
                if parts[1] not in server.tasks:
                    return self._send(404, {"error": {"message": "no such task"}})
                return self._send(200, server.group(parts[1]))
            if parts == ["tasks"]:
                with server._lock:
                    return self._send(200, {"tasks": [{"task_id": t, "state": ts.state}
                                                      for t, ts in server.tasks.items()]})
            self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            parts = self.path.strip("/").split("/")
            try:
                body = self._body()
            except ValueError as e:
                return self._send(400, {"error": {"message": f"invalid JSON: {e}"}})
            try:
                if parts == ["nodes", "heartbeat"]:
                    try:
                        reply = server.heartbeat(body)
                    except Exception as e:   # not saved: the node keeps its events and retries
                        log.exception("heartbeat failed")
                        return self._send(503, {"error": {"message": f"state not saved: {e}"}})
                    return self._send(200, reply)
                if parts == ["policy"]:
                    if not isinstance(body, dict) or not isinstance(body.get("version"), int) \
                            or not isinstance(body.get("checkpoint"), str):
                        raise TypeError('expected {"version": N, "checkpoint": DIR, "asleep": false}')
                    return self._send(200, server.set_policy(body["version"], body["checkpoint"],
                                                             bool(body.get("asleep", False))))
                if parts == ["groups"]:
                    ids = (body or {}).get("task_ids") or []
                    missing = [t for t in ids if t not in server.tasks]
                    if missing:
                        return self._send(404, {"error": {"message": f"no such task(s): {', '.join(missing[:5])}"}})
                    return self._send(200, {"groups": [server.group(t) for t in ids]})
                if parts == ["tasks"]:
                    specs = [parse_task(t) for t in (body if isinstance(body, list) else [body])]
                    out = [{"task_id": s.task_id, "sessions": server.submit(s)} for s in specs]
                    return self._send(202, {"tasks": out})
                if len(parts) == 3 and parts[0] == "tasks" and parts[2] == "cancel":
                    ok = server.cancel(parts[1], (body or {}).get("reason") or "cancelled by request")
                    return self._send(200 if ok else 404, {"task_id": parts[1], "cancelled": ok})
            except TaskError as e:
                status = 409 if "already exists" in str(e) else 400
                return self._send(status, {"error": {"message": str(e)}})
            except (KeyError, TypeError) as e:
                return self._send(400, {"error": {"message": f"bad request: {e}"}})
            except Exception as e:    # e.g. the database stayed busy: the client may retry
                log.exception("request failed")
                return self._send(503, {"error": {"message": f"not saved yet, retry: {e}"}})
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    return Handler
