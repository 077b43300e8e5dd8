"""polar-train loop: the closed loop, the main job.

One iteration, top to bottom:
  1. rollouts: every task (and --eval-tasks, never trained on) through the rollout server
     and a gateway node, sampled by the current policy version v; each iteration submits
     its own task ids (TASK@RUN.i), so its sessions form its own GRPO groups;
  2. GRPO on this iteration's scored groups, with one long-lived Trainer (its weights,
     AdamW state, KL reference and learning-rate schedule live across iterations);
  3. the checkpoint, saved as version v + 1 (the last --keep are kept);
  4. the sync through the gateway (addons/weight_sync.py): new calls held, calls in flight
     drained, vLLM reloads in place, version v + 1 recorded on every later call.
The stack (vLLM, proxy, rollout server, node) starts once and runs across iterations.
State in OUT/loop.json, written after each iteration's sync: rerunning the same command
continues after the last completed iteration; a kill -9 loses at most the one in progress
(its finished rollouts are kept, in the database, and trained on by the rerun).
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import secrets
import shutil
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import click

from ..stack import launch
from ..models import model_dir_problem
from ..grpo.advantages import group_stats, no_signal
from .options import LoopOptions
from ..rollout.client import ServerClient, ServerError
from ..rollout.judging import judge_groups
from ..rollout.rewards import incomplete, release_causes, reward_records
from ..rollout.protocol import Group, RewardRecord, SessionResult
from ..rollout.spec import TaskRequest, spec_changes, task_from_json
from ..rollout.states import TASK_SETTLED, TERMINAL, Session
from ..session_ids import TASK_ID_MAX, parse_run_task, run_task_id, task_of_run
from ..store import init_db, rollout_journal
from ..store.loop import iterations as stored_iterations
from ..store.loop import steps as stored_steps
from ..store.loop import IterationRow, TaskRewards, record_iteration, record_version, standard_error
from ..store.training import set_rewards, training_calls
from .trackers import Trackers, open_trackers


@dataclass
class LoopState:
    run_id: str
    completed: int = 0                    # iterations done (trained and synced)
    version: int = 0                      # the policy version vLLM serves
    checkpoint: str | None = None         # its weights (None: the initial model)
    trainer_state: str | None = None      # AdamW and the schedule's clock after `completed`
    checkpoints: list[str] = field(default_factory=list)

    @staticmethod
    def path(out: Path) -> Path:
        return out / "loop.json"

    @classmethod
    def load(cls, out: Path) -> "LoopState | None":
        try:
            return cls(**json.loads(cls.path(out).read_text()))
        except FileNotFoundError:
            return None

    def save(self, out: Path) -> None:
        tmp = self.path(out).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, self.path(out))


class LoopError(click.ClickException):
    pass


def run_loop(opts: LoopOptions, train_cfg, echo: Callable[[str], None] = click.echo) -> list[dict]:
    """The loop (module docstring); a disk that fills up is a LoopError (rerun to resume)."""
    try:
        return _run_loop(opts, train_cfg, echo)
    except Exception as e:
        if not isinstance(e, click.ClickException) and _disk_full(e, opts.out):
            where = getattr(e, "filename", None) or opts.out
            raise LoopError(f"no space left on the device of {where} ({_one_line(e)}): free some space and "
                            "rerun the same command to resume") from None
        raise


def _run_loop(opts: LoopOptions, train_cfg, echo: Callable[[str], None]) -> list[dict]:
    from ..grpo.train import Trainer, TrainError
    from ..models import DEFAULT_MODEL_NAME, ensure_default_model
    from ..stack.local import Stack, check_workspaces, ensure_harnesses, read_tasks

    if opts.server and opts.backend:
        raise LoopError("--server or --backend, not both: the rollout server's nodes have their own backends")
    if opts.colocate and opts.max_staleness:
        raise LoopError("--colocate needs --max-staleness 0: vLLM sleeps while the trainer runs, so "
                        "nothing can be sampled then")
    if opts.model and (problem := model_dir_problem(opts.model)):   # before anything syncs to it
        raise LoopError(f"--model: {problem}")
    out = opts.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    lock = os.open(out / ".loop.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise LoopError(f"another loop is running on {out}") from None
    stack = Stack()
    client = None
    trackers = Trackers()
    try:
        # The loop's own tables; on one machine the same file holds the calls and rewards.
        db = str(out / ("loop.duckdb" if opts.server else "rollouts.duckdb"))
        state = LoopState.load(out)
        if state is not None and state.completed >= opts.iterations:
            # nothing to run: nothing starts, and a shared --backend keeps what it serves
            echo(f"{out}: {state.completed} iterations done already (--iterations {opts.iterations}); "
                 "nothing to run")
            rows = stored_iterations(db, state.run_id) if Path(db).exists() else []
            echo(iteration_table(rows))
            return rows
        # everything that can be checked is, before anything starts ---------------------------------
        tasks = read_tasks(opts.tasks_file, opts.harness, opts.samples)
        eval_tasks = read_tasks(opts.eval_tasks_file, opts.harness, opts.samples) if opts.eval_tasks_file else []
        if not opts.server:   # a remote server checks its own (its nodes may hold them)
            check_workspaces([*tasks, *eval_tasks])
        if state is not None:
            if state.checkpoint and (problem := model_dir_problem(state.checkpoint)):
                raise LoopError(f"{LoopState.path(out)} serves checkpoint {state.checkpoint}, but {problem}")
            if not opts.server:
                _check_unchanged(db, state.run_id, tasks, eval_tasks, opts.tasks_file, out)
        if not opts.server:
            ensure_harnesses(t.harness for t in [*tasks, *eval_tasks])
        if state is None:   # saved at once: a rerun after a kill resumes this run's task ids
            state = LoopState(run_id=secrets.token_hex(3))
            state.save(out)
        # one tracker run per loop run: a resume continues it
        trackers = open_trackers(opts.report_to, out, state.run_id, echo=echo,
                                 config={"loop": asdict(opts), "train": asdict(train_cfg)})
        base = str(Path(opts.model).resolve()) if opts.model else str(ensure_default_model(log=echo))
        init_db(db)
        if state.completed:   # what a tracker writing behind the loop lost to a kill, from the database
            trackers.catch_up([r for r in stored_iterations(db, state.run_id) if r["iteration"] < state.completed],
                              [(it, m) for it, m in stored_steps(db, state.run_id) if it < state.completed])
        work = out / "work"
        work.mkdir(mode=0o700, exist_ok=True)

        # the stack, once ------------------------------------------------------------------------
        serving = state.checkpoint or base
        if opts.server:
            server_url = opts.server
        else:
            if opts.backend:
                backend = opts.backend.rstrip("/")   # its dev mode is checked by the first sync below
            else:
                port = launch.free_port()
                echo(f"starting vLLM on 127.0.0.1:{port} serving {serving} (policy version {state.version}, "
                     f"{opts.dtype}); log {work / 'vllm.log'}")
                t0 = time.monotonic()
                stack.add(launch.start_vllm(
                    serving, port=port, served_name=DEFAULT_MODEL_NAME, log_path=work / "vllm.log",
                    max_model_len=opts.max_model_len, chat_template=launch.TEMPLATES / "smollm2_tools.jinja"
                    if not opts.model else None, dtype=opts.dtype,
                    extra_args=(["--enable-sleep-mode"] if opts.colocate else [])
                    # vLLM's logprobs are raw (before temperature) by default: the trainer's
                    # differ unless the temperature is 1
                    + (["--logprobs-mode", "processed_logprobs"] if train_cfg.temperature != 1.0 else [])))
                echo(f"vLLM ready after {time.monotonic() - t0:.0f}s")
                backend = f"http://127.0.0.1:{port}"
            # synchronous, the loop folds the journal between iterations (fold_soon); async,
            # sessions always run, and the server folds every 30 s
            server_url = stack.start_server(db, **({"fold_s": 3600.0} if opts.max_staleness == 0 else {})).url
            stack.start_node(
                db=db, backend=backend, work=work, proxy_port=launch.free_port(), workers=opts.workers,
                max_tokens=opts.max_tokens, server_url=server_url, temperature=train_cfg.temperature,
                extra_sets=[f"polar_policy_version={state.version}", f"polar_policy_checkpoint={serving}"])
        client = ServerClient(server_url)

        def check() -> None:
            if stack.dead():
                raise LoopError(f"a service stopped: {stack.why_dead()}")

        def sync(version: int, checkpoint: str, asleep: bool = False) -> dict:
            """Every node's gateway and vLLM to (version, checkpoint), or asleep; the slowest
            node's report (drain, wake, reload, reset)."""
            try:
                reports = client.sync_nodes(version, checkpoint, asleep, check=check)
            except ServerError as e:
                raise LoopError(f"the weight sync to version {version} failed: {e}") from None
            return _slowest([r.get("detail") for r in reports.values()])

        if opts.backend or opts.server:
            # vLLM may hold anything (a run killed mid-sync, another run's weights): every
            # node serves the version this run knows before any call is sampled.
            sync(state.version, serving)
        trainer = Trainer(serving, train_cfg, ref_model=base)
        if state.trainer_state:
            trainer.load_state(Path(state.trainer_state))

        # the iterations -------------------------------------------------------------------------
        folded: threading.Event | None = None   # the last iteration's fold, between its rollouts and the next
        for it in range(state.completed, opts.iterations):
            version = state.version
            if folded is not None:
                folded.wait(60.0)   # most often done already: it ran while the trainer trained
                folded = None
            t0 = time.monotonic()
            train = _submit(client, tasks, state.run_id, it)
            held_out = _submit(client, eval_tasks, state.run_id, it, held_out=True) if opts.evaluates(it) else []
            groups = _wait_rollouts(client, [*train, *held_out], check, f"iteration {it + 1}/{opts.iterations} "
                                    f"rollouts (policy v{version})")
            rollout_s = time.monotonic() - t0
            for line in judge_groups(groups, {t.task_id: t.spec for t in [*train, *held_out]},
                                     None if opts.server else db, None if opts.server else backend):
                echo(f"iteration {it + 1}: {line}")
            if stack.server is not None and not (opts.max_staleness >= 1 and it + 1 < opts.iterations):
                # no session runs until the next rollouts, which wait for it: the fold slows no save
                folded = stack.server.fold_soon()
            if opts.max_staleness >= 1 and it + 1 < opts.iterations:
                # The next iteration's rollouts run while this one trains and syncs: sampled by
                # version v until the sync, v + 1 after it (each call knows which).
                _submit(client, tasks, state.run_id, it + 1)
                if opts.evaluates(it + 1):
                    _submit(client, eval_tasks, state.run_id, it + 1, held_out=True)
            row_extra: IterationRow = {}
            if opts.colocate:   # vLLM gives its memory to the trainer until the sync wakes it
                t_sleep = time.monotonic()
                sync(version, serving, asleep=True)
                row_extra["sleep_s"] = time.monotonic() - t_sleep
            train_groups = {t.task_id: groups[t.task_id] for t in train}
            trained = dict(train_groups)   # a group with too few usable samples is reported and left out
            for t in train:
                why = incomplete(groups[t.task_id], t.spec.min_complete_fraction)
                if why:
                    echo(f"iteration {it + 1}: {task_of_run(t.task_id)} left out of training: {why}")
                    del trained[t.task_id]
            finals = [s for g in trained.values() for s in g["sessions"]]   # one per sample
            dbs = _store_rewards(db if not opts.server else None, client, train, groups)
            covers = {t.task_id: t.spec.reward_covers for t in train}
            data = training_calls(dbs, sessions=[s["session_id"] for s in finals], temperature=train_cfg.temperature,
                                  reward_covers=covers)
            calls = data.calls
            every = [s for g in groups.values() for s in g["sessions"]]   # held-out ones too
            if not _model_calls(every, data):
                raise LoopError(_no_calls_error(it, every, {t.spec.harness for t in [*train, *held_out]}))
            # trained: calls at most max_staleness versions behind the policy now trained
            fresh = [c for c in calls if c.policy_version >= version - opts.max_staleness]
            row = _rollout_row(state.run_id, it, version, train_groups, [groups[t.task_id] for t in held_out],
                               fresh, len(calls) - len(fresh))
            row.update({"rollout_s": rollout_s, **row_extra})

            t1 = time.monotonic()
            history: list[dict] = []
            no_signal = _no_signal_reason(trained)
            if no_signal:
                echo(f"iteration {it + 1}: nothing trained, no learning signal: {no_signal}")
            else:
                try:
                    summary = _train(trainer, fresh, data.rewards, out / "iterations" / f"{it:04d}", it,
                                     opts.iterations)
                    history = summary["history"]
                except TrainError as e:
                    echo(f"iteration {it + 1}: nothing trained: {_train_error(e, data, len(calls) - len(fresh))}")
            if history:
                ckpt = out / "checkpoints" / f"v{version + 1}"
                trainer.save(ckpt)
                tstate = out / "trainer" / f"v{version + 1}.pt"
                tstate.parent.mkdir(exist_ok=True)
                trainer.save_state(tstate)
                row.update({"checkpoint": str(ckpt), "loss": history[-1]["loss"], "clip_frac": history[-1]["clip_frac"],
                            "logprob_abs_diff": history[0]["logprob_abs_diff"]})
            row["train_s"] = time.monotonic() - t1

            t2 = time.monotonic()
            if history:
                report = sync(version + 1, str(ckpt))
                record_version(db, state.run_id, version + 1, str(ckpt))
                state.version, state.checkpoint, state.trainer_state = version + 1, str(ckpt), str(tstate)
                serving = str(ckpt)
                state.checkpoints.append(str(ckpt))
                echo(f"synced policy v{version + 1}: drained {report.get('drained', 0)} calls, held "
                     f"{report.get('held', 0)}, reload {report.get('reload_s', 0):.2f}s")
            elif opts.colocate:   # nothing new: wake it with the weights it had
                report = sync(version, serving)
            else:
                report = {}
            row.update({"sync_drain_s": report.get("drain_s"), "sync_reload_s": report.get("reload_s"),
                        "sync_reset_s": report.get("reset_s"), "sync_wake_s": report.get("wake_s")})
            row["sync_s"] = time.monotonic() - t2
            if stack.server is not None:   # this process's server (a remote one keeps its own)
                saves = stack.server.journal_stats(reset=True)
                row.update({"journal_saves": saves["saves"], "journal_save_p50_ms": saves["p50_ms"],
                            "journal_save_p99_ms": saves["p99_ms"]})
            record_iteration(db, row, history)
            trackers.log_steps(history, iteration=it)
            trackers.log_iteration(row, global_step=trainer.step)
            state.completed = it + 1
            _prune(state, opts.keep, out)   # saves the state: loop.json lists what is on disk
            echo(_iteration_line(row))

        rows = stored_iterations(db, state.run_id)
        echo(iteration_table(rows))
        if rows:
            rise = held_out_rise(rows)
            if rise is not None:
                echo(rise.line())
            plot_loop(rows, out / "loop.png")
            echo(f"database {db}; plot {out / 'loop.png'}")
        return rows
    finally:
        if client is not None:
            client.close()
        trackers.close()
        stack.stop()
        os.close(lock)


