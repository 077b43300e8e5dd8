"""One iteration of the loop, as named steps, each with a typed result:

  rollouts         -> Rollouts        the iteration's tasks through the rollout server, scored
  trainable_calls  -> TrainableCalls  rewards stored, the calls read back, their stale tokens masked
  train            -> Trained         GRPO on them (vLLM asleep meanwhile under --colocate), saved
  publish_and_sync -> Synced          every node's vLLM on the new version
  record           -> IterationRow    one row, built once from the parts, stored and logged

Loop holds what lives across iterations (the options, the trainer, the nodes, loop.json)."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import click

from ..addons.sync_report import SyncFigures, SyncReport, slowest
from ..grpo.advantages import group_stats, no_signal
from ..grpo.calls import Fresh, at_most_stale
from ..grpo.config import TrainConfig
from ..grpo.results import StepMetrics, TrainResult
from ..rollout.client import ServerClient, ServerError
from ..rollout.judging import judge_groups
from ..rollout.protocol import Group, SessionResult, WeightPull
from ..rollout.rewards import UnreachableDatabases, incomplete, release_causes, store_settled
from ..rollout.spec import TaskRequest
from ..rollout.states import TASK_SETTLED, TERMINAL, Session
from ..session_ids import TASK_ID_MAX, run_task_id, task_of_run
from ..stack.local import Stack
from ..store.loop import IterationRow, TaskRewards, record_iteration, record_version
from ..store.training import TrainingData, training_calls
from ..trainer_input import Call
from .options import LoopOptions
from .state import LoopError, LoopState, Saved, prune
from .trackers import Trackers

if TYPE_CHECKING:
    from ..cluster.ray_stack import RayStack
    from ..grpo.weight_server import WeightServer
    from ..grpo.train import Trainer


@dataclass(frozen=True)
class Submitted:
    """A task as this run submitted it for one iteration."""
    task_id: str              # TASK@RUN.I (held out: TASK@RUN.I.eval): its own GRPO group
    spec: TaskRequest         # the task as read (task_id TASK)


@dataclass(frozen=True)
class Tasks:
    train: list[TaskRequest]
    held_out: list[TaskRequest]


@dataclass
class Nodes:
    """The rollout server's nodes, as the loop drives them; the services this process
    started are checked while it waits. On a Ray cluster (cluster/ray_stack.py) the stack
    owns the vLLM replicas: a sync swaps them first, then the gateways take the version; and
    the nodes' recorded calls reach the driver's store before they are read."""
    client: ServerClient
    stack: "Stack | RayStack"

    def check(self) -> None:
        if self.stack.dead():
            raise LoopError(f"a service stopped: {self.stack.why_dead()}")

    def sync(self, version: int, checkpoint: str, asleep: bool = False,
             pull: WeightPull | None = None) -> SyncFigures:
        """Every node's gateway and vLLM to (version, checkpoint), or asleep; the slowest
        node's figures (drain, wake, reload, reset). pull: the weights in the trainer's memory."""
        try:
            # first the target (a replica that restarts from now on loads it), which the
            # gateways of replicas they do not own only adopt
            reports = self.client.sync_nodes(version, checkpoint, asleep, check=self.check, pull=pull)
        except ServerError as e:
            raise LoopError(f"the weight sync to version {version} failed: {e}") from None
        swapped = None
        if self.owns_replicas:
            try:
                swapped = self.stack.swap_replicas(version, pull)   # type: ignore[union-attr]
            except Exception as e:   # noqa: BLE001 (a replica's failure, in the loop's words)
                raise LoopError(f"the weight sync of the replicas to version {version} failed: {one_line(e)}") \
                    from None
        figures = slowest(SyncReport.from_json(r.get("detail")) for r in reports.values())
        return figures if swapped is None else replace(
            figures, mode="inflight", reload_s=max((s["total_s"] for s in swapped), default=None),
            stall_s=max((s["stall_s"] for s in swapped), default=None))

    @property
    def owns_replicas(self) -> bool:
        return hasattr(self.stack, "swap_replicas")

    def calls_in(self) -> None:
        """The calls the nodes recorded so far are in the loop's store (a Ray cluster's are
        shipped to the driver; on one machine they are there already)."""
        calls_in = getattr(self.stack, "calls_in", None)
        if calls_in is not None and not calls_in():
            raise LoopError("the nodes' recorded calls did not reach the driver's store within the timeout")


@dataclass
class Loop:
    """What lives across iterations."""
    opts: LoopOptions
    cfg: TrainConfig
    out: Path
    db: str                   # the loop's own tables (on one machine: the calls' and rewards' too)
    state: LoopState
    tasks: Tasks
    nodes: Nodes
    backend: str | None       # the vLLM of this machine's node (None: a remote server's nodes)
    base: str                 # the initial policy: the KL reference
    trainer: "Trainer"
    trackers: Trackers
    echo: Callable[[str], None]
    folded: threading.Event | None = field(default=None)   # the last iteration's journal fold
    weights: "WeightServer | None" = None    # --weights-from memory: the trainer serves each version

    @property
    def serving(self) -> str:
        return self.state.checkpoint or self.base

    @property
    def local_db(self) -> str | None:
        """The database of this machine's node (None: a remote server's nodes keep their own)."""
        return None if self.opts.server else self.db

    def ahead(self, it: int) -> bool:
        """Whether iteration it + 1's rollouts run while it trains (--max-staleness K >= 1)."""
        return self.opts.max_staleness >= 1 and it + 1 < self.opts.iterations


