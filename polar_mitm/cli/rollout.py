"""polar-mitm rollout | rollout-server | node | harness: the CLI of the rollout half.

`polar-mitm rollout` exits 0 when every session settled and none failed; 1 on an error (bad
input, a dead --backend, a service that stopped: the message says which); 3 when the run
finished but sessions failed or a callback was not delivered; 130 after Ctrl-C (SIGINT)
and 143 after SIGTERM (the sessions in flight go back in the queue: a rerun resumes).
`rollout-server` and `node` run until stopped: 130 after Ctrl-C, 143 after SIGTERM.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import click

from ..stack import launch
from ..grpo.advantages import group_stats, no_signal
from ..rollout import RolloutServer
from ..rollout import harnesses
from ..rollout.protocol import Group, SessionResult
from ..rollout.judging import judge_groups
from ..rollout.rewards import release_causes, store_settled
from ..rollout.spec import TaskChanged, TaskExists, TaskRequest, spec_changes, task_from_json
from ..rollout.states import ORDER, OUTCOMES, RELEASE_CAUSE, TASK_SETTLED, TERMINAL, Callback, ReleaseCause, Session
from .params import (MAX_TOKENS, MAX_TOKENS_OR_NONE, PORT_OR_ANY, WORKERS, allowed_host_option, backend_option,
                     check_model_dir, check_port_free, db_file, db_option, server_root, session_limit_option)
from .lifecycle import LongRunning
from ..stack.local import Stack, check_backend, check_workspaces, ensure_harnesses, read_tasks
from ..stack.vllm import vllm_options
from ..store import figures as store_figures
from ..store import rollout_journal

EXIT_FAILED = 3       # the run finished, but sessions failed or a callback was not delivered


def stored_changes(db: str, tasks: list[TaskRequest]) -> dict[str, list[str]]:
    """The tasks already in db under another spec: task_id -> what changed."""
    if not Path(db).exists():
        return {}
    rollout_journal.ensure(db)
    stored = {t["task_id"]: t["spec"] for t in rollout_journal.load(db)[0]}
    changed = {}
    for t in tasks:
        if t.task_id in stored:
            changes = spec_changes(task_from_json(stored[t.task_id]), t)
            if changes:
                changed[t.task_id] = changes
    return changed


# -- the figures an RL user watches ------------------------------------------------------------
def reward_figures(sessions: list[SessionResult]) -> dict | None:
    """A group's rewards: n, mean, std, min, max, and flat when the trainer finds no signal
    in it (grpo/advantages.py's group_stats and no_signal: such a group is left out of
    training)."""
    rewards = [float(s["reward"]) for s in sessions if s["reward"] is not None]
    if not rewards:
        return None
    stats = group_stats(rewards)
    return {"n": stats.n, "mean": stats.mean, "std": stats.std, "min": min(rewards),
            "max": max(rewards), "flat": no_signal(stats)}


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _count(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.0f}"


class RunFigures:
    """What `rollout` shows while it runs and in its summary, for the tasks of this run: counts
    per state, rewards per group, sessions per minute and an ETA (from the server's state), and
    calls and tokens per session and the backend's busy share (from the recorded calls, read
    from the database every `db_every` seconds: store/figures.py)."""

    def __init__(self, server: RolloutServer, db: str, task_ids: list[str], db_every: float = 15.0,
                 print_every: float = 30.0):
        self.server, self.db, self.ids = server, db, list(task_ids)
        self.db_every, self.print_every = db_every, print_every
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.end: float | None = None           # monotonic, once every task settled
        self.groups: dict[str, Group] = {tid: server.group(tid) for tid in self.ids}
        self.baseline = self._finished()        # finished before this run (a resumed one)
        self.announced = {tid for tid, g in self.groups.items() if g["state"] in TASK_SETTLED}
        self.calls: dict[str, store_figures.SessionCalls] = {}
        self.counted: list[str] = []            # the finished sessions self.calls covers
        self.busy: store_figures.BackendBusy | None = None
        self._read_at = -1e9
        self._printed_at, self._printed = -1e9, ""

    # -- state ----------------------------------------------------------------------------
    def refresh(self, read_db: bool | None = None) -> None:
        self.groups = {tid: self.server.group(tid) for tid in self.ids}
        now = time.monotonic()
        if read_db or (read_db is None and now - self._read_at >= self.db_every):
            self._read_at = now
            until = self.wall0 + self.elapsed()
            # A finished session's calls are all recorded (the proxy answers a call once it is
            # durable, and a reader gets everything answered): these are counted whole.
            finished = [s["session_id"] for s in self._latest() if s["state"] in OUTCOMES]
            try:
                self.calls, self.busy = store_figures.run_figures(self.db, self._attempt_ids(), self.wall0,
                                                                  until, timeout=30.0)
                self.counted = finished
            except Exception as e:   # figures are nice to have: never stop a run for them
                click.echo(f"(figures from {self.db} not read: {e})", err=True)

    def stop_clock(self) -> None:
        self.end = time.monotonic()

    def elapsed(self) -> float:
        return (self.end if self.end is not None else time.monotonic()) - self.t0

    def _latest(self) -> list[SessionResult]:
        return [s for g in self.groups.values() for s in g["sessions"]]

    def _attempt_ids(self) -> list[str]:
        return [s["session_id"] for g in self.groups.values() for s in g["sessions"] + g["attempts"]]

    def _finished(self) -> int:
        return sum(1 for s in self._latest() if s["state"] in OUTCOMES)     # ran to an outcome

    def rate(self) -> float | None:
        """Sessions finished per minute in this run."""
        n, minutes = self._finished() - self.baseline, self.elapsed() / 60
        return n / minutes if n > 0 and minutes > 0 else None

    def eta(self) -> float | None:
        """Seconds until every sample settles, at this run's rate so far."""
        left = sum(1 for s in self._latest() if s["state"] not in TERMINAL)
        rate = self.rate()
        return 0.0 if not left else (left / rate * 60 if rate else None)

    def per_session(self) -> dict | None:
        """Mean calls, failed calls, prompt and completion tokens over the sessions finished
        by the last read of the database."""
        done = self.counted
        if not done:
            return None
        zero = store_figures.SessionCalls(calls=0, failed_calls=0, prompt_tokens=0, completion_tokens=0)
        rows: list[Mapping[str, Any]] = [self.calls.get(sid, zero) for sid in done]
        return {k: sum(r[k] for r in rows) / len(rows) for k in zero} | {"sessions": len(rows)}

    def flat_groups(self) -> tuple[list[str], int]:
        """Settled groups whose rewards are all equal, and how many groups settled with rewards."""
        settled = [tid for tid, g in self.groups.items() if g["state"] in TASK_SETTLED]
        figs = {tid: reward_figures(self.groups[tid]["sessions"]) for tid in settled}
        with_rewards = [tid for tid, f in figs.items() if f]
        return [tid for tid, f in figs.items() if f and f["flat"]], len(with_rewards)

    def cancel_reasons(self) -> Counter:
        """Why the samples that were cancelled were: a session its node stopped says only
        "cancelled", and its task's reason (an early stop, a cancel request) says why."""
        out: Counter = Counter()
        views = self.server.task_views(self.ids)
        for tid, g in self.groups.items():
            task_reason = views[tid].cancel_reason if tid in views else None
            for s in g["sessions"]:
                if s["state"] == Session.CANCELLED:
                    reason = s["reason"] if s["reason"] not in (None, "", "cancelled") else task_reason
                    out[(reason or "cancelled")[:120]] += 1
        return out

    def rerun_reasons(self) -> Counter:
        """Attempts that ran again under a new name: released (handed back), by cause (backend
        unavailable, policy version unknown, node stopped), or lost, by reason."""
        out: Counter = Counter()
        for g in self.groups.values():
            for s in g["attempts"]:
                cause = (s["stats"] or {}).get(RELEASE_CAUSE)
                if s["state"] == Session.RELEASED and cause in set(ReleaseCause):
                    out[f"released: {ReleaseCause(cause).label}"] += 1
                elif s["state"] in (Session.RELEASED, Session.LOST):
                    out[f"{s['state']}: {(s['reason'] or '')[:110]}"] += 1
        return out

    def released(self) -> Counter:
        """Released attempts by cause (rewards.release_causes)."""
        return release_causes(self.groups.values())

    # -- lines ----------------------------------------------------------------------------
    def group_line(self, tid: str) -> str:
        g, f = self.groups[tid], reward_figures(self.groups[tid]["sessions"])
        if f is None:
            return f"group {tid} {g['state']}: no rewards"
        flat = "  ! zero variance: no signal" if f["flat"] else ""
        return (f"group {tid} {g['state']}: reward mean {f['mean']:.3f} std {f['std']:.3f} "
                f"min {f['min']:.3f} max {f['max']:.3f} (n={f['n']}){flat}")

    def line(self) -> str:
        counts = Counter(s["state"] for s in self._latest())
        parts = " ".join(f"{k} {counts[k]}" for k in ORDER if counts.get(k))
        rewards = [s["reward"] for s in self._latest() if s["reward"] is not None]
        reward = (f"mean reward {sum(rewards) / len(rewards):.3f} (n={len(rewards)})" if rewards
                  else "no rewards yet")
        out = [f"sessions: {parts or '-'}", reward]
        rate, eta = self.rate(), self.eta()
        if rate:
            out.append(f"{rate:.1f} sessions/min" + (f", ETA {_duration(eta)}" if eta else ""))
        per = self.per_session()
        if per:
            out.append(f"per session {per['calls']:.1f} calls, {_count(per['prompt_tokens'])} prompt + "
                       f"{_count(per['completion_tokens'])} completion tokens")
        if self.busy and self.busy["share"] is not None and self.busy["window_s"] >= 1:
            out.append(f"backend busy {self.busy['share']:.0%}")
        flat, settled = self.flat_groups()
        if flat:
            out.append(f"zero-variance groups {len(flat)} of {settled}")
        released = self.released()
        if released:
            out.append(f"released {sum(released.values())} (" +
                       ", ".join(f"{k} {v}" for k, v in released.most_common()) + ")")
        paused = sorted({n["paused"] for n in self.server.status().get("nodes", {}).values()
                         if n.get("paused") and not n.get("lost")})
        if paused:
            out.append(f"paused: {paused[0]}")
        return f"[{self.elapsed():6.0f}s] " + " | ".join(out)

    def tick(self, final: bool = False) -> list[str]:
        """The lines to print now: a group's figures as it settles, and the progress line when
        the sessions' states or rewards changed, or every print_every seconds (final: always,
        with the figures read from the database now)."""
        self.refresh(read_db=True if final else None)
        out = []
        for tid, g in self.groups.items():
            if tid not in self.announced and g["state"] in TASK_SETTLED:
                self.announced.add(tid)
                out.append(self.group_line(tid))
        line = self.line()
        key = line.split("] ", 1)[1].split(" | ")[:2]
        now = time.monotonic()
        if final or out or " | ".join(key) != self._printed or now - self._printed_at >= self.print_every:
            self._printed, self._printed_at = " | ".join(key), now
            out.append(line)
        return out