def _one_line(e: BaseException | str) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _disk_full(e: BaseException, near: Path) -> bool:
    """e is what a full disk (or quota) raises: OSError ENOSPC/EDQUOT, the message of a
    library that wraps it (DuckDB, safetensors), or a write that failed (torch.save) on a
    filesystem with (almost) no space left."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    if "No space left on device" in text or "Disk quota exceeded" in text:
        return True
    if "write" in text.lower() and "fail" in text.lower():
        where = Path(near).resolve()
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            return shutil.disk_usage(where).free < 64 << 20
        except OSError:
            return False
    return False


def _check_unchanged(db: str, run_id: str, tasks: list[TaskRequest], eval_tasks: list[TaskRequest],
                     tasks_file: str, out: Path) -> None:
    """A run's tasks are fixed: on resume, each task as this run submitted it before (its
    latest iteration's copy, TASK@RUN.I) is the task the files give now, or a LoopError names
    the tasks and what changed."""
    if not Path(db).exists():
        return
    rollout_journal.ensure(db)
    now = {(t.task_id, False): t for t in tasks} | {(t.task_id, True): t for t in eval_tasks}
    latest: dict[tuple[str, bool], tuple[int, dict]] = {}
    for row in rollout_journal.load(db)[0]:
        rt = parse_run_task(row["task_id"])
        if rt is None or rt.run_id != run_id:
            continue
        key = (rt.task, rt.held_out)
        if key in now and rt.iteration >= latest.get(key, (-1, {}))[0]:
            latest[key] = (rt.iteration, row["spec"])
    changed = []
    for (task, held_out), (_, spec) in sorted(latest.items()):
        current = now[(task, held_out)]
        changes = spec_changes(task_from_json(spec), replace(current, task_id=spec["task_id"]))
        if changes:
            changed.append(f"{task}{' (held out)' if held_out else ''}: {'; '.join(changes)}")
    if changed:
        raise LoopError(f"tasks changed since this run started: {' | '.join(changed)}; a run's tasks are "
                        f"fixed: put {tasks_file} back as it was, "
                        f"or start a new run with another --out than {out}")


def _model_calls(sessions: list[SessionResult], data) -> int:
    """Model calls the sessions made: their stats' count (the node's, from the database),
    or else the calls the training data read (kept or skipped)."""
    counted = sum(n for s in sessions if isinstance(n := (s.get("stats") or {}).get("calls"), int))
    return max(counted, len(data.calls) + sum(data.skipped.values()))


def _tail(text: str, lines: int = 12, chars: int = 1500) -> str:
    kept = [ln.rstrip() for ln in text.strip().splitlines()][-lines:]
    out = "\n".join(kept)[-chars:]
    return "\n".join(f"  | {ln}" for ln in out.splitlines())


def _no_calls_error(it: int, sessions: list[SessionResult], harnesses: set[str]) -> str:
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
        detail = f" ({_one_line(s['reason'] or '')})" if s.get("reason") and what != "its reason" else ""
        msg += f"\n{s['session_id']} {s['state']}{detail}; " + (
            f"{what}, last lines:\n{_tail(text)}" if text.strip() else "no output")
    return msg


def _no_signal_reason(groups: dict[str, Group]) -> str | None:
    """Why these groups hold nothing to learn from (None: they do): every session failed, no
    session has a reward, or every group's rewards are equal (GRPO's advantage is zero)."""
    finals = [s for g in groups.values() for s in g["sessions"]]
    if not finals:
        return "no session ran"
    if all(s["state"] != Session.DONE for s in finals):
        counts = Counter(str(s["state"]) for s in finals)
        failed = next((s for s in finals if s.get("reason")), None)
        example = f"; {failed['session_id']}: {_one_line(failed['reason'] or '')[:200]}" if failed else ""
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


def _train_error(e: Exception, data, stale: int) -> str:
    """The trainer's reason, in the loop's words (its own advice is for `polar-train train`)."""
    if "polar-train reward" not in str(e):
        return str(e)
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(data.skipped.items())) or "none"
    return (f"none of the {len(data.calls)} calls read could be trained ({stale} older than --max-staleness "
            f"allows; calls skipped: {skipped})")


def _slowest(details: list[dict | None]) -> dict:
    """One figure per sync step across nodes: the slowest node's (the loop waits for it)."""
    out: dict = {}
    for d in details:
        if not isinstance(d, dict):
            continue
        steps = d.get("steps") or {}
        for k, v in [("drain_s", d.get("drain_s")), ("drained", d.get("drained")), ("held", d.get("held")),
                     *steps.items()]:
            if isinstance(v, (int, float)):
                out[k] = max(out.get(k, v), v)
    return out