# 1. rollouts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RolloutFigures:
    reward_mean: float | None
    reward_std: float | None
    reward_n: int
    eval_reward_mean: float | None      # None: held-out tasks not run this iteration
    eval_reward_std: float | None
    eval_reward_n: int | None
    sessions: Counter[str]              # final sessions by state (training tasks)
    released: Counter[str]              # attempts run again, never scored, by cause
    per_task: dict[str, TaskRewards]

    @classmethod
    def of(cls, groups: dict[str, Group], held_out: list[Group]) -> "RolloutFigures":
        per_task: dict[str, TaskRewards] = {}
        for tid, g in groups.items():
            rs = _rewards([g])
            per_task[task_of_run(tid)] = {"mean": _mean(rs), "std": _std(rs), "n": len(rs)}
        rewards, held = _rewards(groups.values()), _rewards(held_out)
        return cls(_mean(rewards), _std(rewards), len(rewards),
                    _mean(held) if held_out else None, _std(held) if held_out else None,
                    len(held) if held_out else None,
                    Counter(str(s["state"]) for g in groups.values() for s in g["sessions"]),
                    release_causes([*groups.values(), *held_out]), per_task)


@dataclass(frozen=True)
class Rollouts:
    train: list[Submitted]
    held_out: list[Submitted]
    groups: dict[str, Group]            # every submitted task's scored group, held-out ones too
    figures: RolloutFigures
    seconds: float


def rollouts(loop: Loop, it: int) -> Rollouts:
    """The iteration's tasks (and held-out ones, when it evaluates) sampled by the policy now
    served; scored, judged where a task's judge scores whole groups."""
    opts, run_id = loop.opts, loop.state.run_id
    if loop.folded is not None:
        loop.folded.wait(60.0)   # most often done already: it ran while the trainer trained
        loop.folded = None
    t0 = time.monotonic()
    train = _submit(loop.nodes.client, loop.tasks.train, run_id, it)
    held_out = _submit(loop.nodes.client, loop.tasks.held_out, run_id, it, held_out=True) \
        if opts.evaluates(it) else []
    groups = _wait_rollouts(loop.nodes, [*train, *held_out],
                            f"iteration {it + 1}/{opts.iterations} rollouts (policy v{loop.state.version})")
    seconds = time.monotonic() - t0
    for line in judge_groups(groups, {t.task_id: t.spec for t in [*train, *held_out]}, loop.local_db,
                             loop.backend):
        loop.echo(f"iteration {it + 1}: {line}")
    server = loop.nodes.stack.server
    if server is not None and not loop.ahead(it):
        # no session runs until the next rollouts, which wait for it: the fold slows no save
        loop.folded = server.fold_soon()
    if loop.ahead(it):
        # The next iteration's rollouts run while this one trains and syncs: sampled by
        # version v until the sync, v + 1 after it (each call knows which).
        _submit(loop.nodes.client, loop.tasks.train, run_id, it + 1)
        if opts.evaluates(it + 1):
            _submit(loop.nodes.client, loop.tasks.held_out, run_id, it + 1, held_out=True)
    figures = RolloutFigures.of({t.task_id: groups[t.task_id] for t in train}, [groups[t.task_id] for t in held_out])
    return Rollouts(train, held_out, groups, figures, seconds)


