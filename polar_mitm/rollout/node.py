"""A gateway node: the proxy's machine, with three worker pools around a READY buffer.

    server --assign--> inbox -> INIT pool -> READY buffer -> RUN pool -> POST_RUN pool
                                (copy workspace,  (sized to     (harness,     (evaluator, reward,
                                 HOME, config)     RUN slots)    hard timeout)  stats, teardown)

Set-up and evaluation never hold a RUN slot, and the READY buffer keeps RUN fed, so the
model backend does not wait on either. The node asks the server for work in its heartbeat,
as many sessions as it has free places for, and reports every state change there too;
reports wait in an outbox until the server has them, so a server restart loses none.
The heartbeat's answer also carries the policy the server wants served: the node syncs its
own gateway (and so its vLLM) to it, in its own thread, and reports what it serves.

With its model backend's URL, the node probes it every few seconds. While it does not answer
the node pauses: it takes no new work and starts no harness (prepared sessions wait in
READY). A session whose model calls failed because of the backend (as the gateway recorded
them: refused connections, timeouts, vLLM's 5xx; however short the outage), whose calls have
no known policy version, or whose run saw the probe find the backend down, is handed back
("released": it runs again, and that never counts as a failed attempt) instead of being
scored: the backend's failures are not the policy's. An error that a healthy backend
answered while it served other calls is the request's (request_failed, the gateway's verdict:
addons/request_failures.py) and is scored like any failure of the policy.

Each session's output is kept: the harness's stdout and stderr (a bounded tail) and the
evaluator's, with session credentials redacted, in its stats ("harness_output",
"eval_output"), which the server stores in rollout_sessions.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import httpx
from typing_extensions import Unpack

from .. import session_auth, session_ids
from ..store import rollout_journal as journal
from . import files_cache, grading, harnesses, mcp
from .files_cache import FilesCache, FilesError
from .grading import GradingUnavailable
from .judge import (DIFF_BYTES, JudgeError, JudgeSpec, combine, judge_session, judge_transcript,
                    parse_judge)
from .protocol import (Assignment, EventDetail, Heartbeat, HeartbeatReply, NodeLoad, PolicyReport, PolicyTarget,
                       RewardRecord, SessionEvent)
from .rewards import Outcome, failure_reward, reward_record, write_rewards
from .runtime import LocalRuntime, Runtime, RunResult, Sandbox, SetupError
from .spec import Evaluator, TaskError, TaskRequest, TestsEvaluator, parse_reward, task_from_json
from .states import OUTCOMES, RELEASE_CAUSE, TERMINAL, UNSCORED, ReleaseCause, Session
from .web_guard import auth_headers

log = logging.getLogger("polar.node")


@dataclass
class NodeConfig:
    server_url: str
    proxy_port: int
    ca_path: str
    db: str | None = None              # this node's proxy database: rewards and call stats
    node_id: str = field(default_factory=lambda: f"node-{uuid.uuid4().hex[:8]}")
    init_workers: int = 4
    run_workers: int = 4
    post_workers: int = 2
    ready_size: int | None = None      # READY buffer; None: the RUN capacity
    heartbeat_s: float = 0.5
    control_token: str | None = None   # the proxy's polar_control_token: syncs go through it
    backend_url: str | None = None     # the model backend: probed; the node pauses while it is down
    backend_probe_s: float = 2.0
    server_token: str | None = None    # the rollout server's bearer token (one beyond loopback asks for it)
    # Where the files shipped with tasks (a server's ship_files) are cached on this node, one
    # copy per blob (files_cache.py); None: ~/.cache/polar-mitm/task-files
    files_cache: str | None = None
    # Blocks until the calls recorded so far are safe off this machine (a Ray node's calls
    # shipped to the driver's store; False: not within its timeout). An outcome is reported
    # only after it: a session is never scored while its calls live only on a node that may die.
    calls_shipped: Callable[[], bool] | None = None


@dataclass
class Work:
    session_id: str
    task: TaskRequest
    attempt: int
    sandbox: Sandbox | None = None
    cancelled: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    result: RunResult | Exception | None = None   # the harness's run, or why it could not start
    outages: int | None = None        # the node's backend outages when its harness started
    calls: dict[str, Any] | None = None   # its call stats (journal.call_stats), read once it ran
    epoch: int | None = None          # the gateway's count of weights it found changed under it, at RUN
    diff: bytes | None = None         # the tests evaluator's diff of its workspace (the judge reads it)

    @property
    def box(self) -> Sandbox:
        """Its sandbox, made in INIT (RUN and POST_RUN only get sessions that have one)."""
        if self.sandbox is None:
            raise RuntimeError(f"{self.session_id} has no sandbox")
        return self.sandbox


OUTPUT_CHARS = 4000    # the tail of the harness's and of the evaluator's output that is kept
# An evaluator that runs git in the workspace reads the session's .git/config: none of the
# commands that config could name (hooks, an fsmonitor, a pager) run.
GIT_QUIET = {"GIT_CONFIG_COUNT": "3", "GIT_CONFIG_KEY_0": "core.hooksPath", "GIT_CONFIG_VALUE_0": "/dev/null",
             "GIT_CONFIG_KEY_1": "core.fsmonitor", "GIT_CONFIG_VALUE_1": "false",
             "GIT_CONFIG_KEY_2": "core.pager", "GIT_CONFIG_VALUE_2": "cat"}

def _box_env(box: Sandbox) -> dict[str, str]:
    """The environment a command of the node's (an evaluator, a diff, the tests) starts with
    in a sandbox: the node's PATH, and the sandbox's own HOME and TMPDIR."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(box.home), "TMPDIR": str(box.tmp),
            "LANG": "C.UTF-8"}