@dataclass(frozen=True)
class Submitted:
    """A task as this run submitted it for one iteration."""
    task_id: str              # TASK@RUN.I (held out: TASK@RUN.I.eval): its own GRPO group
    spec: TaskRequest         # the task as read (task_id TASK)


def _store_rewards(db: str | None, client: ServerClient, submitted: list[Submitted],
                   groups: dict[str, Group]) -> list[str]:
    """The server's groups are the record: each final session's reward goes into the database
    of the node that ran it (db: the one database on one machine). Its node stores it too,
    once settled, but may have been killed in between. A session that failed scores 0 under
    on_failure "zero". Returns the databases that hold this iteration's calls."""
    nodes = client.policy_status()["nodes"] if db is None else {}
    per_db: dict[str, list[RewardRecord]] = {}
    for t in submitted:
        g = groups[t.task_id]
        ran_on = {s["session_id"]: s.get("node_id") for s in g["sessions"]}
        for r in reward_records(g, t.spec.on_failure):
            node = nodes.get(ran_on[r["session_id"]] or "")
            target = db or (node["db"] if node else None)
            if target is not None:     # None: it never ran on a node, so it has no calls
                per_db.setdefault(target, []).append(r)
    missing = sorted(d for d in per_db if not Path(d).exists())
    if missing:
        raise LoopError(f"node databases not reachable from here: {', '.join(missing)} (--server needs "
                        "the nodes' databases and the checkpoints on a filesystem both sides see)")
    for d, records in per_db.items():
        if records:
            set_rewards(d, records, timeout=120.0)
    return sorted(per_db) or ([db] if db else [])


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