def _submit(client: ServerClient, tasks: list[TaskRequest], run_id: str, it: int,
            held_out: bool = False) -> list[Submitted]:
    out = []
    for t in tasks:
        tid = run_task_id(t.task_id, run_id, it, held_out)
        if len(tid) > TASK_ID_MAX:
            raise LoopError(f"{t.task_id}: task ids of at most {TASK_ID_MAX - len(tid) + len(t.task_id)} "
                            "characters, please")
        try:
            client.submit(replace(t, task_id=tid))   # there already: a rerun resumes its sessions
        except ServerError as e:   # a task changed on resume, a workspace the server lacks
            raise LoopError(str(e)) from None
        out.append(Submitted(tid, t))
    return out


def _wait_rollouts(nodes: Nodes, submitted: list[Submitted], label: str) -> dict[str, Group]:
    """Until every task is done or cancelled; their scored groups."""
    ids, total = [t.task_id for t in submitted], sum(t.spec.num_samples for t in submitted)
    with click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True) as bar:
        settled = 0
        while True:
            groups = {g["task_id"]: g for g in nodes.client.groups(ids)}
            now = sum(1 for g in groups.values() for s in g["sessions"] if s["state"] in TERMINAL)
            bar.update(now - settled)
            settled = now
            if all(g["state"] in TASK_SETTLED for g in groups.values()):
                return groups
            nodes.check()
            time.sleep(0.5)


# 2. trainable calls ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainableCalls:
    groups: dict[str, Group]   # the training tasks' groups with enough usable samples
    data: TrainingData         # their calls as read, with what was skipped
    # their tokens at most --max-staleness versions behind the policy, per token: older ones
    # (and those of an unknown version) are context only, a call with none left is left out
    staleness: Fresh

    @property
    def fresh(self) -> list[Call]:
        return self.staleness.calls

    @property
    def stale(self) -> int:
        """The calls left out: not one token recent enough (or of a known version)."""
        return self.staleness.stale_calls


def trainable_calls(loop: Loop, it: int, done: Rollouts) -> TrainableCalls:
    """The rewards stored with the calls, and the calls read back for training."""
    trained = {t.task_id: done.groups[t.task_id] for t in done.train}
    for t in done.train:   # a group with too few usable samples is reported and left out
        if why := incomplete(done.groups[t.task_id], t.spec.min_complete_fraction):
            loop.echo(f"iteration {it + 1}: {task_of_run(t.task_id)} left out of training: {why}")
            del trained[t.task_id]
    loop.nodes.calls_in()
    dbs = _store_rewards(loop.local_db, loop.nodes.client, done.train, done.groups)
    data = training_calls(dbs, sessions=[s["session_id"] for g in trained.values() for s in g["sessions"]],
                          temperature=loop.cfg.temperature,
                          reward_covers={t.task_id: t.spec.reward_covers for t in done.train})
    every = [s for g in done.groups.values() for s in g["sessions"]]   # held-out ones too
    if not _model_calls(every, data):
        raise LoopError(no_calls_error(it, every, {t.spec.harness for t in [*done.train, *done.held_out]}))
    fresh = at_most_stale(data.calls, loop.state.version, loop.opts.max_staleness)
    return TrainableCalls(trained, data, fresh)


def _store_rewards(db: str | None, client: ServerClient, submitted: list[Submitted],
                   groups: dict[str, Group]) -> list[str]:
    """The server's groups are the record: each final session's reward goes into the database
    of the node that ran it (db: the one database on one machine). Its node stores it too,
    once settled, but may have been killed in between (rewards.store_settled). Returns the
    databases that hold this iteration's calls."""
    nodes = client.policy_status()["nodes"] if db is None else {}
    node_dbs = {node_id: n["db"] for node_id, n in nodes.items() if n["db"]}
    try:
        written = store_settled({t.task_id: groups[t.task_id] for t in submitted},
                                {t.task_id: t.spec for t in submitted}, db, node_dbs)
    except UnreachableDatabases as e:
        raise LoopError(f"node databases not reachable from here: {', '.join(e.paths)} (--server needs "
                        "the nodes' databases and the checkpoints on a filesystem both sides see)") from None
    return written or ([db] if db else [])