def print_summary(server: RolloutServer, task_ids: list[str], run: RunFigures | None = None) -> None:
    """Per task: states and the reward's mean, std, min and max (zero variance flagged); then
    sessions per minute, calls and tokens per session, the backend's busy share, the groups
    with no signal and why sessions were cancelled or ran again."""
    if run is None:
        run = RunFigures(server, server.db, task_ids)
        run.stop_clock()
    run.refresh(read_db=run.busy is None)
    click.echo(f"\n{'task':24} {'state':10} {'done':>5} {'timeout':>7} {'failed':>6} {'other':>5} "
               f"{'n':>4} {'mean':>7} {'std':>7} {'min':>7} {'max':>7}")
    for tid in task_ids:
        g = run.groups[tid]
        states = [s["state"] for s in g["sessions"]]
        f = reward_figures(g["sessions"])
        done, timed_out, failed = (states.count(k) for k in (Session.DONE, Session.TIMED_OUT, Session.FAILED))
        other = len(states) - done - timed_out - failed
        figs = (f"{f['n']:>4} {f['mean']:>7.3f} {f['std']:>7.3f} {f['min']:>7.3f} {f['max']:>7.3f}"
                + ("  ! zero variance: no signal" if f["flat"] else "")) if f else f"{0:>4} {'-':>7}"
        click.echo(f"{tid[:24]:24} {g['state']:10} {done:>5} {timed_out:>7} {failed:>6} {other:>5} {figs}")
        for s in g["sessions"]:
            if s["state"] == Session.FAILED:
                click.echo(f"  {s['session_id']}: {(s['reason'] or '')[:160]}")
    n = run._finished() - run.baseline
    rate = run.rate()
    click.echo(f"\n{n} session(s) finished in {_duration(run.elapsed())}"
               + (f": {rate:.1f} sessions/min" if rate else "")
               + (f" ({run.baseline} finished before this run)" if run.baseline else ""))
    per = run.per_session()
    if per:
        click.echo(f"per session ({per['sessions']}): {per['calls']:.1f} calls ({per['failed_calls']:.1f} failed), "
                   f"{per['prompt_tokens']:.0f} prompt + {per['completion_tokens']:.0f} completion tokens")
    b = run.busy
    if b and b["share"] is not None:
        together = f", {b['call_s'] / b['busy_s']:.1f} at once while busy" if b["busy_s"] else ""
        click.echo(f"model backend busy {b['share']:.1%} of the wall time ({b['busy_s']:.1f}s of "
                   f"{b['window_s']:.1f}s with at least one call at the backend; {b['calls']} calls{together})")
    init = init_line([s for tid in task_ids for s in run.groups[tid]["sessions"] + run.groups[tid]["attempts"]])
    if init:
        click.echo(init)
    flat, settled = run.flat_groups()
    if flat:
        click.echo(f"zero-variance groups (no GRPO signal): {len(flat)} of {settled}: {', '.join(flat[:10])}"
                   + (" ..." if len(flat) > 10 else ""))
    for title, reasons in (("cancelled", run.cancel_reasons()), ("ran again", run.rerun_reasons())):
        if reasons:
            click.echo(f"{title}: " + "; ".join(f"{k} x{v}" for k, v in reasons.most_common(8)))


