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

This class is the server's state and its Python API; http_api.py serves the same over HTTP
(FastAPI on uvicorn, in a thread started by start()), and states.py holds the states.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from ..store import rollouts as store
from .http_api import ThreadedUvicorn, make_app
from .spec import TaskChanged, TaskExists, TaskRequest, check_workspace, parse_task, spec_changes, task_from_json
from .states import (FINISHED, NODE_STATES, NOT_STARTED, ORDER, TASK_SETTLED, TERMINAL, Callback, ServerEvent,
                     Session, Task)

log = logging.getLogger("polar.rollout")

# The states of sessions, tasks and callbacks (and TERMINAL, FINISHED, NODE_STATES, ORDER):
# states.py. An attempt ends "lost" when its node failed it, "released" when its node handed it
# back (that never counts as a failed attempt).
__all__ = ["RolloutServer", "TERMINAL", "FINISHED", "NODE_STATES", "ORDER"]


@dataclass
class SessionState:
    session_id: str
    task_id: str
    sample: int
    attempt: int = 1
    state: Session = Session.PENDING
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
    state: Task = Task.QUEUED
    callback_state: Callback | None = None
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
                 callback_backoff: float = 0.5, callback_timeout: float = 10.0, callback_workers: int = 16,
                 check_workspaces: bool = True):
        self.db, self.node_timeout, self.max_attempts = str(db), node_timeout, max_attempts
        self.flush_s, self.max_callback_tries, self.callback_backoff = flush_s, callback_tries, callback_backoff
        self.callback_workers = callback_workers
        # A task's workspace is checked on submission (it must be there on this machine: with
        # nodes elsewhere and workspaces only there, turn it off).
        self.check_workspaces = check_workspaces
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
        # callbacks to post: (when, attempt, task_id), each task on its own schedule
        self._callbacks: list[tuple[float, int, str]] = []
        self._callback_tasks: set[str] = set()       # queued or being posted
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The HTTP API (http_api.py: FastAPI on uvicorn, in a thread); bound here, so port 0
        # (any free port) is known in .url at once.
        self._http = ThreadedUvicorn(make_app(self), host, port, name="rollout-http")
        self.url = f"http://{host}:{self._http.port}"
        self._client = httpx.Client(timeout=httpx.Timeout(callback_timeout, connect=min(5.0, callback_timeout)),
                                    trust_env=False, limits=httpx.Limits(max_connections=callback_workers))

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "RolloutServer":
        store.ensure(self.db)
        self._restore()
        for name, fn in (("journal", self._journal_loop), ("reaper", self._reaper_loop),
                         ("callbacks", self._callback_loop)):
            t = threading.Thread(target=fn, name=f"rollout-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self._http.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._http.stop()
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
                ts = TaskState(task_from_json(t["spec"]), i, Task(t["state"]),
                               Callback(t["callback_state"]) if t["callback_state"] else None, t["callback_tries"])
                self.tasks[ts.spec.task_id] = ts
                if ts.callback_state == Callback.PENDING:
                    self._queue_callback(ts.spec.task_id)
            for r in sessions:
                s = SessionState(r["session_id"], r["task_id"], r["sample"], r["attempt"], Session(r["state"]),
                                 r["node_id"], r["reward"], r["reason"], r["stats"], assigned_at=now)
                self._add(s, self.tasks[s.task_id])
                if s.state in NODE_STATES and s.node_id:
                    # Its node gets node_timeout to report back before the session moves.
                    self.nodes.setdefault(s.node_id, NodeState(s.node_id, now, now))
                    self._event(s, s.state, "server restarted; waiting for its node to report")

    # -- Python API ----------------------------------------------------------------------
    def submit(self, task: TaskRequest | dict) -> list[str]:
        """Queue a task; returns its session ids once they are durable in the database. The
        same task again raises TaskExists (a rerun resumes it); another spec under the same
        task_id raises TaskChanged; a workspace that is not there, a TaskError."""
        spec = task if isinstance(task, TaskRequest) else parse_task(task)
        self._known(spec)
        if self.check_workspaces:
            check_workspace(spec)
        with self._lock:
            self._known(spec)       # again: another submission may have come in meanwhile
            ts = TaskState(spec, len(self.tasks))
            self.tasks[spec.task_id] = ts
            self._dirty_tasks.add(spec.task_id)
            ids = []
            for i, sid in enumerate(spec.session_ids()):
                s = SessionState(sid, spec.task_id, i)
                self._add(s, ts)
                self._event(s, Session.PENDING, None)
                ids.append(sid)
        self.flush()
        return ids

    def _known(self, spec: TaskRequest) -> None:
        with self._lock:
            ts = self.tasks.get(spec.task_id)
            if ts is None:
                return
            changes = spec_changes(ts.spec, spec)
        if changes:
            raise TaskChanged(spec.task_id, changes)
        raise TaskExists(f"task {spec.task_id} already exists")

    def cancel(self, task_id: str, reason: str = "cancelled by request") -> bool:
        with self._lock:
            ts = self.tasks.get(task_id)
            if ts is None:
                return False
            if ts.state in TASK_SETTLED:
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

    def task_list(self) -> list[dict]:
        """Every task and its state, in the order submitted."""
        with self._lock:
            return [{"task_id": t, "state": ts.state} for t, ts in self.tasks.items()]

    def status(self) -> dict:
        with self._lock:
            counts: dict[str, int] = {}
            for ts in self.tasks.values():
                for sid in ts.latest.values():
                    st = self.sessions[sid].state
                    counts[st] = counts.get(st, 0) + 1
            rewards = [s.reward for s in self.sessions.values() if s.reward is not None]
            return {"tasks": {k: sum(1 for t in self.tasks.values() if t.state == k)
                              for k in Task},
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
                if all(self.tasks[t].state in TASK_SETTLED
                       and self.tasks[t].callback_state in (None, Callback.SENT, Callback.FAILED) for t in ids):
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
                self._task_event(None, ServerEvent.NODE_REGISTERED, node_id, None)
            elif node.lost:
                node.lost = False
                self._task_event(None, ServerEvent.NODE_RETURNED, node_id, None)
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
        if state == Session.RELEASED:      # the node stopped, or its backend went down: run it again
            self._requeue(s, ev.get("reason") or f"released by node {node_id}", counted=False)
            return False
        if state not in ORDER:
            return False
        s.state = Session(state)
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
        pending = [s for s in self._live() if s.state == Session.PENDING and not s.cancel]
        pending.sort(key=lambda s: (-self.tasks[s.task_id].spec.priority, self.tasks[s.task_id].order, s.sample))
        out = []
        for s in pending[:free]:
            s.state, s.node_id, s.assigned_at = Session.ASSIGNED, node.node_id, time.monotonic()
            ts = self.tasks[s.task_id]
            if ts.state == Task.QUEUED:
                ts.state = Task.RUNNING
                self._dirty_tasks.add(ts.spec.task_id)
            self._event(s, Session.ASSIGNED, None)
            out.append({"session_id": s.session_id, "task": ts.spec.to_json(), "attempt": s.attempt})
        return out

    def _requeue(self, s: SessionState, reason: str, counted: bool = True) -> None:
        """The node does not have it (never got it, or restarted; counted: a failed attempt),
        or handed it back (not counted): run it again."""
        ts = self.tasks[s.task_id]
        if s.cancel:
            s.state, s.reason = Session.CANCELLED, ts.cancel_reason or "cancelled"
            self._event(s, s.state, s.reason)
        elif s.state in NOT_STARTED:
            s.state, s.node_id, s.reason = Session.PENDING, None, reason   # no harness ran: same name
            self._event(s, Session.PENDING, reason)
        else:
            self._retry(s, reason, counted)
        self._check_task(ts)

    def _retry(self, s: SessionState, reason: str, counted: bool = True) -> None:
        """A new attempt under a new name: the calls of the lost one stay apart, unrewarded.
        counted: the node failed it ("lost"; max_attempts of those fail the sample); else it
        was handed back ("released": a stopped node, a backend down) and never fails it."""
        ts = self.tasks[s.task_id]
        s.state, s.reason = (Session.LOST if counted else Session.RELEASED), reason
        self._event(s, s.state, reason)
        failures = sum(1 for sid in ts.attempts
                       if self.sessions[sid].sample == s.sample and self.sessions[sid].state == Session.LOST)
        if s.cancel or (counted and failures >= self.max_attempts):
            s.state = Session.FAILED if not s.cancel else Session.CANCELLED
            s.reason = f"{reason}; {failures} failed attempts" if not s.cancel else (ts.cancel_reason or "cancelled")
            self._event(s, s.state, s.reason)
            return
        n = SessionState(f"{ts.spec.task_id}~{s.sample}.r{s.attempt + 1}", s.task_id, s.sample, s.attempt + 1)
        self._add(n, ts)
        self._event(n, Session.PENDING, f"retry of {s.session_id}")

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
            if s.state == Session.PENDING:
                s.state, s.reason = Session.CANCELLED, reason
                self._event(s, Session.CANCELLED, reason)

    def _check_task(self, ts: TaskState) -> None:
        latest = [self.sessions[sid] for sid in ts.latest.values()]
        finished = sum(1 for s in latest if s.state in FINISHED)
        if ts.spec.early_stop and finished >= ts.spec.early_stop and ts.cancel_reason is None:
            ts.cancel_reason = f"early stop: {finished} of {ts.spec.num_samples} sessions finished"
            self._stop_stragglers(ts, ts.cancel_reason)
        if ts.state in TASK_SETTLED or not all(s.state in TERMINAL for s in latest):
            return
        user_cancel = ts.cancel_reason is not None and not ts.cancel_reason.startswith("early stop")
        ts.state = Task.CANCELLED if user_cancel else Task.DONE
        if ts.spec.callback_url:
            ts.callback_state = Callback.PENDING
            self._queue_callback(ts.spec.task_id)
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
                    self._task_event(None, ServerEvent.NODE_LOST, node.node_id, reason)
                    for s in self._live():
                        if s.node_id == node.node_id and s.state in NODE_STATES:
                            if s.cancel:
                                s.state, s.reason = Session.CANCELLED, self.tasks[s.task_id].cancel_reason
                                self._event(s, Session.CANCELLED, s.reason)
                            else:
                                self._retry(s, reason)
                            self._check_task(self.tasks[s.task_id])
                self._changed.notify_all()

    def _queue_callback(self, task_id: str) -> None:
        """The scored group goes to the task's callback_url (under self._lock)."""
        if task_id not in self._callback_tasks:
            self._callback_tasks.add(task_id)
            heapq.heappush(self._callbacks, (time.monotonic(), 0, task_id))

    def _callback_loop(self) -> None:
        """Callbacks go out concurrently, each task on its own schedule of retries: one
        receiver that hangs or is down delays no other task's group."""
        pool = ThreadPoolExecutor(self.callback_workers, thread_name_prefix="rollout-callback")
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                with self._lock:
                    due = []
                    while self._callbacks and self._callbacks[0][0] <= now:
                        due.append(heapq.heappop(self._callbacks))
                for _, attempt, task_id in due:
                    pool.submit(self._post_callback, task_id, attempt)
                self._stop.wait(0.05)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _post_callback(self, task_id: str, attempt: int) -> None:
        """One try; a failed one is tried again after a backoff, until callback_tries."""
        if self._stop.is_set():
            return        # still "pending" in the database: a restarted server sends it
        url = self.tasks[task_id].spec.callback_url
        body = self.group(task_id)
        ok, error = False, None
        try:
            r = self._client.post(url, json=body)
            ok, error = r.status_code < 300, f"HTTP {r.status_code}"
        except Exception as e:   # httpx's errors; at stop, the client closed under it
            if self._stop.is_set():
                return
            error = str(e) or type(e).__name__
        if not ok:
            log.warning("callback for %s (try %d) failed: %s", task_id, attempt + 1, error)
        with self._lock:
            ts = self.tasks[task_id]
            ts.callback_tries += 1
            if ok or attempt + 1 >= self.max_callback_tries:
                ts.callback_state = Callback.SENT if ok else Callback.FAILED
                self._callback_tasks.discard(task_id)
            else:
                heapq.heappush(self._callbacks,
                               (time.monotonic() + self.callback_backoff * 2 ** attempt, attempt + 1, task_id))
            self._dirty_tasks.add(task_id)
            self._task_event(task_id, ServerEvent.CALLBACK_SENT if ok else ServerEvent.CALLBACK_FAILED, None,
                             None if ok else error)
            self._changed.notify_all()

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