def release_cause(stats: Mapping[str, Any]) -> tuple[ReleaseCause, str] | None:
    """Why a session must not be scored, from its recorded calls (journal.call_stats): some
    failed because of the model backend, or were served with no known policy version. None:
    its calls are the policy's own (failed requests of its own included: request_failed, an
    error a healthy backend answered while it served other calls, and session_busy are not
    among journal.BACKEND_ERROR_KINDS, so a policy cannot have its bad samples rerun by
    making the backend fail its request)."""
    calls = stats.get("calls") or 0
    failed = stats.get("backend_failed_calls") or 0
    if failed:
        kinds = ", ".join(stats.get("backend_error_kinds") or []) or "backend errors"
        return (ReleaseCause.BACKEND_UNAVAILABLE,
                f"backend unavailable: {failed} of its {calls} model calls failed on the model backend ({kinds})")
    unknown = stats.get("unknown_version_calls") or 0
    if unknown:
        return (ReleaseCause.VERSION_UNKNOWN,
                f"policy version unknown: {unknown} of its {calls} model calls were served by weights "
                f"the gateway could not verify")
    return None


def probe_backend(url: str, timeout: float = 5.0) -> str | None:
    """None when the model backend answers (vLLM's /health, or its model list where there is
    no /health), else what is wrong."""
    url = url.rstrip("/")
    try:
        r = httpx.get(f"{url}/health", timeout=timeout, trust_env=False)
        if r.status_code == 404:
            r = httpx.get(f"{url}/v1/models", timeout=timeout, trust_env=False)
    except httpx.HTTPError as e:
        return f"the model backend at {url} does not answer: {str(e) or type(e).__name__}"
    if r.status_code >= 500:
        return f"the model backend at {url} answers {r.status_code}: {r.text[:200]}"
    return None


class CoalescedCallStats:
    """Sessions' call stats, asked for as each one's harness exits, read together: the first
    asker reads for everyone waiting then (and for those who came meanwhile, round after
    round); the others wait for its answer. Each read takes the database from the proxy's
    loader and gives it back: one per session was most of a busy node's database time."""

    def __init__(self, db: str, timeout: float = 120.0):
        self.db, self.timeout = db, timeout
        self._lock = threading.Lock()
        self._waiting: dict[str, list[Future]] = {}
        self._reading = False

    def get(self, session_id: str) -> journal.CallStats:
        fut: Future = Future()
        with self._lock:
            self._waiting.setdefault(session_id, []).append(fut)
            lead, self._reading = not self._reading, True
        if lead:
            while True:
                with self._lock:
                    batch, self._waiting = self._waiting, {}
                    if not batch:
                        self._reading = False
                        break
                try:
                    stats = journal.call_stats_many(self.db, list(batch), timeout=self.timeout)
                except Exception as e:
                    for futs in batch.values():
                        for f in futs:
                            f.set_exception(e)
                    continue
                for sid, futs in batch.items():
                    for f in futs:
                        f.set_result(stats[sid])
        return fut.result()