def init_line(sessions: list) -> str | None:
    """INIT per session (its set-up: directories, workspace, image layer, prepare actions),
    and of it what pulling and unpacking images took, by image: cold unpacks, cached ones."""
    took = sorted(st["init_s"] for s in sessions if isinstance(st := (s.get("stats") or {}), dict)
                  and isinstance(st.get("init_s"), (int, float)))
    if not took:
        return None
    unpacks = [st["image_unpack_s"] for s in sessions if isinstance(st := (s.get("stats") or {}), dict)
               and isinstance(st.get("image_unpack_s"), (int, float))]
    line = f"INIT per session ({len(took)}): median {took[len(took) // 2]:.2f}s, max {took[-1]:.2f}s"
    if unpacks:
        cold = [u for u in unpacks if u > 0]
        line += (f"; in an image: {len(unpacks) - len(cold)} cached" +
                 (f", {len(cold)} unpacked it ({max(cold):.1f}s at most)" if cold else ""))
    return line


def callback_line(server: RolloutServer, task_ids: list[str]) -> str | None:
    """Once every task settled, what `rollout` still waits for: the callbacks not yet
    delivered, per URL, with the last try's error, the next try and the most time left."""
    views = server.task_views(task_ids)
    if not all(views[tid].state in TASK_SETTLED for tid in task_ids):
        return None
    pending = server.pending_callbacks(task_ids)
    if not pending:
        return None
    by_url: dict[str, list[dict]] = {}
    for p in pending:
        by_url.setdefault(str(p["url"]), []).append(p)
    parts = []
    for url, ps in by_url.items():
        p = max(ps, key=lambda p: p["left_s"])
        tried = (f"try {p['tries']} of {p['of']} failed ({p['error']}), next in {p['next_in']:.0f}s"
                 if p["tries"] and p["error"] else f"try {p['tries'] + 1} of {p['of']}")
        parts.append(f"{len(ps)} callback(s) to {url}: {tried}; gives up within {p['left_s']:.0f}s")
    return "waiting for " + "; ".join(parts)


