"""The rollout server's scheduling, as transitions: sessions through their states, tasks to
done or cancelled, nodes registered, lost and back, callbacks sent or given up.

Scheduler holds the tasks, sessions and nodes; each of its transitions takes an event (a
submitted task, a heartbeat, a reaper pass, a callback's result) and the time, changes that
state and returns the effects to perform: what to journal, which callback to post. There are
no threads, no I/O and no clock here; server.py holds the lock, reads the clock, writes the
journal, posts the callbacks and serves HTTP around it.

A session is one attempt at one sample of a task, named TASK~i (session_ids.py). An attempt
that ends without an outcome runs again: under the same name when no harness ran yet (the
node never got it, or handed it back before starting it), else under a new name TASK~i.rN,
so no two attempts share calls. One the node failed ("lost") counts towards max_attempts;
one it handed back ("released": it was stopped, its backend went down) never does. Releases
for the backend's sake (its calls failed on the backend, or their policy version is unknown)
are bounded apart: after max_releases of them the sample fails, unscored (no reward, not
even on_failure "zero"'s 0.0: the failure is not the policy's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Union

from .. import session_ids
from .protocol import (Assignment, Group, Heartbeat, NodePolicy, PolicyReport, SessionEvent, SessionResult, Status,
                       TaskBrief, TaskStatus)
from .spec import TaskChanged, TaskExists, TaskRequest, spec_changes
from .states import (FINISHED, NODE_STATES, NOT_STARTED, ORDER, RELEASE_CAUSE, TASK_SETTLED, TERMINAL, UNSCORED,
                     Callback, ReleaseCause, ServerEvent, Session, Task)


# -- state -----------------------------------------------------------------------------------
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
    assigned_at: float = 0.0     # monotonic seconds: when its node got it
    cancel: bool = False         # its task is stopping it: the node is told to cancel it

    def result(self) -> SessionResult:
        return SessionResult(session_id=self.session_id, sample=self.sample, attempt=self.attempt,
                             state=self.state, node_id=self.node_id, reward=self.reward, reason=self.reason,
                             stats=self.stats)


def release_cause(s: SessionState) -> ReleaseCause | None:
    """Why a released session was handed back, when that counts towards max_releases: the
    backend's failures (a release that names no cause included), not a stopped node."""
    raw = (s.stats or {}).get(RELEASE_CAUSE)
    try:
        cause = ReleaseCause(raw) if raw is not None else ReleaseCause.BACKEND_UNAVAILABLE
    except ValueError:
        cause = ReleaseCause.BACKEND_UNAVAILABLE
    return None if cause == ReleaseCause.NODE_STOPPED else cause


@dataclass(frozen=True)
class TaskView:
    """A task as the server held it at one moment: a copy, for callers outside its lock."""
    spec: TaskRequest
    state: Task
    callback_state: Callback | None
    cancel_reason: str | None


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

    def view(self) -> TaskView:
        return TaskView(self.spec, self.state, self.callback_state, self.cancel_reason)


@dataclass
class NodeState:
    node_id: str
    last_seen: float             # monotonic seconds
    previous_seen: float = 0.0
    load: dict = field(default_factory=dict)
    lost: bool = False
    in_flight: int = 0           # heartbeats being answered: a node waiting on us is alive
    policy: PolicyReport | None = None   # what it serves: version, checkpoint, asleep, target, error
    db: str | None = None        # its proxy's database (calls and rewards)


# -- effects: what the server does about a transition ---------------------------------------------
@dataclass(frozen=True)
class SessionMoved:
    """Journal a session: its row, and this event (node_id: its node at that moment)."""
    session_id: str
    task_id: str
    state: str
    node_id: str | None
    detail: str | None


@dataclass(frozen=True)
class TaskMoved:
    """Journal a task's row (its state, its callback's)."""
    task_id: str


@dataclass(frozen=True)
class Noted:
    """Journal an event of a task or of the server itself (no session)."""
    task_id: str | None
    state: str
    node_id: str | None
    detail: str | None


@dataclass(frozen=True)
class CallbackDue:
    """Post the task's scored group to its callback_url, try `attempt` (0: the first), in
    `delay` seconds."""
    task_id: str
    attempt: int
    delay: float = 0.0