def _wait_rollouts(client: ServerClient, submitted: list[Submitted], check: Callable[[], None],
                   label: str) -> dict[str, Group]:
    """Until every task is done or cancelled; their scored groups."""
    ids, total = [t.task_id for t in submitted], sum(t.spec.num_samples for t in submitted)
    with click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True) as bar:
        settled = 0
        while True:
            groups = {g["task_id"]: g for g in client.groups(ids)}
            now = sum(1 for g in groups.values() for s in g["sessions"] if s["state"] in TERMINAL)
            bar.update(now - settled)
            settled = now
            if all(g["state"] in TASK_SETTLED for g in groups.values()):
                return groups
            check()
            time.sleep(0.5)


def _rollout_row(run_id: str, it: int, version: int, groups: dict[str, Group], eval_groups: list[Group],
                 calls, stale: int) -> IterationRow:
    rewards: list[float] = []
    per_task: dict[str, TaskRewards] = {}
    states: dict[str, int] = {}
    for tid, g in groups.items():
        rs = [s["reward"] for s in g["sessions"] if s["reward"] is not None]
        for s in g["sessions"]:
            states[s["state"]] = states.get(s["state"], 0) + 1
        task = task_of_run(tid)
        per_task[task] = {"mean": _mean(rs), "std": _std(rs), "n": len(rs)}
        rewards += rs
    eval_rewards = [s["reward"] for g in eval_groups for s in g["sessions"] if s["reward"] is not None]
    released = release_causes([*groups.values(), *eval_groups])   # run again, never scored: why
    return {"run_id": run_id, "iteration": it, "policy_version": version, "checkpoint": None,
            "sessions_released": sum(released.values()), "released_why": dict(released),
            "reward_mean": _mean(rewards), "reward_std": _std(rewards),
            "eval_reward_mean": _mean(eval_rewards) if eval_groups else None,   # None: not evaluated then
            "reward_n": len(rewards), "eval_reward_std": _std(eval_rewards) if eval_groups else None,
            "eval_reward_n": len(eval_rewards) if eval_groups else None,
            "sessions_done": states.get("done", 0), "sessions_failed": states.get("failed", 0),
            "sessions_timed_out": states.get("timed_out", 0), "calls": len(calls),
            "tokens": sum(len(c.tokens) for c in calls), "stale_dropped": stale, "per_task": per_task}