def outcome_code(server: RolloutServer, task_ids: list[str]) -> int:
    """EXIT_FAILED when a session failed or a callback was not delivered (said on stderr)."""
    failed = sum(1 for tid in task_ids for s in server.group(tid)["sessions"] if s["state"] == Session.FAILED)
    views = server.task_views(task_ids)
    undelivered = [tid for tid in task_ids if views[tid].callback_state == Callback.FAILED]
    if failed:
        click.echo(f"{failed} session(s) failed", err=True)
    if undelivered:
        click.echo(f"callback not delivered: {', '.join(undelivered[:10])}", err=True)
    return EXIT_FAILED if failed or undelivered else 0


@click.command()
@click.argument("tasks_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--harness", type=click.Choice(list(harnesses.HARNESSES)), default=None,
              help=f"For tasks that name none (default {harnesses.DEFAULT})")
@click.option("--samples", type=click.IntRange(1, 1024), default=None, help="num_samples for tasks that give none")
@db_option
@backend_option()
@click.option("--workers", default=4, show_default=True, type=WORKERS, help="RUN slots (and INIT workers)")
@click.option("--max-tokens", default=512, show_default=True, type=MAX_TOKENS,
              help="Cap on each call's output tokens")
@click.option("--port", default=0, type=PORT_OR_ANY, help="Rollout server port (0: any free port)")
@click.option("--model", default="", help="Serve this model directory (a checkpoint) instead of the default")
@vllm_options
@click.option("--on-changed", type=click.Choice(["error", "keep"]), default="error", show_default=True,
              help="A task already in --db with another spec: error, or keep (resume the stored one as it was)")