class GatewayNode:
    def __init__(self, cfg: NodeConfig, runtime: Runtime | None = None,
                 launcher: Callable[[str, harnesses.RunContext], harnesses.Launch] = harnesses.launch):
        self.cfg = cfg
        if cfg.control_token or cfg.server_token:   # it holds secrets: its memory is not the sessions' to read
            session_auth.make_undumpable()
        self.runtime = runtime or LocalRuntime()
        self.launcher = launcher
        self.ready_size = cfg.ready_size if cfg.ready_size is not None else cfg.run_workers
        self.inbox: queue.Queue[Work | None] = queue.Queue()
        self.ready: queue.Queue[Work] = queue.Queue(maxsize=max(1, self.ready_size))
        self.post: queue.Queue[Work] = queue.Queue()
        self._lock = threading.Lock()
        self._held: dict[str, Work] = {}        # assigned and not yet finished
        self._stage: dict[str, Session] = {}
        self._outbox: list[SessionEvent] = []
        self._stop = threading.Event()
        self._releasing = False
        self._threads: list[threading.Thread] = []
        # Generous: the server answers a heartbeat once its state is saved, which can wait on
        # the database; a slow answer is no reason to give up on the events it carries.
        self._client = httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0), trust_env=False,
                                    headers=auth_headers(cfg.server_token))
        self.heartbeats_ok = 0
        # the files shipped with tasks, fetched from the server once each (a task without: none)
        self.files = FilesCache(cfg.files_cache or files_cache.default_root(), self._client, cfg.server_url)
        # The policy: the server's target, and what this node serves (reported back).
        self._policy_target: PolicyTarget | None = None
        self._policy_wake = threading.Event()
        self._beat = threading.Event()
        # one heartbeat at a time: two in flight would both send the same events and then
        # drop twice as many from the outbox
        self._heartbeat_lock = threading.Lock()
        self._unsettled: dict[str, RewardRecord] = {}   # session -> its reward, kept until the server settles it
        self._settled: queue.Queue[str | None] = queue.Queue()
        self._call_stats = CoalescedCallStats(cfg.db) if cfg.db else None
        self.policy: PolicyReport | None = None
        # The backend: up (no URL: taken as up), what is wrong while it is down, and how
        # many times it went down (a session whose run saw one is handed back).
        self._backend_up = threading.Event()
        self._backend_up.set()
        self.backend_error: str | None = None
        self.outages = 0

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "GatewayNode":
        if self.cfg.backend_url:
            self._probe_backend()         # a node whose backend is down starts paused
            self._spawn(f"{self.cfg.node_id}-backend", self._backend_loop)
        pools = [("init", self.cfg.init_workers, self._init_loop),
                 ("run", self.cfg.run_workers, self._run_loop),
                 ("post", self.cfg.post_workers, self._post_loop)]
        for name, n, fn in pools:
            for i in range(n):
                self._spawn(f"{self.cfg.node_id}-{name}-{i}", fn)
        self._spawn(f"{self.cfg.node_id}-heartbeat", self._heartbeat_loop)
        self._spawn(f"{self.cfg.node_id}-policy", self._policy_loop)
        self._rewards = threading.Thread(target=self._store_rewards, name=f"{self.cfg.node_id}-rewards", daemon=True)
        self._rewards.start()
        return self

    def _spawn(self, name: str, fn) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        """End what is held and hand it back to the server ("released": it runs them again,
        elsewhere or after a restart), then stop."""
        with self._lock:
            self._releasing = True
            held = list(self._held.values())
        for w in held:
            self._cancel(w)
        deadline = time.monotonic() + timeout
        while self._held and time.monotonic() < deadline:
            time.sleep(0.05)
        self._flush_outbox()
        self._stop.set()
        self._policy_wake.set()
        self._beat.set()
        for _ in range(self.cfg.init_workers + self.cfg.run_workers):
            self.inbox.put(None)
        for t in self._threads:
            t.join(timeout=2.0)
        self._settled.put(None)       # the settled rewards are stored before stop returns
        self._rewards.join(timeout=120.0)
        self._client.close()

    # -- load, as the server sees it -----------------------------------------------------
    @property
    def slots(self) -> int:
        """Sessions held before POST_RUN: being set up, buffered, running."""
        return self.cfg.init_workers + self.ready_size + self.cfg.run_workers

    def load(self) -> NodeLoad:
        with self._lock:
            stages = list(self._stage.values())
        pre_post = sum(1 for s in stages if s != Session.POST_RUN)
        # a stopping node takes none, nor one whose backend is down
        paused = self.backend_error if not self._backend_up.is_set() else None
        free = 0 if self._releasing or paused else max(0, self.slots - pre_post)
        load = NodeLoad(slots=self.slots, free=free, running=stages.count(Session.RUN),
                        ready=stages.count(Session.READY), post_run=stages.count(Session.POST_RUN))
        if paused:
            load["paused"] = paused
        return load

    # -- the model backend -----------------------------------------------------------------
    def _backend_loop(self) -> None:
        while not self._stop.wait(self.cfg.backend_probe_s):
            self._probe_backend()

    def _probe_backend(self) -> None:
        if not self.cfg.backend_url:
            return
        error = probe_backend(self.cfg.backend_url)
        if error and self._backend_up.is_set():
            self.outages += 1
            self.backend_error = error
            self._backend_up.clear()
            log.warning("node %s paused: %s", self.cfg.node_id, error)
        elif error:
            self.backend_error = error
        elif not self._backend_up.is_set():
            self.backend_error = None
            self._backend_up.set()
            log.warning("node %s resumed: the model backend answers again", self.cfg.node_id)

    # -- reporting ---------------------------------------------------------------------
    def _report(self, w: Work, state: Session, **extra: Unpack[EventDetail]) -> None:
        if state in OUTCOMES and self.cfg.calls_shipped is not None and not self.cfg.calls_shipped():
            log.warning("%s: its calls are not shipped yet (the driver's store is not taking them); "
                        "reported all the same", w.session_id)
        with self._lock:
            if self._releasing and state == Session.CANCELLED:
                stats = {**(extra.get("stats") or {}), RELEASE_CAUSE: ReleaseCause.NODE_STOPPED.value}
                state, extra = Session.RELEASED, EventDetail(reason=f"node {self.cfg.node_id} stopped", stats=stats)
            if state in TERMINAL:
                self._held.pop(w.session_id, None)
                self._stage.pop(w.session_id, None)
            else:
                self._stage[w.session_id] = state
            if state in OUTCOMES and self.cfg.db:
                self._keep_reward(w, Outcome(session_id=w.session_id, state=state, reward=extra.get("reward"),
                                             reason=extra.get("reason"), stats=extra.get("stats")))
            self._outbox.append(SessionEvent(session_id=w.session_id, state=state, at=time.time(), **extra))

    def _keep_reward(self, w: Work, outcome: Outcome) -> None:
        """Its reward (rewards.reward_record, as the server's group would give it), kept until
        the server settles the outcome (its heartbeat answer): a session the server has moved
        on from (retried elsewhere after a restart) never gets a reward."""
        record = reward_record(outcome, w.task.on_failure)
        if record is not None:
            self._unsettled[w.session_id] = record

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            self._flush_outbox()
            self._beat.wait(self.cfg.heartbeat_s)   # or sooner: a sync's report is waited for
            self._beat.clear()

    def _flush_outbox(self) -> None:
        with self._heartbeat_lock:
            self._heartbeat()

    def _heartbeat(self) -> None:
        with self._lock:
            events = list(self._outbox)
            active = list(self._held)
        body = Heartbeat(node_id=self.cfg.node_id, load=self.load(), active=active, events=events,
                         policy=self.policy, db=str(Path(self.cfg.db).resolve()) if self.cfg.db else None)
        try:
            r = self._client.post(f"{self.cfg.server_url}/nodes/heartbeat", json=body)
            r.raise_for_status()
            reply: HeartbeatReply = r.json()
        except (httpx.HTTPError, ValueError) as e:
            log.warning("heartbeat to %s failed: %s", self.cfg.server_url, e)
            return
        self.heartbeats_ok += 1
        with self._lock:
            del self._outbox[:len(events)]   # only what the server has now
        settled = reply.get("settled", [])
        for sid in settled:
            self._settled.put(sid)
        with self._lock:                     # outcomes the server did not take: no reward
            for ev in events:
                if ev["state"] in OUTCOMES and ev["session_id"] not in settled:
                    if self._unsettled.pop(ev["session_id"], None) is not None:
                        log.warning("%s: the server has moved on from it; its reward is not stored", ev["session_id"])
        target = reply.get("policy")
        if target and target != self._policy_target:
            self._policy_target = target
            self._policy_wake.set()
        for a in reply.get("assign", []):
            self._accept(a)
        for sid in reply.get("cancel", []):
            with self._lock:
                w = self._held.get(sid)
            if w is not None:
                self._cancel(w)

    # -- the policy served -----------------------------------------------------------------
    def _policy_loop(self) -> None:
        """Sync this node's gateway to the server's target, one target at a time; the result
        (served, or the error) goes out in the next heartbeat."""
        while not self._stop.is_set():
            self._policy_wake.wait()
            self._policy_wake.clear()
            target = self._policy_target
            if target is None or self._stop.is_set() or (self.policy or {}).get("target") == target["id"]:
                continue
            self.policy = self._apply_policy(target)
            self._beat.set()

    def _apply_policy(self, target: PolicyTarget) -> PolicyReport:
        now = self.policy or PolicyReport()
        report = PolicyReport(target=target["id"], version=now.get("version"), checkpoint=now.get("checkpoint"),
                              asleep=now.get("asleep"), error=None)
        if not self.cfg.control_token:
            return {**report, "error": f"node {self.cfg.node_id} takes no syncs: its proxy has no control token"}
        wanted = PolicyReport(version=target["version"], checkpoint=target["checkpoint"], asleep=target["asleep"])
        if (report["version"], report["checkpoint"], report["asleep"]) == \
                (target["version"], target["checkpoint"], target["asleep"]) and not now.get("error"):
            return {**report, "detail": "already served"}
        try:
            if target["asleep"]:
                r = self._control("/_polar/sleep", {"level": 2})   # it reloads on waking anyway
            else:
                # the trainer's memory where it published the weights (the folder is a resync's)
                pull = {"pull": target["pull"]} if target.get("pull") else {}
                r = self._control("/_polar/sync", {"checkpoint": target["checkpoint"], "version": target["version"],
                                                   **pull})
        except httpx.HTTPError as e:
            return {**report, "error": f"the proxy did not answer: {e}"}
        if r.status_code != 200:
            return {**report, "error": f"{r.status_code}: {r.text[:500]}"}
        if target["asleep"]:
            return {**report, "asleep": True, "detail": r.json()}
        return {**report, **wanted, "detail": r.json()}

    def _control(self, path: str, body: dict | None = None) -> httpx.Response:
        """The proxy's control endpoint at path, with its token: POST body, or GET without one."""
        return httpx.request("GET" if body is None else "POST", f"http://polar.control{path}", json=body,
                             proxy=f"http://127.0.0.1:{self.cfg.proxy_port}",
                             headers={"authorization": f"Bearer {self.cfg.control_token}"},
                             trust_env=False, timeout=httpx.Timeout(900.0, connect=5.0))

    def _accept(self, a: Assignment) -> None:
        w = Work(a["session_id"], task_from_json(a["task"]), a.get("attempt", 1))
        with self._lock:
            if w.session_id in self._held:
                return
            self._held[w.session_id] = w
            self._stage[w.session_id] = Session.ASSIGNED
        w.stats["assigned_at"] = time.time()
        self.inbox.put(w)

    def _cancel(self, w: Work) -> None:
        w.cancelled = True
        if w.sandbox is not None:
            w.sandbox.cancel()

    def _taken(self, q: queue.Queue[Work]) -> Iterator[Work]:
        """A pool worker's work from its queue, until the node stops (polled: a stop is seen
        within 0.2 s)."""
        while not self._stop.is_set():
            try:
                w = q.get(timeout=0.2)
            except queue.Empty:
                continue
            yield w

    # -- INIT --------------------------------------------------------------------------
    def _init_loop(self) -> None:
        while not self._stop.is_set():
            w = self.inbox.get()
            if w is None:
                return
            if w.cancelled:
                self._report(w, Session.CANCELLED, reason="cancelled before set-up")
                continue
            self._report(w, Session.INIT)
            t0 = time.monotonic()
            if w.task.files and not self._localize(w):
                continue
            try:
                # a runtime of its own (a test's, a bench's) may take no image, nor limits
                kw: dict[str, Any] = {"limits": w.task.limits} if w.task.limits else {}
                if w.task.runtime is not None:
                    kw["runtime"] = w.task.runtime
                w.sandbox = self.runtime.prepare(w.session_id, w.task.workspace, **kw)
            except (SetupError, OSError) as e:
                self._report(w, Session.FAILED, reason=f"set-up failed: {e}")
                continue
            except Exception as e:   # the runtime's own failure: this INIT worker goes on
                log.exception("setting up %s failed", w.session_id)
                self._report(w, Session.FAILED, reason=f"set-up failed: {type(e).__name__}: {e}")
                continue
            unfit = getattr(w.sandbox, "unfit_for", lambda harness: None)(w.task.harness)
            if unfit:   # the image cannot run the harness: the task's environment, never the policy's failure
                w.sandbox.teardown()
                w.sandbox = None
                self._report(w, Session.FAILED, reason=f"set-up failed: {unfit}", stats={UNSCORED: "image_unfit"})
                continue
            w.stats["init_s"] = round(time.monotonic() - t0, 3)
            if w.task.runtime is not None:   # of INIT: pulling and unpacking the image (0: cached)
                w.stats["image_unpack_s"] = round(getattr(w.sandbox, "setup_s", 0.0), 3)
            self._report(w, Session.READY)
            w.stats["ready_since"] = time.monotonic()
            self.ready.put(w)        # blocks while the buffer is full: INIT never runs ahead

    def _localize(self, w: Work) -> bool:
        """The session's task with its shipped files (task.files) at this node's cached copies,
        before anything reads its paths. A blob that cannot be had (after the cache's own
        retries), or is refused (its sha256, an unsafe member), fails the session unscored:
        the infrastructure's failure, not the policy's. Not released: a release before the
        harness ran reruns it under the same name with no bound, and a blob refused here would
        be refused on every node."""
        t0 = time.monotonic()
        try:
            w.task = self.files.localize(w.task)
        except (FilesError, OSError) as e:
            log.warning("%s: the task's files: %s", w.session_id, e)
            self._report(w, Session.FAILED, reason=f"set-up failed: the task's files: {e}"[:1000],
                         stats={UNSCORED: "task_files"})
            return False
        w.stats["files_s"] = round(time.monotonic() - t0, 3)
        return True

    # -- RUN ---------------------------------------------------------------------------
    def _run_loop(self) -> None:
        for w in self._taken(self.ready):
            # paused while the backend is down: the session waits here, still READY
            while not self._backend_up.is_set() and not w.cancelled and not self._stop.is_set():
                self._backend_up.wait(0.2)
            w.stats["ready_wait_s"] = round(time.monotonic() - w.stats.pop("ready_since"), 3)
            if w.cancelled or self._stop.is_set():
                w.cancelled = True
                self.post.put(w)
                continue
            w.outages = self.outages
            w.epoch = self._gateway_epoch()
            self._report(w, Session.RUN)
            box = w.box
            try:
                ctx = harnesses.RunContext(
                    session_id=w.session_id, instruction=w.task.instruction,
                    proxy_port=self.cfg.proxy_port, ca_path=self.cfg.ca_path,
                    home=box.home, workdir=box.workdir, command=w.task.command,
                    credential=session_auth.credential(self.cfg.control_token, w.session_id)
                    if self.cfg.control_token else None,
                    mcp_servers=mcp.parse_mcp_servers(w.task.mcp_servers or None),   # a skill's directory:
                    skills=mcp.parse_skills(w.task.skills or None))                  # on this node too
                launch = self.launcher(w.task.harness, ctx)
            except (harnesses.HarnessMissing, ValueError, OSError) as e:
                w.result = e
                self.post.put(w)
                continue
            w.stats["network"] = getattr(box, "network", "unknown")
            try:
                result = w.result = box.run(launch.argv, launch.env, w.task.timeout, "harness",
                                            proxy_port=self.cfg.proxy_port)
            except Exception as e:   # the sandbox failed, not the policy: this slot keeps working
                log.exception("running %s failed", w.session_id)
                w.result = e
                self.post.put(w)
                continue
            w.stats["run_s"] = round(result.seconds, 3)
            w.stats["exit_code"] = result.exit_code
            self._report(w, Session.POST_RUN)
            self.post.put(w)

    # -- POST_RUN ----------------------------------------------------------------------
    def _post_loop(self) -> None:
        for w in self._taken(self.post):
            try:
                self._finish(w)
            except Exception as e:   # a report must go out whatever broke
                log.exception("post-run of %s failed", w.session_id)
                self._report(w, Session.FAILED, reason=f"post-run failed: {e}")
            finally:
                if w.sandbox is not None:
                    w.sandbox.teardown()

    def _finish(self, w: Work) -> None:
        r = w.result
        tail = getattr(r, "output_tail", None)
        if isinstance(tail, str):    # kept: rollout_sessions.harness_output
            w.stats["harness_output"] = session_auth.redact(tail)[-OUTPUT_CHARS:]
        if w.cancelled or (r is not None and getattr(r, "cancelled", False)):
            self._report(w, Session.CANCELLED, reason="cancelled", stats=self._stats(w))
            return
        if isinstance(r, Exception):
            self._report(w, Session.FAILED, reason=f"harness could not start: {session_auth.redact(str(r))}", stats=w.stats)
            return
        # Before the harness's own outcome: an outage may have made it fail or time out.
        released = self._released(w)
        if released is not None:
            cause, why = released
            self._report(w, Session.RELEASED, reason=f"{why}: not the policy's doing; it runs again",
                         stats={**self._stats(w), RELEASE_CAUSE: cause.value})
            return
        if r is None:
            raise RuntimeError(f"{w.session_id} reached POST_RUN without a run")
        if r.usage:
            w.stats["usage"] = r.usage      # of its limits (runtime.RunResult.usage)
        if r.limit is not None:      # its own doing, whatever it exited with: the policy's failure
            w.stats["limit"] = r.limit.name
            self._failed(w, r.limit.reason)
            return
        if r.timed_out:
            # The calls made so far stay in the database; the session scores 0.
            why = f"harness timed out after {w.task.timeout:g}s"
            self._report(w, Session.TIMED_OUT, reward=0.0, reason=why, stats=self._stats(w))
            return
        if r.exit_code != 0:
            self._failed(w, f"harness exited with code {r.exit_code}: {session_auth.redact(r.output_tail)[-500:].strip()}")
            return
        reward: float | None = None
        reason: str | None = None
        if isinstance(w.task.evaluator, TestsEvaluator):
            try:
                reward, reason = self._grade_tests(w, w.task.evaluator)
            except (SetupError, GradingUnavailable, OSError) as e:   # the grader's environment: not the policy's
                self._report(w, Session.FAILED, reason=f"grading failed: {session_auth.redact(str(e))[-500:]}",
                             stats={**self._stats(w), UNSCORED: True})
                return
        elif w.task.evaluator is not None:
            t0 = time.monotonic()
            ev = w.task.evaluator
            try:
                er = self._evaluate(w, ev)
            except (SetupError, OSError) as e:   # its sandbox could not be made: the grader's failure
                self._report(w, Session.FAILED, reason=f"evaluation failed: {session_auth.redact(str(e))[-500:]}",
                             stats=self._stats(w))
                return
            w.stats["eval_s"] = round(time.monotonic() - t0, 3)
            w.stats["eval_output"] = session_auth.redact(er.output_tail)[-OUTPUT_CHARS:]
            if er.cancelled:
                self._report(w, Session.CANCELLED, reason="cancelled", stats=self._stats(w))
                return
            if er.timed_out:
                reward, reason = 0.0, f"evaluator timed out after {ev.timeout:g}s"
            elif er.limit is not None:   # what it ran of the session's went past a limit: no verdict
                reward, reason = 0.0, f"evaluator: {er.limit.reason}"
            else:
                try:
                    reward = parse_reward(er.output_tail, er.exit_code)
                except TaskError as e:   # nan or inf: the evaluation failed
                    self._failed(w, str(e))
                    return
        if w.task.judge is not None:
            spec = parse_judge(w.task.judge)
            w.stats["outcome"] = reward          # the evaluator's, before the judge's score
            if spec.mode == "group":             # scored with its group once that settles (judging.py)
                reward = None
            else:
                try:
                    reward = self._judged(w, spec, reward)
                except JudgeError as e:
                    w.stats["judge"] = {"error": str(e), "call": e.call}
                    self._failed(w, f"judge: {e}")
                    return
        self._report(w, Session.DONE, reward=reward, reason=reason, stats=self._stats(w))

    def _evaluate(self, w: Work, ev: Evaluator) -> RunResult:
        """The command evaluator's run, in a fresh sandbox (runtime.EvaluationSandbox): the
        session's workspace read-only, a fresh HOME and TMPDIR, loopback only; POLAR_OUTPUT a
        copy the node made of the harness's output. Nothing of what the session left in its
        HOME, TMPDIR or image layer runs there."""
        ebox = w.box.evaluation_box(ev.reads)
        try:
            env = {**_box_env(ebox), "POLAR_SESSION": w.session_id, "POLAR_TASK": w.task.task_id,
                   # the sample's index in its group, and the harness's output (its final answer)
                   "POLAR_SAMPLE": session_ids.sample_of(w.session_id), **GIT_QUIET}
            if ebox.output is not None:
                env["POLAR_OUTPUT"] = ebox.output
            return ebox.run(["/bin/sh", "-c", ev.command], env, ev.timeout, "evaluator")
        finally:
            ebox.teardown()

    def _judge_diff(self, w: Work) -> bytes | None:
        """The session's diff for its judge: the tests evaluator's (Work.diff), else one taken
        in a fresh evaluation sandbox and read from its stdout (grading.diff_script, text only,
        its first DIFF_BYTES); None where its workspace is no git repository. Never read from a
        path in the session's space."""
        if w.diff is not None or isinstance(w.task.evaluator, TestsEvaluator):
            return w.diff
        ebox = w.box.evaluation_box()
        try:
            env = _box_env(ebox)
            script = grading.diff_script(ebox.inside_workdir, w.task.workspace.commit, limit=DIFF_BYTES,
                                         binary=False)
            r = ebox.run(["/bin/sh", "-c", script], env, 120.0, "judge-diff")
            if r.exit_code not in (0, grading.SIGPIPE_EXIT):     # cut at DIFF_BYTES: the judge reads that much
                w.stats["judge_diff"] = "none" if r.exit_code == grading.NO_REPO else f"failed (exit {r.exit_code})"
                return None
            return ebox.output_of("judge-diff", DIFF_BYTES)
        finally:
            ebox.teardown()

    def _judged(self, w: Work, spec: JudgeSpec, outcome: float | None) -> float:
        """The judge's score of the session's transcript (read from the database: the calls
        its harness made) and its diff (_judge_diff), combined with the evaluator's outcome.
        The judge is asked directly, never through the proxy: its calls are not a session's,
        and are never trained."""
        try:
            diff = self._judge_diff(w)
        except (SetupError, OSError) as e:    # a judge without the diff still judges
            w.stats["judge_diff"] = f"failed: {e}"
            diff = None
        t = judge_transcript(self.cfg.db, w.session_id, w.task.instruction, diff)
        result = judge_session(spec, t, self.cfg.backend_url)
        w.stats["judge"] = result.info()
        return combine(outcome, result.score, spec)

    def _grade_tests(self, w: Work, ev: TestsEvaluator) -> tuple[float, str | None]:
        """The session's diff (taken in a fresh evaluation sandbox, read from its stdout, kept
        in w.diff), applied to a fresh copy of the task's environment (its image again,
        prepare then eval_prepare), where its tests run under the grader's runner (grading.py):
        1.0 when every listed test PASSED in the runner's own report, 0.0 otherwise. What the
        session caused (no .git, a diff that does not apply or is refused, a run that died or
        tampered) scores 0.0 here; the grader's own failures raise (GradingUnavailable,
        SetupError, OSError: unscored). The per-test results are kept in stats ("tests")."""
        t0 = time.monotonic()
        rt = w.task.runtime
        try:
            ebox = w.box.evaluation_box()
            try:
                env = _box_env(ebox)
                limit = grading.diff_limit(getattr(getattr(ebox, "limits", None), "log", None))
                script = grading.diff_script(ebox.inside_workdir, w.task.workspace.commit, ev.exclude, limit)
                r = ebox.run(["/bin/sh", "-c", script], env, 300.0, grading.DIFF_LOG)
                data = ebox.output_of(grading.DIFF_LOG, limit + 1)
            finally:
                ebox.teardown()
            if len(data) > limit or r.exit_code == grading.SIGPIPE_EXIT or (r.limit and r.limit.name == "log"):
                w.stats["diff_bytes"] = len(data)
                return 0.0, f"the diff is larger than the {limit / (1 << 20):.1f} MiB the tests evaluator grades"
            if r.limit is not None:
                return 0.0, f"taking the session's diff: {r.limit.reason}"
            if r.timed_out:
                return 0.0, "taking the session's diff timed out after 300s"
            if r.exit_code != 0:
                why = grading.diff_failure(r.exit_code)
                if why is None:
                    raise GradingUnavailable(f"taking the session's diff failed (exit {r.exit_code}): "
                                             f"{r.output_tail[-300:].strip()}")
                return 0.0, why
            w.diff = data
            w.stats["diff_bytes"] = len(data)
            if not data.strip():
                return 0.0, "empty diff: the session changed nothing the tests evaluator grades"
            actions = [*rt.prepare, *rt.eval_prepare] if rt is not None else None
            fresh = self.runtime.prepare(f"{w.session_id}.eval", w.task.workspace, rt, actions=actions,
                                         **({"limits": w.task.limits} if w.task.limits else {}))
            try:
                # written by the node into the fresh sandbox's own TMPDIR before anything runs there
                run = grading.GradingRun.make(fresh.tmp, ev, fresh.inside_workdir, data,
                                              pidns=getattr(fresh, "kind", "") == "bwrap")
                made = run.identity()
                fenv = _box_env(fresh)
                er = fresh.run(["/bin/sh", "-c", grading.grade_script(ev, fresh.inside_workdir, fresh.tmp)], fenv,
                               ev.timeout, "tests")
                started, refused = run.started(), run.refused()
                same_dir = run.identity() == made
                report = run.report() if same_dir else None
                log = grading.read_log(fresh.logs, "tests") if ev.log_parser == "swebench" else b""
            finally:
                fresh.teardown()
            w.stats["eval_output"] = session_auth.redact(er.output_tail)[-OUTPUT_CHARS:]
            if not started or er.exit_code == grading.GRADER_BROKEN:
                if er.cancelled:
                    return 0.0, "cancelled while grading"
                raise GradingUnavailable(f"the grading sandbox could not run the tests' runner (exit {er.exit_code}"
                                         f"{', timed out' if er.timed_out else ''}): {er.output_tail[-300:].strip()}")
            if er.limit is not None:
                return 0.0, f"the tests were ended: {er.limit.reason}"
            if er.timed_out:
                return 0.0, f"the tests timed out after {ev.timeout:g}s"
            if er.exit_code == grading.DOES_NOT_APPLY:
                return 0.0, "the diff does not apply to the task's repository"
            if er.exit_code == grading.REFUSED:
                return 0.0, "the tests evaluator refuses the diff: " + ("; ".join(refused[:3]) or "see eval_output")
            if ev.log_parser == "swebench":
                g = grading.grade_log(log.decode("utf-8", "replace"), er.exit_code, ev)
            elif not same_dir:
                g = grading.grade_report(None, er.exit_code, ev)
                g.reason = "the verdict's directory was replaced during the run"
            else:
                g = grading.grade_report(report, er.exit_code, ev)
            w.stats["tests"] = g.tests
            return g.reward, None if g.resolved else g.summary()
        finally:
            w.stats["eval_s"] = round(time.monotonic() - t0, 3)

    def _failed(self, w: Work, reason: str) -> None:
        """The policy's failure (its harness run or its answer): its task's on_failure says
        its reward (rewards.failure_reward)."""
        self._report(w, Session.FAILED, reward=failure_reward(w.task.on_failure), reason=reason,
                     stats=self._stats(w))

    def _store_rewards(self) -> None:
        """The settled rewards, all those waiting in one write: each write takes the database
        from the proxy's loader and gives it back, so one per session was one per heartbeat's
        worth of sessions too many."""
        db = self.cfg.db
        stopping = False
        while not stopping:
            sids = [self._settled.get()]
            while True:
                try:
                    sids.append(self._settled.get_nowait())
                except queue.Empty:
                    break
            stopping = None in sids
            with self._lock:
                records = [r for sid in filter(None, sids) if (r := self._unsettled.pop(sid, None)) is not None]
            if not records or db is None:
                continue
            try:
                write_rewards({db: records})
            except Exception:   # the server holds them too: the loop and `rollout` store them from there
                log.exception("storing the rewards of %s failed", ", ".join(r["session_id"] for r in records))

    def _released(self, w: Work) -> tuple[ReleaseCause, str] | None:
        """Why the session goes back to the server unscored, if it does: its recorded calls
        (release_cause), or the probe found the backend down while it ran."""
        found = release_cause(self._stats(w))
        if found is not None:
            return found
        if w.outages is not None and (self.outages != w.outages or not self._backend_up.is_set()):
            return (ReleaseCause.BACKEND_UNAVAILABLE,
                    f"the model backend went down while it ran ({self.backend_error or 'back up since'})")
        if w.epoch is not None:
            # The gateway reads vLLM's weight tag again now: a restart, or a sync it did not
            # make, while the session ran means its calls' versions cannot be vouched for.
            now = self._verify_gateway()
            if now is not None and now != w.epoch:
                return (ReleaseCause.VERSION_UNKNOWN, "policy version unknown: the gateway lost track of the "
                        "weights its backend served while the session ran")
        return None

    def _gateway_epoch(self) -> int | None:
        """How many times the gateway found its backend serving other weights than it set (a
        restart, a foreign sync; its health check; None without a control token, or where it
        does not answer)."""
        if not self.cfg.control_token:
            return None
        try:
            r = self._control("/_polar/health")
            return int(r.json()["policy"]["losses"]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def _verify_gateway(self) -> int | None:
        """That count after a fresh read of vLLM's weight tag (/_polar/verify)."""
        try:
            r = self._control("/_polar/verify", {})
            return int(r.json()["losses"]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def _stats(self, w: Work) -> dict:
        """Its stats, with its call stats (read once: every call its harness got an answer to
        is recorded by the time it exits)."""
        stats = {k: v for k, v in w.stats.items() if k != "assigned_at"}
        if w.calls is None and self._call_stats is not None and Path(self._call_stats.db).exists():
            try:
                w.calls = dict(self._call_stats.get(w.session_id))
            except Exception as e:     # stats are nice to have; the reward is what counts
                stats["stats_error"] = str(e)
        stats.update(w.calls or {})
        return stats