# 3. train ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Trained:
    result: TrainResult | None   # None: nothing trained (the reason was said)
    saved: Saved | None          # None: no optimizer step, so no new version
    sleep_s: float | None        # --colocate: putting vLLM to sleep first
    seconds: float

    @property
    def history(self) -> list[StepMetrics]:
        return self.result.history if self.result is not None and self.saved is not None else []


def train(loop: Loop, it: int, calls: TrainableCalls) -> Trained:
    """GRPO on the fresh calls; the new weights saved as the next version."""
    from ..grpo.train import TrainError

    sleep_s = None
    if loop.opts.colocate:   # vLLM gives its memory to the trainer until the sync wakes it
        t = time.monotonic()
        loop.nodes.sync(loop.state.version, loop.serving, asleep=True)
        sleep_s = time.monotonic() - t
    t0 = time.monotonic()
    result = None
    if reason := no_signal_reason(calls.groups):
        loop.echo(f"iteration {it + 1}: nothing trained, no learning signal: {reason}")
    else:
        try:
            result = _train(loop, it, calls)
        except TrainError as e:
            loop.echo(f"iteration {it + 1}: nothing trained: {_train_error(e, calls.data, calls.stale)}")
    saved = None
    if result is not None and result.history:
        # from memory, the folder is written while the sync runs (publish_and_sync)
        saved = _planned(loop) if loop.weights is not None else _save(loop)
    return Trained(result, saved, sleep_s, time.monotonic() - t0)


def _train(loop: Loop, it: int, calls: TrainableCalls) -> TrainResult:
    bar = None

    def progress(n: int, total: int, m: StepMetrics) -> None:
        nonlocal bar
        if bar is None:
            bar = click.progressbar(length=total, label=f"iteration {it + 1}/{loop.opts.iterations} training",
                                    file=sys.stderr, item_show_func=lambda s: s)
            bar.__enter__()
        bar.update(1, f"loss {m.loss:+.4f} clip {m.clip_frac:.3f}")

    try:
        return loop.trainer.train_on(calls.fresh, loop.out / "iterations" / f"{it:04d}", progress,
                                     session_rewards=calls.data.rewards)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)


def _planned(loop: Loop) -> Saved:
    """Where the next version's checkpoint and trainer state go."""
    return Saved(loop.out / "checkpoints" / f"v{loop.state.version + 1}",
                 loop.out / "trainer" / f"v{loop.state.version + 1}.pt")


def _save(loop: Loop, saved: Saved | None = None) -> Saved:
    saved = saved or _planned(loop)
    loop.trainer.save(saved.checkpoint)
    saved.trainer_state.parent.mkdir(exist_ok=True)
    loop.trainer.save_state(saved.trainer_state)
    return saved


# 4. publish and sync ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Synced:
    figures: SyncFigures
    seconds: float


def publish_and_sync(loop: Loop, trained: Trained) -> Synced:
    """The new version served by every node, recorded, and loop.json's to be; without one, a
    colocated vLLM wakes with the weights it had."""
    t0 = time.monotonic()
    version = loop.state.version
    figures = SyncFigures()
    if trained.saved is not None:
        figures = _synced_from_memory(loop, trained.saved) if loop.weights is not None else \
            loop.nodes.sync(version + 1, str(trained.saved.checkpoint))
        record_version(loop.db, loop.state.run_id, version + 1, str(trained.saved.checkpoint))
        loop.state.publish(trained.saved)
        loop.echo(f"synced policy v{version + 1} ({figures.mode or 'drain'}): drained {figures.drained or 0} "
                  f"calls, held {figures.held or 0}, reload {figures.reload_s or 0:.2f}s, vLLM stalled "
                  f"{figures.stall_s or 0:.2f}s")
    elif loop.opts.colocate:
        figures = loop.nodes.sync(version, loop.serving)
    return Synced(figures, time.monotonic() - t0)