def _train(trainer, calls, rewards: dict, out: Path, it: int, iterations: int) -> dict:
    bar = None

    def progress(n, total, m):
        nonlocal bar
        if bar is None:
            bar = click.progressbar(length=total, label=f"iteration {it + 1}/{iterations} training",
                                    file=sys.stderr, item_show_func=lambda s: s)
            bar.__enter__()
        bar.update(1, f"loss {m['loss']:+.4f} clip {m['clip_frac']:.3f}")

    try:
        return trainer.train_on(calls, out, progress, session_rewards=rewards)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)


def _prune(state: LoopState, keep: int, out: Path) -> None:
    """Save the state with the last `keep` checkpoints (and the one served, always), then
    delete the others, and of the trainer states all but the one loop.json names: a resume
    reads no other, and each is AdamW's two moments, twice the fp32 weights (~1 GB for the
    default model). loop.json never lists a checkpoint that is gone, whenever a kill -9
    comes: one it no longer lists goes at the next prune (so does a save a kill cut short)."""
    while len(state.checkpoints) > max(keep, 1) and state.checkpoints[0] != state.checkpoint:
        state.checkpoints.pop(0)
    state.save(out)
    kept = {str(Path(p).resolve()) for p in [*state.checkpoints, state.checkpoint or ""] if p}
    folder = out / "checkpoints"
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if str(p.resolve()) not in kept:
            shutil.rmtree(p, ignore_errors=True)
    if state.trainer_state:
        current = Path(state.trainer_state)
        for p in current.parent.iterdir():   # older versions, and a save a kill cut short
            if p.name != current.name:
                p.unlink(missing_ok=True)
    # the trainer's per-iteration files (metrics.jsonl, metrics.png) of the last `keep`
    # iterations: every step's metrics are in loop_steps, and a run of days stays bounded
    steps = out / "iterations"
    for p in sorted(steps.iterdir()) if steps.is_dir() else []:
        if p.name.isdigit() and int(p.name) < state.completed - max(keep, 1):
            shutil.rmtree(p, ignore_errors=True)