@session_limit_option
def rollout(tasks_file, harness, samples, db, backend, workers, max_tokens, port, model, vllm, on_changed,
            session_limits):
    """Run a task file end to end on this machine: model, proxy, rollout server, one node.

    Exit status: 0 all sessions settled and none failed; 1 an error; 3 sessions failed
    (or a callback was not delivered); 130 after Ctrl-C, 143 after SIGTERM."""
    with LongRunning("nothing had started yet") as life:
        check_port_free(port)
        if model and not backend:
            check_model_dir(model)
        tasks, changed = _checked(tasks_file, harness, samples, db, backend, on_changed)
        work = _work_dir(db)
        stack = life.stops(Stack())
        life.after = ("sessions in flight were stopped and go back in the queue; rerun the same command "
                      "to resume")
        backend = backend or stack.start_model(work, vllm, model=model)
        # a token even on loopback: a session in the fallback sandbox shares the node's network
        server = stack.start_server(db, port=port, token=secrets.token_urlsafe(32))
        stack.start_node(db=db, backend=backend, work=work, proxy_port=launch.free_port(),
                         workers=workers, max_tokens=max_tokens, server_url=server.url, limits=session_limits,
                         server_token=server.token)
        ids = _submit(server, tasks, changed, on_changed, db)
        run = _watch(server, stack, ids, db)
        _store_rewards(stack, server, ids, db, backend)
        print_summary(server, ids, run)
        code = outcome_code(server, ids)
        if code:
            sys.exit(code)


def _checked(tasks_file, harness, samples, db, backend, on_changed):
    """Everything that can be checked is, before anything starts; the tasks, and those
    stored under another spec (task_id -> what changed)."""
    tasks = read_tasks(tasks_file, harness, samples)
    check_workspaces(tasks)
    changed = stored_changes(db, tasks)
    for tid, changes in changed.items():
        if on_changed == "error":
            raise click.ClickException(
                f"{tid}: already in {db} with another spec ({'; '.join(changes)}); give the changed task a "
                f"new task_id, use another --db, or --on-changed keep to resume the stored one as it was")
        click.echo(f"{tid}: already in {db} with another spec ({'; '.join(changes)}); "
                   f"resuming the stored one (--on-changed keep)", err=True)
    if backend:
        check_backend(backend)
    ensure_harnesses(t.harness for t in tasks)
    return tasks, changed


def _work_dir(db: str) -> Path:
    """The sessions' directories and the services' logs: beside the database, or
    $POLAR_ROLLOUT_WORK."""
    work = Path(os.environ.get("POLAR_ROLLOUT_WORK") or Path(db).resolve().parent / f".{Path(db).name}.rollout")
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    return work


