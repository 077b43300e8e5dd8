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

This class is the shell around the scheduling (scheduler.py: the states and their
transitions, pure): it holds the lock and the threads, reads the clock, keeps the journal
(store/rollout_journal.py), posts the callbacks, and is the Python API; http_api.py serves the
same over HTTP (FastAPI on uvicorn, in a thread started by start()), with the messages of
protocol.py.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import httpx

from ..store import rollout_journal as journal
from ..store.journal_log import JournalLog
from .http_api import ThreadedUvicorn, make_app
from .protocol import (Group, Heartbeat, HeartbeatReply, PolicyStatus, PolicyTarget, Status, TaskBrief,
                       TaskStatus, WeightPull)
from .scheduler import (CallbackDue, Effect, Noted, Scheduler, SessionMoved, SessionState, TaskMoved, TaskState,
                        TaskView)
from .shipped_files import BlobStore, ship
from .spec import TaskRequest, check_workspace, parse_task, task_from_json
from .web_guard import guarded, is_loopback
from .states import TASK_SETTLED, Callback, Session, Task

log = logging.getLogger("polar.rollout")


class RolloutServer:
    def __init__(self, db: str, *, host: str = "127.0.0.1", port: int = 0, node_timeout: float = 10.0,
                 max_attempts: int = 3, flush_s: float = 0.2, fold_s: float = 30.0, callback_tries: int = 8,
                 callback_backoff: float = 0.5, callback_timeout: float = 10.0, callback_workers: int = 16,
                 check_workspaces: bool = True, scheduler: Scheduler | None = None, max_releases: int = 8,
                 token: str | None = None, allowed_hosts: Iterable[str] = (), ship_files: bool = False,
                 files_dir: str | None = None):
        self.db, self.flush_s, self.callback_workers = str(db), flush_s, callback_workers
        # ship_files: every local path a task names is packed at submission into a blob of
        # files_dir (default DB.files/), recorded in the task (TaskRequest.files) and served
        # to the nodes (GET /files/{sha256}), which cache it: nodes on other machines need
        # none of this machine's paths (shipped_files.py, files_cache.py).
        self.blobs = BlobStore(files_dir or f"{self.db}.files") if ship_files else None
        # The API answers only its own Host names (loopback, the address it listens on,
        # allowed_hosts) and takes no state change without a JSON body (web_guard.py). token:
        # every request must carry it as a bearer token; listening beyond loopback, one is made
        # when none is given (.token: the nodes and clients need it).
        if token is None and not is_loopback(host):
            token = secrets.token_urlsafe(32)
        self.token = token
        # Each change is durable in the journal log (journal_log.py) before it is acted on,
        # and folded into the database's rollout tables every fold_s seconds, or when asked
        # (fold_soon). A fold's DuckDB writes and checkpoint slow the saves that share the disk
        # with it (they overlapped 14 of 21 saves over 15 ms at a 2 s period, while busy 18% of
        # the time), so it runs seldom; readers see unfolded state through the log (load()).
        self.fold_s = fold_s
        self._fold_now = threading.Event()
        self._fold_waiters: list[threading.Event] = []
        self._fold_waiters_lock = threading.Lock()
        self._log: JournalLog | None = None
        self._save_ms: list[float] = []     # the log's saves since journal_stats(reset=True)
        # The states and their transitions (a given scheduler brings its own settings).
        # max_releases: releases of one sample for the backend's sake before it fails unscored
        self.scheduler = scheduler or Scheduler(max_attempts=max_attempts, node_timeout=node_timeout,
                                                callback_tries=callback_tries, callback_backoff=callback_backoff,
                                                max_releases=max_releases)
        # A task's workspace is checked on submission (it must be there on this machine: with
        # nodes elsewhere and workspaces only there, turn it off).
        self.check_workspaces = check_workspaces
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._flush_lock = threading.Lock()
        self._fold_lock = threading.Lock()
        self.policy: PolicyTarget | None = None     # the target every node syncs to (set_policy)
        self._dirty_tasks: set[str] = set()
        self._dirty_sessions: set[str] = set()
        self._events: list[journal.Event] = []
        self._last_us = 0
        # callbacks to post: (when, attempt, task_id), each task on its own schedule
        self._callbacks: list[tuple[float, int, str]] = []
        self._callback_tasks: set[str] = set()       # queued or being posted
        self._callback_errors: dict[str, str] = {}   # task_id -> why its last try failed
        self.callback_timeout = callback_timeout
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The HTTP API (http_api.py: FastAPI on uvicorn, in a thread); bound here, so port 0
        # (any free port) is known in .url at once.
        self._http = ThreadedUvicorn(guarded(make_app(self), host, allowed_hosts, token), host, port,
                                     name="rollout-http")
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self._http.port}"
        self._client = httpx.Client(timeout=httpx.Timeout(callback_timeout, connect=min(5.0, callback_timeout)),
                                    trust_env=False, limits=httpx.Limits(max_connections=callback_workers))

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "RolloutServer":
        journal.ensure(self.db)
        self._journal_log()
        self.fold()          # what a server killed -9 left in the log, before reading it all
        self._restore()
        for name, fn in (("journal", self._journal_loop), ("fold", self._fold_loop), ("reaper", self._reaper_loop),
                         ("callbacks", self._callback_loop)):
            t = threading.Thread(target=fn, name=f"rollout-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self._http.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._fold_now.set()
        self._http.stop()
        with self._changed:
            self._changed.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)
        try:
            self.flush()
            self.fold()   # the log keeps what a failed fold left: the next server or `sql` folds it
        finally:
            if self._log is not None:
                self._log.close()
            self._client.close()

    def _restore(self) -> None:
        tasks, sessions = journal.load(self.db)
        restored = [TaskState(task_from_json(t["spec"]), i, Task(t["state"]),
                              Callback(t["callback_state"]) if t["callback_state"] else None, t["callback_tries"],
                              t["cancel_reason"])
                    for i, t in enumerate(tasks)]
        attempts = [SessionState(r["session_id"], r["task_id"], r["sample"], r["attempt"], Session(r["state"]),
                                 r["node_id"], r["reward"], r["reason"], r["stats"]) for r in sessions]
        with self._lock:
            self._perform(self.scheduler.restore(restored, attempts, time.monotonic()))

    # -- Python API ----------------------------------------------------------------------
    def submit(self, task: TaskRequest | dict) -> list[str]:
        """Queue a task; returns its session ids once they are durable in the database. The
        same task again raises TaskExists (a rerun resumes it); another spec under the same
        task_id raises TaskChanged; a workspace that is not there (or, with ship_files, a path
        that cannot be shipped), a TaskError."""
        spec = task if isinstance(task, TaskRequest) else parse_task(task)
        with self._lock:
            self.scheduler.check_new(spec)
        if self.check_workspaces:
            check_workspace(spec)
        # a client's spec never brings files; without shipping, the nodes read the paths themselves
        if self.blobs is not None:
            spec = ship(spec, self.blobs)
        elif spec.files:
            spec = dataclasses.replace(spec, files={})
        with self._lock:        # checked again: another submission may have come in meanwhile
            ids, effects = self.scheduler.submit(spec)
            self._perform(effects)
        self.flush()
        return ids

    def cancel(self, task_id: str, reason: str = "cancelled by request") -> bool:
        with self._lock:
            found, effects = self.scheduler.cancel(task_id, reason)
            self._perform(effects)
        return found

    def task_status(self, task_id: str) -> TaskStatus | None:
        with self._lock:
            return self.scheduler.task_status(task_id)

    def task_views(self, task_ids: Iterable[str] | None = None) -> dict[str, TaskView]:
        """Those of these tasks it holds (None: every one), each a copy of its spec and states
        now: the scheduler's own records change under its lock, and are never handed out."""
        with self._lock:
            return self.scheduler.task_views(task_ids)

    def task_list(self) -> list[TaskBrief]:
        """Every task and its state, in the order submitted."""
        with self._lock:
            return self.scheduler.task_list()

    def group(self, task_id: str) -> Group:
        """The scored group, as posted to callback_url."""
        with self._lock:
            return self.scheduler.group(task_id)

    def status(self) -> Status:
        with self._lock:
            return self.scheduler.status(time.monotonic())

    def wait(self, task_ids: list[str] | None = None, timeout: float | None = None) -> bool:
        """Until the tasks are done or cancelled and their callbacks are settled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                tasks = self.scheduler.tasks
                ids = task_ids if task_ids is not None else list(tasks)
                if all(tasks[t].state in TASK_SETTLED
                       and tasks[t].callback_state in (None, Callback.SENT, Callback.FAILED) for t in ids):
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._stop.is_set():
                    return False
                self._changed.wait(timeout=min(0.5, left) if left is not None else 0.5)
        self.flush()
        try:
            self.fold()     # a caller that waited reads the outcome with SQL next
        except Exception:   # saved in the log all the same: the next fold brings it
            log.warning("folding the rollout journal into %s failed; SQL sees it at the next fold", self.db,
                        exc_info=True)
        return True

    def pending_callbacks(self, task_ids: list[str] | None = None) -> list[dict]:
        """The callbacks not settled yet (sent or given up), each {task_id, url, tries (made
        so far), of (tries in all), error (the last try's), next_in (seconds to the next try,
        0: being tried), left_s (at most this long until it is settled)}."""
        sched = self.scheduler
        with self._lock:
            due: dict[str, float] = {}
            for when, _, tid in self._callbacks:
                due[tid] = min(when, due.get(tid, when))
            now, out = time.monotonic(), []
            for tid in (task_ids if task_ids is not None else list(sched.tasks)):
                ts = sched.tasks.get(tid)
                if ts is None or ts.callback_state != Callback.PENDING:
                    continue
                tries = ts.callback_tries
                # each try left may take the client's timeout, and waits its backoff before
                left = sum(self.callback_timeout + (sched.callback_backoff * 2 ** (a - 1) if a else 0.0)
                           for a in range(tries, sched.callback_tries))
                out.append({"task_id": tid, "url": ts.spec.callback_url, "tries": tries, "of": sched.callback_tries,
                            "error": self._callback_errors.get(tid),
                            "next_in": max(0.0, due[tid] - now) if tid in due else 0.0, "left_s": left})
        return out

    def file_blob(self, sha256: str) -> str | None:
        """The blob a task's files were packed into (ship_files), for GET /files/{sha256}:
        its file, or None where this server packed no such blob."""
        found = self.blobs.path_of(sha256) if self.blobs is not None else None
        return str(found) if found is not None else None

    # -- the policy the nodes serve ----------------------------------------------------------
    def set_policy(self, version: int, checkpoint: str, asleep: bool = False,
                   pull: WeightPull | None = None) -> PolicyTarget:
        """The new target of every node (each gets a fresh id, so setting the same one again
        is a retry); nodes sync to it in their next heartbeats. pull: its weights in the
        trainer's memory (checkpoint is still what a node reloads after a restart)."""
        with self._lock:
            self.policy = PolicyTarget(id=secrets.token_hex(4), version=int(version), checkpoint=str(checkpoint),
                                       asleep=bool(asleep), pull=pull)
            self._changed.notify_all()
            return PolicyTarget(**self.policy)

    def policy_status(self) -> PolicyStatus:
        with self._lock:
            return PolicyStatus(target=self.policy, nodes=self.scheduler.node_policies())

    # -- node protocol -------------------------------------------------------------------
    def heartbeat(self, body: Heartbeat) -> HeartbeatReply:
        """A node's load, its sessions' state changes and its policy; answered, once saved,
        with new sessions, cancellations, settled outcomes and the policy to serve."""
        node_id = str(body["node_id"])
        try:
            with self._lock:
                answer, effects = self.scheduler.heartbeat(body, time.monotonic())
                self._perform(effects)
                reply = HeartbeatReply(assign=answer.assign, cancel=answer.cancel, settled=answer.settled,
                                       policy=self.policy)
            # Durable before the node hears back: it drops the events it reported once
            # answered, and must not start a session a restarted server would not know of.
            # settled: outcomes the server holds as their sample's (durable once this answer is
            # sent); the node stores a reward only then, so a superseded attempt never has one.
            self.flush()
            return reply
        finally:
            with self._lock:
                if node_id in self.scheduler.nodes:
                    self.scheduler.answered(node_id, time.monotonic())

    # -- effects ---------------------------------------------------------------------------
    def _perform(self, effects: list[Effect]) -> None:
        """What the scheduler's transitions call for (under the lock): rows and events to
        journal, callbacks to post; and whoever waits looks again."""
        for e in effects:
            if isinstance(e, SessionMoved):
                self._dirty_sessions.add(e.session_id)
                self._events.append(journal.Event(at_us=self._stamp(), task_id=e.task_id, session_id=e.session_id,
                                                  state=e.state, node_id=e.node_id, detail=e.detail))
            elif isinstance(e, TaskMoved):
                self._dirty_tasks.add(e.task_id)
            elif isinstance(e, Noted):
                self._events.append(journal.Event(at_us=self._stamp(), task_id=e.task_id or "", session_id=None,
                                                  state=e.state, node_id=e.node_id, detail=e.detail))
            elif isinstance(e, CallbackDue):
                if e.attempt == 0 and e.task_id in self._callback_tasks:
                    continue      # queued already
                self._callback_tasks.add(e.task_id)
                heapq.heappush(self._callbacks, (time.monotonic() + e.delay, e.attempt, e.task_id))
        self._changed.notify_all()

    def _stamp(self) -> int:
        """Now (unix microseconds), after every event stamped before: events keep their order.
        Integers: float seconds lose the 1 us step in the conversion to a TIMESTAMPTZ."""
        self._last_us = max(time.time_ns() // 1000, self._last_us + 1)
        return self._last_us

    # -- background loops ---------------------------------------------------------------
    def _reaper_loop(self) -> None:
        while not self._stop.wait(min(0.5, self.scheduler.node_timeout / 4)):
            with self._lock:
                self._perform(self.scheduler.reap(time.monotonic()))

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
        """One try; the scheduler says whether it is tried again."""
        if self._stop.is_set():
            return        # still "pending" in the database: a restarted server sends it
        with self._lock:
            url, body = self.scheduler.tasks[task_id].spec.callback_url, self.scheduler.group(task_id)
        ok, error = False, None
        try:
            r = self._client.post(str(url), json=body)
            ok, error = r.status_code < 300, f"HTTP {r.status_code}"
        except Exception as e:   # httpx's errors; at stop, the client closed under it
            if self._stop.is_set():
                return
            error = str(e) or type(e).__name__
        if not ok:
            log.warning("callback for %s (try %d) failed: %s", task_id, attempt + 1, error)
        with self._lock:
            if not ok:
                self._callback_errors[task_id] = str(error)[:200]
            self._perform(self.scheduler.callback_result(task_id, attempt, ok, error))
            if self.scheduler.tasks[task_id].callback_state != Callback.PENDING:
                self._callback_tasks.discard(task_id)

    # -- journal ---------------------------------------------------------------------
    def _journal_loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            try:
                self.flush()
            except Exception:
                log.exception("saving rollout state failed; retrying")

    def _fold_loop(self) -> None:
        """Its own thread: a fold waits for the database (the proxy's loader hands it over),
        and the saves must not wait with it."""
        while not self._stop.is_set():
            self._fold_now.wait(self.fold_s)
            self._fold_now.clear()
            with self._fold_waiters_lock:
                waiters, self._fold_waiters = self._fold_waiters, []
            if self._stop.is_set():
                for w in waiters:
                    w.set()
                break
            try:
                self.fold()
            except Exception:   # the log keeps it all; the next fold tries again
                log.exception("folding the rollout journal into the database failed; retrying")
            finally:
                for w in waiters:   # done, or failed: a waiter waits no longer either way
                    w.set()

    def fold_soon(self) -> threading.Event:
        """Fold now, in the fold's thread: a caller that knows no session runs (the loop
        between its rollouts and training) keeps the fold's disk writes off every save.
        Returns an event set once a fold that started after this call is done: wait on it
        before sessions run again."""
        done = threading.Event()
        with self._fold_waiters_lock:
            self._fold_waiters.append(done)
        self._fold_now.set()
        return done

    def fold(self) -> None:
        """The journal log's saved changes into the database's rollout tables (SQL sees them)."""
        with self._fold_lock:
            if self._log is None or not self._log.closed:
                journal.fold(self.db, self._log)

    def _journal_log(self) -> JournalLog:
        if self._log is None:
            self._log = JournalLog(self.db, journal.folded_through(self.db))
        return self._log

    def journal_stats(self, reset: bool = False) -> dict:
        """The journal log's saves (since the last reset): how many, p50, p99 and max in ms."""
        with self._flush_lock:
            ms = sorted(self._save_ms)
            if reset:
                self._save_ms = []
        if not ms:
            return {"saves": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
        return {"saves": len(ms), "p50_ms": ms[len(ms) // 2], "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
                "max_ms": ms[-1]}

    def flush(self) -> None:
        """Every change since the last flush, durable in the journal log (one line)."""
        with self._flush_lock:
            with self._lock:
                if not (self._dirty_tasks or self._dirty_sessions or self._events):
                    return
                tasks, sessions, events = self._dirty_tasks, self._dirty_sessions, self._events
                self._dirty_tasks, self._dirty_sessions, self._events = set(), set(), []
                batch = journal.Batch(tasks=[_task_row(self.scheduler.tasks[t]) for t in tasks],
                                      sessions=[_session_row(self.scheduler.sessions[s]) for s in sessions],
                                      events=events)
            t0 = time.monotonic()
            try:
                self._journal_log().append(batch)
                took = time.monotonic() - t0
                if len(self._save_ms) < 100_000:   # a bound, for a caller that never resets
                    self._save_ms.append(took * 1000)
                if took > 1.0:
                    log.warning("saving rollout state took %.1fs", took)
            except BaseException:
                with self._lock:   # keep them for the next try
                    self._dirty_tasks |= tasks
                    self._dirty_sessions |= sessions
                    self._events[:0] = events
                raise


def _task_row(ts: TaskState) -> journal.TaskRow:
    return journal.TaskRow(task_id=ts.spec.task_id, order=ts.order, spec=ts.spec.to_json(), state=ts.state,
                           priority=ts.spec.priority, callback_state=ts.callback_state,
                           callback_tries=ts.callback_tries, cancel_reason=ts.cancel_reason)


def _session_row(s: SessionState) -> journal.SessionRow:
    return journal.SessionRow(session_id=s.session_id, task_id=s.task_id, sample=s.sample, attempt=s.attempt,
                              state=s.state, node_id=s.node_id, reward=s.reward, reason=s.reason, stats=s.stats)