def _mean(xs) -> float | None:
    return group_stats(xs).mean if xs else None


def _std(xs) -> float | None:
    return group_stats(xs).std if xs else None


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _iteration_line(r: IterationRow) -> str:
    return (f"iteration {r['iteration'] + 1} (policy v{r['policy_version']}): reward {_f(r['reward_mean'])} "
            f"+- {_f(r['reward_std'])}, held-out {_f(r['eval_reward_mean'])}; {r['calls']} calls, "
            f"loss {_f(r.get('loss'), '+.4f')}; rollouts {r['rollout_s']:.0f}s, training {r['train_s']:.0f}s, "
            f"sync {r['sync_s']:.1f}s" + _released_part(r))


def _released_part(r: IterationRow) -> str:
    """"; 3 sessions ran again (backend unavailable 2, policy version unknown 1)": the
    attempts whose outcome was not the policy's, so they were run again, unscored."""
    why = r.get("released_why") or {}
    if not r.get("sessions_released"):
        return ""
    return (f"; {r['sessions_released']} session(s) ran again ("
            + ", ".join(f"{k} {v}" for k, v in sorted(why.items())) + ")")


def iteration_table(rows: list[dict]) -> str:
    head = (f"{'iter':>4} {'ver':>3} {'reward':>7} {'std':>6} {'held-out':>8} {'done':>4} {'fail':>4} "
            f"{'t/o':>4} {'calls':>5} {'tokens':>7} {'loss':>8} {'clip':>6} {'|dlp|':>6} {'rollout s':>9} "
            f"{'train s':>7} {'sync s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['iteration'] + 1:>4} {r['policy_version']:>3} {_f(r['reward_mean']):>7} "
                     f"{_f(r['reward_std']):>6} {_f(r['eval_reward_mean']):>8} {r['sessions_done']:>4} "
                     f"{r['sessions_failed']:>4} {r['sessions_timed_out']:>4} {r['calls']:>5} {r['tokens']:>7} "
                     f"{_f(r['loss'], '+.4f'):>8} {_f(r['clip_frac']):>6} {_f(r['logprob_abs_diff']):>6} "
                     f"{r['rollout_s']:>9.0f} {r['train_s']:>7.0f} {r['sync_s']:>6.1f}")
    tasks = sorted({t for r in rows for t in json.loads(r["per_task"] or "{}")})
    if tasks:
        lines.append("reward per task: " + "; ".join(
            f"{t} " + " ".join(_f(json.loads(r["per_task"]).get(t, {}).get("mean"), ".2f") for r in rows)
            for t in tasks))
    return "\n".join(lines)