def _submit(server: RolloutServer, tasks: list[TaskRequest], changed: dict[str, list[str]], on_changed: str,
            db: str) -> list[str]:
    """Each task to the server, its ids in order; one already in db resumes (one stored under
    another spec: as stored, with --on-changed keep)."""
    ids = []
    for t in tasks:
        try:
            server.submit(t)
        except TaskExists:
            click.echo(f"{t.task_id}: already in {db}; resuming it")
        except TaskChanged as e:
            if on_changed == "error":
                raise click.ClickException(f"{e}; or --on-changed keep")
            if t.task_id not in changed:
                click.echo(f"{t.task_id}: {e}; resuming the stored one (--on-changed keep)", err=True)
        ids.append(t.task_id)
    views = server.task_views(ids)
    click.echo(f"rollout server {server.url}; {len(ids)} task(s), "
               f"{sum(views[tid].spec.num_samples for tid in ids)} session(s); database {db}")
    return ids


def _watch(server: RolloutServer, stack: Stack, ids: list[str], db: str) -> RunFigures:
    """Until every task settled and its callback was delivered or given up: the figures as
    they change, the callbacks waited for (a line per try), and an error when a service stops."""
    run = RunFigures(server, db, ids)
    waiting = ""
    while not server.wait(ids, timeout=2.0):
        for line in run.tick():
            click.echo(line)
        callbacks = callback_line(server, ids)
        if callbacks and re.sub(r", next in \d+s", "", callbacks) != waiting:
            waiting = re.sub(r", next in \d+s", "", callbacks)
            click.echo(callbacks, err=True)
        if stack.dead():
            raise click.ClickException(f"a service stopped: {stack.why_dead()}")
    run.stop_clock()
    for line in run.tick(final=True):
        click.echo(line)
    return run


def _store_rewards(stack: Stack, server: RolloutServer, ids: list[str], db: str, backend: str) -> None:
    """The settled groups' rewards, judged where a judge is asked for, into db."""
    # The node first: it stores the rewards the server settled before it returns (two
    # writers of one row in this process would conflict).
    stack.stop_nodes()
    # the server's record of each group, stored (a node killed before it stored a
    # settled reward left it out)
    # (the stored spec: under --on-changed keep, the one that ran)
    groups = {tid: server.group(tid) for tid in ids}
    specs = {tid: view.spec for tid, view in server.task_views(ids).items()}
    for line in judge_groups(groups, specs, db, backend):
        click.echo(line)
    store_settled(groups, specs, db)


@click.command("rollout-server")
@db_option
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8090, show_default=True, type=PORT_OR_ANY, help="0: any free port")
@click.option("--node-timeout", default=10.0, show_default=True, help="Seconds without a heartbeat")
@click.option("--check-workspaces/--no-check-workspaces", "workspace_check", default=True, show_default=True,
              help="Refuse a task whose workspace (directory, git repo, commit) is not on this machine; "
                   "turn off when workspaces exist only on the nodes")
@allowed_host_option
@click.option("--token-file", default=None, type=click.Path(dir_okay=False),
              help="The bearer token every request must carry (a fresh one is written there, mode 0600, "
                   "where there is no file); default: none on loopback, DB.token beyond it")
def rollout_server(db, host, port, node_timeout, workspace_check, allowed_hosts, token_file):
    """Serve the rollout API (POST /tasks, GET /tasks/ID, POST /tasks/ID/cancel, GET /status)."""
    from ..rollout.web_guard import TokenError, is_loopback, load_token

    with LongRunning() as life:
        check_port_free(port, host)
        if token_file is None and not is_loopback(host):
            token_file = f"{db}.token"
        try:
            token = load_token(token_file, create=True) if token_file else None
        except TokenError as e:
            raise click.BadParameter(str(e), param_hint="'--token-file'") from None
        stack = life.stops(Stack())
        try:
            server = stack.start_server(db, host=host, port=port, node_timeout=node_timeout,
                                        check_workspaces=workspace_check, token=token,
                                        allowed_hosts=allowed_hosts)
        except OSError as e:   # taken since the check
            raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        click.echo(f"rollout server on {server.url}, state in {db}"
                   + (f"; requests need the bearer token in {token_file} (nodes: --token-file)" if token else ""))
        life.wait(stack)


@click.command()
@click.option("--server", "server_url", required=True, callback=server_root,
              help="The rollout server's root URL (http://HOST:PORT)")
@click.option("--backend", required=True, callback=server_root, help="The vLLM server's root URL (http://HOST:PORT)")
@click.option("--db", default="node.duckdb", show_default=True, callback=db_file,
              help="This node's own call database")