def _synced_from_memory(loop: Loop, saved: Saved) -> SyncFigures:
    """--weights-from memory: the trainer serves the new weights and every node's vLLM pulls
    them; the checkpoint folder (for resume, and what a gateway reloads into a restarted vLLM)
    is written meanwhile, and waited for before the version is recorded."""
    assert loop.weights is not None
    t0 = time.monotonic()
    published = loop.trainer.publish(loop.weights)
    loop.echo(f"published v{loop.state.version + 1} from memory: {published.bytes / 1e6:.0f} MB in "
              f"{time.monotonic() - t0:.2f}s")
    failed: list[BaseException] = []

    def write() -> None:
        try:
            _save(loop, saved)
        except BaseException as e:   # noqa: BLE001  (raised below, in the loop's thread)
            failed.append(e)

    writer = threading.Thread(target=write, name="checkpoint-writer")
    writer.start()
    try:
        return loop.nodes.sync(loop.state.version + 1, str(saved.checkpoint),
                               pull=WeightPull(url=published.url, sha256=published.sha256))
    finally:
        writer.join()
        if failed:
            raise failed[0]


# 5. record --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JournalFigures:
    """The rollout server's journal saves in the iteration (this process's server only)."""
    saves: int | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None

    @classmethod
    def read(cls, stack: "Stack | RayStack") -> "JournalFigures":
        if stack.server is None:   # a remote server keeps its own
            return cls()
        saves = stack.server.journal_stats(reset=True)
        return cls(saves["saves"], saves["p50_ms"], saves["p99_ms"])


def iteration_row(run_id: str, it: int, version: int, done: Rollouts, calls: TrainableCalls, trained: Trained,
                  synced: Synced, journal: JournalFigures) -> IterationRow:
    f, sync, steps = done.figures, synced.figures, trained.history
    return {"run_id": run_id, "iteration": it, "policy_version": version,
            "checkpoint": str(trained.saved.checkpoint) if trained.saved else None,
            "reward_mean": f.reward_mean, "reward_std": f.reward_std, "reward_n": f.reward_n,
            "eval_reward_mean": f.eval_reward_mean, "eval_reward_std": f.eval_reward_std,
            "eval_reward_n": f.eval_reward_n, "sessions_done": f.sessions["done"],
            "sessions_failed": f.sessions["failed"], "sessions_timed_out": f.sessions["timed_out"],
            "sessions_released": sum(f.released.values()), "released_why": dict(f.released),
            "per_task": f.per_task, "calls": len(calls.fresh), "tokens": calls.staleness.trained_tokens,
            "stale_dropped": calls.stale, "stale_tokens": calls.staleness.stale_tokens,
            "unknown_version_tokens": calls.staleness.unknown_tokens,
            "loss": steps[-1].loss if steps else None,
            "clip_frac": steps[-1].clip_frac if steps else None,
            "logprob_abs_diff": steps[0].logprob_abs_diff if steps else None,
            "rollout_s": done.seconds, "train_s": trained.seconds, "sync_s": synced.seconds,
            "sleep_s": trained.sleep_s, "sync_drain_s": sync.drain_s, "sync_reload_s": sync.reload_s,
            "sync_reset_s": sync.reset_s, "sync_wake_s": sync.wake_s, "sync_mode": sync.mode,
            "sync_stall_s": sync.stall_s, "journal_saves": journal.saves,
            "journal_save_p50_ms": journal.p50_ms, "journal_save_p99_ms": journal.p99_ms}


def record(loop: Loop, row: IterationRow, trained: Trained) -> None:
    """The row and its optimizer steps stored and logged; then loop.json says it is done."""
    steps = [m.as_dict() for m in trained.history]
    record_iteration(loop.db, row, steps)
    loop.trackers.log_steps(steps, iteration=row["iteration"])
    loop.trackers.log_iteration(row, global_step=loop.trainer.step)
    loop.state.completed = row["iteration"] + 1
    prune(loop.state, loop.opts.keep, loop.out)   # saves the state: loop.json lists what is on disk


# why an iteration cannot go on, in the loop's words ---------------------------------------------

def _model_calls(sessions: list[SessionResult], data: TrainingData) -> int:
    """Model calls the sessions made: their stats' count (the node's, from the database),
    or else the calls the training data read (kept or skipped)."""
    counted = sum(n for s in sessions if isinstance(n := (s.get("stats") or {}).get("calls"), int))
    return max(counted, len(data.calls) + sum(data.skipped.values()))