@dataclass(frozen=True)
class Rise:
    """The held-out reward from the first iteration to the last, with its standard error
    (the two means' errors combined, samples taken as independent: the same tasks at both
    ends, so the tasks' own spread, which cancels in the difference, only makes it larger)."""
    first: int
    last: int
    before: float
    after: float
    se: float

    @property
    def rise(self) -> float:
        return self.after - self.before

    @property
    def errors(self) -> float:
        return self.rise / self.se if self.se > 0 else math.inf if self.rise > 0 else 0.0

    def line(self) -> str:
        return (f"held-out reward {self.before:.3f} at iteration {self.first} -> {self.after:.3f} at iteration "
                f"{self.last}: {self.rise:+.3f} +- {self.se:.3f} (standard error), {self.errors:+.1f} standard errors")


def held_out_rise(rows: list[dict]) -> Rise | None:
    """None without held-out figures at two iterations (or from a database before they had n)."""
    held = [r for r in rows if r.get("eval_reward_mean") is not None]
    if len(held) < 2:
        return None
    a, b = held[0], held[-1]
    se_a, se_b = (standard_error(r.get("eval_reward_std"), r.get("eval_reward_n")) for r in (a, b))
    if se_a is None or se_b is None:
        return None
    return Rise(a["iteration"] + 1, b["iteration"] + 1, a["eval_reward_mean"], b["eval_reward_mean"],
                math.sqrt(se_a ** 2 + se_b ** 2))


def plot_loop(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] + 1 for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    # error bars: the mean's standard error (not the rewards' spread)
    a.errorbar(its, [r["reward_mean"] for r in rows],
               yerr=[standard_error(r["reward_std"], r.get("reward_n")) or 0 for r in rows],
               marker="o", capsize=3, label="training tasks")
    held = [r for r in rows if r["eval_reward_mean"] is not None]   # --eval-every: some iterations
    if held:
        a.errorbar([r["iteration"] + 1 for r in held], [r["eval_reward_mean"] for r in held],
                   yerr=[standard_error(r.get("eval_reward_std"), r.get("eval_reward_n")) or 0 for r in held],
                   marker="s", capsize=3, label="held-out tasks")
    a.set(xlabel="iteration", ylabel="mean reward (+- standard error)", title="reward")
    a.legend()
    b.plot(its, [r["loss"] for r in rows], marker="o")
    b.set(xlabel="iteration", ylabel="loss", title="GRPO loss (last step)")
    for ax in (a, b):
        ax.set_xticks(its)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