@click.option("--proxy-port", default=0, type=PORT_OR_ANY, help="0: any free port")
@click.option("--workers", default=4, show_default=True, type=WORKERS)
@click.option("--max-tokens", default=0, type=MAX_TOKENS_OR_NONE, help="Cap on each call's output tokens (0: none)")
@click.option("--node-id", default=None)
@click.option("--token-file", default=None, type=click.Path(dir_okay=False),
              help="The rollout server's bearer token (its --token-file, copied here with mode 0600); "
                   "needed once it listens beyond loopback")
@session_limit_option
def node(server_url, backend, db, proxy_port, workers, max_tokens, node_id, token_file, session_limits):
    """Run a gateway node: the proxy plus the INIT, RUN and POST_RUN pools. It pauses
    (takes no work, starts no harness) while its backend does not answer."""
    from ..rollout.web_guard import TokenError, load_token

    try:
        server_token = load_token(token_file) if token_file else None
    except TokenError as e:
        raise click.BadParameter(str(e), param_hint="'--token-file'") from None
    with LongRunning() as life:
        check_port_free(proxy_port, option="--proxy-port")
        check_backend(backend)
        work = Path(db).resolve().parent / f".{Path(db).name}.node"
        work.mkdir(mode=0o700, parents=True, exist_ok=True)
        stack = life.stops(Stack())
        gw = stack.start_node(db=db, backend=backend, work=work, proxy_port=proxy_port or launch.free_port(),
                              workers=workers, max_tokens=max_tokens or None, server_url=server_url,
                              node_id=node_id, server_token=server_token, limits=session_limits)
        click.echo(f"node {gw.cfg.node_id}: proxy on 127.0.0.1:{gw.cfg.proxy_port}, database {db}")
        life.wait(stack)


@click.group()
def harness():
    """The harness CLIs, installed from npm at pinned versions."""


@harness.command("install")
@click.argument("names", nargs=-1, required=True,
                type=click.Choice(list(harnesses.PACKAGES) + ["all"]))
def harness_install(names):
    """Install CLIs into the cache (~/.cache/polar-mitm/harnesses)."""
    for name in (harnesses.PACKAGES if "all" in names else names):
        pkg = harnesses.PACKAGES[name]
        click.echo(f"{name}: {pkg.npm}@{pkg.version} -> {harnesses.install(name)}")


@harness.command("list")
def harness_list():
    """Pinned versions and where each CLI is found."""
    for name, pkg in harnesses.PACKAGES.items():
        try:
            where = str(harnesses.executable(name))
        except harnesses.HarnessMissing:
            where = "not installed"
        click.echo(f"{name:7} {pkg.npm}@{pkg.version}  {where}")


@click.command("session-output")
@click.argument("session_id")
@click.option("--db", default="rollouts.duckdb", show_default=True, help="The rollout server's database")
@click.option("--timeout", default=30.0, show_default=True,
              help="Seconds to wait while the proxy holds the write lock")
def session_output(session_id, db, timeout):
    """A session's outcome and its kept output: the tail of its harness's stdout and stderr,
    and of its evaluator's (rollout_sessions.harness_output, eval_output)."""
    import duckdb

    try:
        out = rollout_journal.session_output(db, session_id, timeout=timeout)
    except (FileNotFoundError, duckdb.Error) as e:
        raise click.ClickException(str(e)) from None
    if out is None:
        raise click.ClickException(f"no session {session_id} in {db}")
    reward = "-" if out["reward"] is None else f"{out['reward']:g}"
    exit_code = "-" if out["exit_code"] is None else out["exit_code"]
    click.echo(f"session {out['session_id']} (task {out['task_id']}, node {out['node_id'] or '-'}): "
               f"{out['state']}, reward {reward}, harness exit code {exit_code}")
    if out["reason"]:
        click.echo(f"reason: {out['reason']}")
    for title, text in (("harness output", out["harness_output"]), ("evaluator output", out["eval_output"])):
        click.echo(f"--- {title} ---")
        click.echo(text.rstrip("\n") if text else "(none kept)")


def register(main: click.Group) -> None:
    """The rollout half's commands, on `polar-mitm`."""
    for command in (rollout, rollout_server, node, harness, session_output):
        main.add_command(command)