Effect = Union[SessionMoved, TaskMoved, Noted, CallbackDue]


@dataclass(frozen=True)
class Answer:
    """The scheduler's part of a heartbeat's answer (the server adds the policy)."""
    assign: list[Assignment]
    cancel: list[str]
    settled: list[str]           # final outcomes held as their sample's: the node may store rewards


class Scheduler:
    def __init__(self, max_attempts: int = 3, node_timeout: float = 10.0, callback_tries: int = 8,
                 callback_backoff: float = 0.5, max_releases: int = 8):
        self.max_attempts, self.node_timeout = max_attempts, node_timeout
        self.max_releases = max_releases
        self.callback_tries, self.callback_backoff = callback_tries, callback_backoff
        self.tasks: dict[str, TaskState] = {}
        self.sessions: dict[str, SessionState] = {}
        # Those not finished yet (a finished one never runs again: a retry is a new session):
        # what heartbeats and the reaper look through, however many a long run has finished.
        self.open: dict[str, SessionState] = {}
        self.nodes: dict[str, NodeState] = {}
        self._effects: list[Effect] = []

    def _done(self) -> list[Effect]:
        out, self._effects = self._effects, []
        return out

    # -- restore ---------------------------------------------------------------------------
    def restore(self, tasks: list[TaskState], sessions: list[SessionState], now: float) -> list[Effect]:
        """A restarted server's journal, in order. Sessions on nodes wait node_timeout for
        their node to report back; a task that was stopping goes on stopping."""
        for ts in tasks:
            self.tasks[ts.spec.task_id] = ts
            if ts.callback_state == Callback.PENDING:
                self._effects.append(CallbackDue(ts.spec.task_id, 0))
        for s in sessions:
            ts = self.tasks[s.task_id]
            s.cancel = ts.cancel_reason is not None and s.state not in TERMINAL
            s.assigned_at = now
            self._add(s, ts)
            if s.state in NODE_STATES and s.node_id:
                self.nodes.setdefault(s.node_id, NodeState(s.node_id, now, now))
                self._moved(s, s.state, "server restarted; waiting for its node to report")
        return self._done()

    # -- tasks -----------------------------------------------------------------------------
    def check_new(self, spec: TaskRequest) -> None:
        """TaskExists for the same task again (a rerun resumes it), TaskChanged for another
        spec under its task_id."""
        ts = self.tasks.get(spec.task_id)
        if ts is None:
            return
        changes = spec_changes(ts.spec, spec)
        if changes:
            raise TaskChanged(spec.task_id, changes)
        raise TaskExists(f"task {spec.task_id} already exists")

    def submit(self, spec: TaskRequest) -> tuple[list[str], list[Effect]]:
        """A task's sessions, one per sample, pending."""
        self.check_new(spec)
        ts = TaskState(spec, len(self.tasks))
        self.tasks[spec.task_id] = ts
        self._effects.append(TaskMoved(spec.task_id))
        ids = []
        for i, sid in enumerate(spec.session_ids()):
            s = SessionState(sid, spec.task_id, i)
            self._add(s, ts)
            self._moved(s, Session.PENDING, None)
            ids.append(sid)
        return ids, self._done()

    def cancel(self, task_id: str, reason: str) -> tuple[bool, list[Effect]]:
        """Stop a task's unfinished sessions: pending ones at once, the others through their
        nodes. False: no such task."""
        ts = self.tasks.get(task_id)
        if ts is None:
            return False, []
        if ts.state not in TASK_SETTLED:
            self._stopping(ts, reason)
            self._check_task(ts)
        return True, self._done()

    # -- a node's heartbeat ------------------------------------------------------------------
    def heartbeat(self, body: Heartbeat, now: float) -> tuple[Answer, list[Effect]]:
        """A node is heard: its load, its sessions' state changes (settled: the final outcomes
        held as their sample's), the sessions it no longer holds (run again), and as many
        pending sessions for it as it has free places, highest priority first. The node stays
        in flight (alive, whatever the clock says) until answered()."""
        node_id = str(body["node_id"])
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeState(node_id, now, now)
            self._effects.append(Noted(None, ServerEvent.NODE_REGISTERED, node_id, None))
        elif node.lost:
            node.lost = False
            self._effects.append(Noted(None, ServerEvent.NODE_RETURNED, node_id, None))
        node.in_flight += 1
        node.previous_seen, node.last_seen, node.load = node.last_seen, now, dict(body.get("load") or {})
        node.policy, node.db = body.get("policy") or node.policy, body.get("db") or node.db
        active = set(body.get("active") or [])
        reported, settled = set(), []
        for ev in body.get("events") or []:
            reported.add(ev.get("session_id"))
            if self._apply(node_id, ev):
                settled.append(ev["session_id"])
        cancel = [sid for sid in active
                  if sid not in self.sessions or self.sessions[sid].node_id != node_id
                  or self.sessions[sid].state in TERMINAL or self.sessions[sid].cancel]
        for s in self.live():
            if (s.node_id == node_id and s.state in NODE_STATES and s.session_id not in active
                    and s.session_id not in reported and s.assigned_at < node.previous_seen):
                self._requeue(s, f"node {node_id} no longer holds it")
        assign = self._assign(node, int((body.get("load") or {}).get("free", 0)), now)
        return Answer(assign, cancel, settled), self._done()

    def answered(self, node_id: str, now: float) -> None:
        """Its heartbeat's answer went out (or failed): node_timeout counts from now."""
        node = self.nodes[node_id]
        node.in_flight -= 1
        node.last_seen = now

    def _apply(self, node_id: str, ev: SessionEvent) -> bool:
        """One reported state change; True when it is a final outcome the server holds."""
        s = self.sessions.get(ev.get("session_id", ""))
        state = ev.get("state")
        if s is None or s.node_id != node_id:
            return False   # stale: the session moved on (lost node, retried elsewhere)
        if s.state in TERMINAL:   # the same outcome again (our answer was lost) is still settled
            return s.state == state
        if state == Session.RELEASED:      # the node stopped, or its backend went down: run it again
            if ev.get("stats") is not None:   # kept with the attempt: why (release_cause), its output
                s.stats = ev["stats"]
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
        self._moved(s, s.state, ev.get("reason"))
        if s.state in TERMINAL:
            self._check_task(self.tasks[s.task_id])
        return s.state in TERMINAL

    def _share(self, node: NodeState, free: int, pending: int) -> int:
        """How many of the pending sessions this node takes now: its part of them by its free
        places against every live node's (as each last reported them), so that sessions spread
        over the nodes (and the replicas behind them) by load instead of going to whichever
        node is heard first; at least one, and never more than it has room for."""
        total = free + sum(max(0, int(n.load.get("free", 0) or 0)) for n in self.nodes.values()
                           if n is not node and not n.lost)
        return min(free, max(1, -(-pending * free // max(total, 1))))

    def _assign(self, node: NodeState, free: int, now: float) -> list[Assignment]:
        """Leases: up to `free` pending sessions, highest priority first, then in order."""
        if free <= 0:
            return []
        pending = [s for s in self.live() if s.state == Session.PENDING and not s.cancel]
        pending.sort(key=lambda s: (-self.tasks[s.task_id].spec.priority, self.tasks[s.task_id].order, s.sample))
        out = []
        for s in pending[:self._share(node, free, len(pending))]:
            s.state, s.node_id, s.assigned_at = Session.ASSIGNED, node.node_id, now
            ts = self.tasks[s.task_id]
            if ts.state == Task.QUEUED:
                ts.state = Task.RUNNING
                self._effects.append(TaskMoved(ts.spec.task_id))
            self._moved(s, Session.ASSIGNED, None)
            out.append(Assignment(session_id=s.session_id, task=ts.spec.to_json(), attempt=s.attempt))
        return out

    # -- the reaper ----------------------------------------------------------------------------
    def reap(self, now: float) -> list[Effect]:
        """Nodes not heard from for node_timeout (and not waiting on an answer) are lost: their
        sessions run again, each as a new attempt that counts as failed."""
        for node in self.nodes.values():
            if node.lost or node.in_flight or now - node.last_seen < self.node_timeout:
                continue
            node.lost = True
            reason = f"node {node.node_id} lost: no heartbeat for {now - node.last_seen:.0f}s"
            self._effects.append(Noted(None, ServerEvent.NODE_LOST, node.node_id, reason))
            for s in self.live():
                if s.node_id == node.node_id and s.state in NODE_STATES:
                    # a lost node may still be running it: a new name even if it never started
                    self._requeue(s, reason, reuse_name=False)
        return self._done()

    # -- attempts --------------------------------------------------------------------------------
    def _requeue(self, s: SessionState, reason: str, counted: bool = True, reuse_name: bool = True) -> None:
        """Its node does not have it any more: it never got it or restarted (counted: a failed
        attempt), handed it back (not counted), or was lost (counted; reuse_name False). A
        stopping task's session ends cancelled; one no harness ran for runs again under the
        same name (reuse_name); else a new attempt."""
        ts = self.tasks[s.task_id]
        if s.cancel:
            s.state, s.reason = Session.CANCELLED, ts.cancel_reason or "cancelled"
            self._moved(s, s.state, s.reason)
        elif reuse_name and s.state in NOT_STARTED:
            s.state, s.node_id, s.reason = Session.PENDING, None, reason   # no harness ran: same name
            self._moved(s, Session.PENDING, reason)
        else:
            self._retry(s, reason, counted)
        self._check_task(ts)

    def _retry(self, s: SessionState, reason: str, counted: bool = True) -> None:
        """A new attempt under a new name: the calls of the lost one stay apart, unrewarded.
        counted: the node failed it ("lost"; max_attempts of those fail the sample); else it
        was handed back ("released": a stopped node, a backend down) and never fails it."""
        ts = self.tasks[s.task_id]
        s.state, s.reason = (Session.LOST if counted else Session.RELEASED), reason
        self._moved(s, s.state, reason)
        failures = sum(1 for sid in ts.attempts
                       if self.sessions[sid].sample == s.sample and self.sessions[sid].state == Session.LOST)
        cause = release_cause(s)
        if not s.cancel and not counted and cause is not None:
            releases = sum(1 for sid in ts.attempts if self.sessions[sid].sample == s.sample
                           and self.sessions[sid].state == Session.RELEASED
                           and release_cause(self.sessions[sid]) is not None)
            if releases >= self.max_releases:
                # the backend's failures, not the policy's: no reward at all
                s.state = Session.FAILED
                s.reason = f"{reason}; released {releases} times ({cause.label}): not scored"
                s.stats = {**(s.stats or {}), UNSCORED: cause.value}
                self._moved(s, s.state, s.reason)
                return
        if s.cancel or (counted and failures >= self.max_attempts):
            s.state = Session.FAILED if not s.cancel else Session.CANCELLED
            s.reason = f"{reason}; {failures} failed attempts" if not s.cancel else (ts.cancel_reason or "cancelled")
            self._moved(s, s.state, s.reason)
            return
        n = SessionState(session_ids.make(ts.spec.task_id, s.sample, s.attempt + 1), s.task_id, s.sample,
                         s.attempt + 1)
        self._add(n, ts)
        self._moved(n, Session.PENDING, f"retry of {s.session_id}")

    def _add(self, s: SessionState, ts: TaskState) -> None:
        """A new session (or attempt), now the current one of its sample."""
        self.sessions[s.session_id] = s
        ts.latest[s.sample] = s.session_id
        ts.attempts.append(s.session_id)
        if s.state not in TERMINAL:
            self.open[s.session_id] = s

    def live(self) -> list[SessionState]:
        """The sessions not finished, dropping from `open` those that finished since."""
        live = []
        for sid, s in list(self.open.items()):
            if s.state in TERMINAL:
                del self.open[sid]
            else:
                live.append(s)
        return live

    def _stopping(self, ts: TaskState, reason: str) -> None:
        """The task's unfinished sessions stop: pending ones now, the rest through their nodes.
        Why is journaled (a restarted server goes on stopping them, for the same reason)."""
        ts.cancel_reason = reason
        self._effects.append(Noted(ts.spec.task_id, ServerEvent.STOPPING, None, reason))
        for sid in ts.latest.values():
            s = self.sessions[sid]
            if s.state in TERMINAL:
                continue
            s.cancel = True
            if s.state == Session.PENDING:
                s.state, s.reason = Session.CANCELLED, reason
                self._moved(s, Session.CANCELLED, reason)

    def _check_task(self, ts: TaskState) -> None:
        """Early stop once enough samples finished; the task settles once every sample has."""
        latest = [self.sessions[sid] for sid in ts.latest.values()]
        finished = sum(1 for s in latest if s.state in FINISHED)
        if ts.spec.early_stop and finished >= ts.spec.early_stop and ts.cancel_reason is None:
            self._stopping(ts, f"early stop: {finished} of {ts.spec.num_samples} sessions finished")
        if ts.state in TASK_SETTLED or not all(s.state in TERMINAL for s in latest):
            return
        user_cancel = ts.cancel_reason is not None and not ts.cancel_reason.startswith("early stop")
        ts.state = Task.CANCELLED if user_cancel else Task.DONE
        if ts.spec.callback_url:
            ts.callback_state = Callback.PENDING
            self._effects.append(CallbackDue(ts.spec.task_id, 0))
        self._effects.append(TaskMoved(ts.spec.task_id))
        self._effects.append(Noted(ts.spec.task_id, ts.state, None, ts.cancel_reason))

    def _moved(self, s: SessionState, state: str, detail: str | None) -> None:
        self._effects.append(SessionMoved(s.session_id, s.task_id, state, s.node_id, detail))

    # -- callbacks ---------------------------------------------------------------------------------
    def callback_result(self, task_id: str, attempt: int, ok: bool, error: str | None) -> list[Effect]:
        """One try of a task's callback: sent, tried again after a backoff, or given up after
        callback_tries."""
        ts = self.tasks[task_id]
        ts.callback_tries += 1
        if ok or attempt + 1 >= self.callback_tries:
            ts.callback_state = Callback.SENT if ok else Callback.FAILED
        else:
            self._effects.append(CallbackDue(task_id, attempt + 1, self.callback_backoff * 2 ** attempt))
        self._effects.append(TaskMoved(task_id))
        self._effects.append(Noted(task_id, ServerEvent.CALLBACK_SENT if ok else ServerEvent.CALLBACK_FAILED, None,
                                   None if ok else error))
        return self._done()

    # -- views -------------------------------------------------------------------------------------
    def group(self, task_id: str) -> Group:
        """The scored group, as posted to callback_url."""
        ts = self.tasks[task_id]
        current = set(ts.latest.values())
        return Group(task_id=task_id, state=ts.state, metadata=ts.spec.metadata,
                     sessions=[self.sessions[sid].result() for sid in sorted(current)],
                     attempts=[self.sessions[sid].result() for sid in ts.attempts if sid not in current])

    def task_status(self, task_id: str) -> TaskStatus | None:
        ts = self.tasks.get(task_id)
        if ts is None:
            return None
        return TaskStatus(task_id=task_id, state=ts.state, callback_state=ts.callback_state,
                          sessions=[self.sessions[sid].result() for sid in ts.attempts])

    def task_views(self, task_ids: Iterable[str] | None = None) -> dict[str, TaskView]:
        """Those of these tasks it holds (None: every one), as they are now."""
        ids = list(self.tasks) if task_ids is None else [t for t in task_ids if t in self.tasks]
        return {t: self.tasks[t].view() for t in ids}

    def task_list(self) -> list[TaskBrief]:
        return [TaskBrief(task_id=t, state=ts.state) for t, ts in self.tasks.items()]

    def status(self, now: float) -> Status:
        counts: dict[str, int] = {}
        for ts in self.tasks.values():
            for sid in ts.latest.values():
                st = self.sessions[sid].state
                counts[st] = counts.get(st, 0) + 1
        rewards = [s.reward for s in self.sessions.values() if s.reward is not None]
        return Status(tasks={k: sum(1 for t in self.tasks.values() if t.state == k) for k in Task},
                      sessions={k: counts[k] for k in ORDER if k in counts},
                      rewards={"n": len(rewards), "mean": sum(rewards) / len(rewards) if rewards else None},
                      nodes={n.node_id: {"lost": n.lost, "seen_s_ago": round(now - n.last_seen, 1), **n.load}
                             for n in self.nodes.values()})

    def node_policies(self) -> dict[str, NodePolicy]:
        return {n.node_id: NodePolicy(lost=n.lost, policy=n.policy, db=n.db) for n in self.nodes.values()}