def one_line(e: BaseException | str) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _tail(text: str, lines: int = 12, chars: int = 1500) -> str:
    kept = [ln.rstrip() for ln in text.strip().splitlines()][-lines:]
    out = "\n".join(kept)[-chars:]
    return "\n".join(f"  | {ln}" for ln in out.splitlines())


def no_calls_error(it: int, sessions: list[SessionResult], harnesses: set[str]) -> str:
    """An iteration in which no session called the model: the likely cause, and the output of
    one session (a failed one first): its harness's, else its evaluator's, else its reason."""
    hint = ("the harness could not reach the gateway's proxy (or the model), or it failed before its "
            "first call")
    if "command" in harnesses:
        hint += ("; for the command harness, check that its HTTP client uses $HTTPS_PROXY (and trusts the "
                 "CA in $SSL_CERT_FILE)")
    msg = (f"iteration {it + 1}: no session made a model call ({len(sessions)} sessions, 0 calls), so the "
           f"loop cannot learn: {hint}")
    shown = sorted(sessions, key=lambda s: (s["state"] != Session.FAILED, s["session_id"]))
    if shown:
        s = shown[0]
        stats = s.get("stats") or {}
        for key, what in (("harness_output", "its harness's output"), ("eval_output", "its evaluator's output")):
            text = stats.get(key)
            if isinstance(text, str) and text.strip():
                break
        else:
            text, what = s.get("reason") or "", "its reason"
        detail = f" ({one_line(s['reason'] or '')})" if s.get("reason") and what != "its reason" else ""
        msg += f"\n{s['session_id']} {s['state']}{detail}; " + (
            f"{what}, last lines:\n{_tail(text)}" if text.strip() else "no output")
    return msg


def no_signal_reason(groups: dict[str, Group]) -> str | None:
    """Why these groups hold nothing to learn from (None: they do): every session failed, no
    session has a reward, or every group's rewards are equal (GRPO's advantage is zero)."""
    finals = [s for g in groups.values() for s in g["sessions"]]
    if not finals:
        return "no session ran"
    if all(s["state"] != Session.DONE for s in finals):
        counts = Counter(str(s["state"]) for s in finals)
        failed = next((s for s in finals if s.get("reason")), None)
        example = f"; {failed['session_id']}: {one_line(failed['reason'] or '')[:200]}" if failed else ""
        return (f"every session failed ({', '.join(f'{n} {k}' for k, n in counts.most_common())}){example}")
    rewards = {tid: [float(s["reward"]) for s in g["sessions"] if s["reward"] is not None]
               for tid, g in groups.items()}
    if not any(rewards.values()):
        return "no session has a reward (do the tasks have an evaluator?)"
    if all(len(rs) < 2 for rs in rewards.values()):
        return "no group has two rewarded sessions to compare (give the tasks num_samples 2 or more, or --samples)"
    if all(no_signal(group_stats(rs)) for rs in rewards.values() if rs):
        seen = sorted({r for rs in rewards.values() for r in rs})
        values = ", ".join(f"{r:g}" for r in seen[:5]) + (" ..." if len(seen) > 5 else "")
        return (f"every group's rewards are equal (rewards {values} in {len(groups)} groups): GRPO's advantage "
                "is zero; tasks that the policy sometimes solves (or more samples) give it a signal")
    return None


def _train_error(e: Exception, data: TrainingData, stale: int) -> str:
    """The trainer's reason, in the loop's words (its own advice is for `polar-train train`)."""
    if "polar-train reward" not in str(e):
        return str(e)
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(data.skipped.items())) or "none"
    return (f"none of the {len(data.calls)} calls read could be trained ({stale} with no token as recent as "
            f"--max-staleness allows; calls skipped: {skipped})")


def _rewards(groups: Iterable[Group]) -> list[float]:
    return [s["reward"] for g in groups for s in g["sessions"] if s["reward"] is not None]


def _mean(xs: list[float]) -> float | None:
    return group_stats(xs).mean if xs else None


def _std(xs: list[float]) -> float | None:
    return group_stats(xs).std if xs else None
