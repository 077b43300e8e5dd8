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

import fcntl
import json
import os
import secrets
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import click

from . import launch
from .grpo.advantages import group_stats
from .loop_options import LoopOptions
from .rollout.client import ServerClient, ServerError
from .rollout.rewards import reward_records
from .rollout.protocol import Group, RewardRecord
from .rollout.spec import TaskRequest
from .rollout.states import TASK_SETTLED, TERMINAL
from .session_ids import TASK_ID_MAX, run_task_id, task_of_run
from .store import init_db
from .store.loop import iterations as stored_iterations
from .store.loop import IterationRow, TaskRewards, record_iteration, record_version
from .store.training import set_rewards, training_calls


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
    from .grpo.train import Trainer, TrainError
    from .models import DEFAULT_MODEL_NAME, ensure_default_model
    from .stack import Stack, ensure_harnesses, read_tasks

    if opts.server and opts.backend:
        raise LoopError("--server or --backend, not both: the rollout server's nodes have their own backends")
    if opts.colocate and opts.max_staleness:
        raise LoopError("--colocate needs --max-staleness 0: vLLM sleeps while the trainer runs, so "
                        "nothing can be sampled then")
    out = opts.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    lock = os.open(out / ".loop.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LoopError(f"another loop is running on {out}") from None
    tasks = read_tasks(opts.tasks_file, opts.harness, opts.samples)
    eval_tasks = read_tasks(opts.eval_tasks_file, opts.harness, opts.samples) if opts.eval_tasks_file else []
    if not opts.server:
        ensure_harnesses(t.harness for t in [*tasks, *eval_tasks])
    state = LoopState.load(out)
    if state is None:   # saved at once: a rerun after a kill resumes this run's task ids
        state = LoopState(run_id=secrets.token_hex(3))
        state.save(out)
    if state.completed >= opts.iterations:
        echo(f"{out}: {state.completed} iterations already done")
    base = str(Path(opts.model).resolve()) if opts.model else str(ensure_default_model(log=echo))
    # The loop's own tables; on one machine the same file holds the calls and rewards.
    db = str(out / ("loop.duckdb" if opts.server else "rollouts.duckdb"))
    init_db(db)
    work = out / "work"
    work.mkdir(mode=0o700, exist_ok=True)
    stack = Stack()
    client = None
    try:
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
            server_url = stack.start_server(db).url
            stack.start_node(
                db=db, backend=backend, work=work, proxy_port=launch.free_port(), workers=opts.workers,
                max_tokens=opts.max_tokens, server_url=server_url, temperature=train_cfg.temperature,
                extra_sets=[f"polar_policy_version={state.version}"])
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
        for it in range(state.completed, opts.iterations):
            version = state.version
            t0 = time.monotonic()
            train = _submit(client, tasks, state.run_id, it)
            held_out = _submit(client, eval_tasks, state.run_id, it, held_out=True)
            groups = _wait_rollouts(client, [*train, *held_out], check, f"iteration {it + 1}/{opts.iterations} "
                                    f"rollouts (policy v{version})")
            rollout_s = time.monotonic() - t0
            if opts.max_staleness >= 1 and it + 1 < opts.iterations:
                # The next iteration's rollouts run while this one trains and syncs: sampled by
                # version v until the sync, v + 1 after it (each call knows which).
                _submit(client, tasks, state.run_id, it + 1)
                _submit(client, eval_tasks, state.run_id, it + 1, held_out=True)
            row_extra: IterationRow = {}
            if opts.colocate:   # vLLM gives its memory to the trainer until the sync wakes it
                t_sleep = time.monotonic()
                sync(version, serving, asleep=True)
                row_extra["sleep_s"] = time.monotonic() - t_sleep
            train_groups = {t.task_id: groups[t.task_id] for t in train}
            finals = [s for g in train_groups.values() for s in g["sessions"]]   # one per sample
            dbs = _store_rewards(db if not opts.server else None, client, train, groups)
            covers = {t.task_id: t.spec.reward_covers for t in train}
            data = training_calls(dbs, sessions=[s["session_id"] for s in finals], temperature=train_cfg.temperature,
                                  reward_covers=covers)
            calls = data.calls
            # trained: calls at most max_staleness versions behind the policy now trained
            fresh = [c for c in calls if c.policy_version >= version - opts.max_staleness]
            row = _rollout_row(state.run_id, it, version, train_groups, [groups[t.task_id] for t in held_out],
                               fresh, len(calls) - len(fresh))
            row.update({"rollout_s": rollout_s, **row_extra})

            t1 = time.monotonic()
            history: list[dict] = []
            try:
                summary = _train(trainer, fresh, data.rewards, out / "iterations" / f"{it:04d}", it, opts.iterations)
                history = summary["history"]
            except TrainError as e:
                echo(f"iteration {it + 1}: nothing trained ({e})")
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
            record_iteration(db, row, history)
            state.completed = it + 1
            state.save(out)
            _prune(state, opts.keep)
            echo(_iteration_line(row))

        rows = stored_iterations(db, state.run_id)
        echo(iteration_table(rows))
        if rows:
            plot_loop(rows, out / "loop.png")
            echo(f"database {db}; plot {out / 'loop.png'}")
        return rows
    finally:
        if client is not None:
            client.close()
        stack.stop()
        os.close(lock)


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
        client.submit(replace(t, task_id=tid))   # there already: a rerun resumes its sessions
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
            time.sleep(1.0)


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
    return {"run_id": run_id, "iteration": it, "policy_version": version, "checkpoint": None,
            "reward_mean": _mean(rewards), "reward_std": _std(rewards),
            "eval_reward_mean": _mean(eval_rewards) if eval_groups else None,
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


def _prune(state: LoopState, keep: int) -> None:
    """Keep the last `keep` checkpoints (and the one served, always), and of the trainer
    states only the one loop.json names: a resume reads no other, and each is AdamW's two
    moments, twice the fp32 weights (~1 GB for the default model). Runs after state.save."""
    while len(state.checkpoints) > max(keep, 1):
        old = state.checkpoints.pop(0)
        if old != state.checkpoint:
            shutil.rmtree(old, ignore_errors=True)
    if state.trainer_state:
        current = Path(state.trainer_state)
        for p in current.parent.iterdir():   # older versions, and a save a kill cut short
            if p.name != current.name:
                p.unlink(missing_ok=True)


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
            f"sync {r['sync_s']:.1f}s")


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


def plot_loop(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] + 1 for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.errorbar(its, [r["reward_mean"] for r in rows], yerr=[r["reward_std"] or 0 for r in rows],
               marker="o", capsize=3, label="training tasks")
    if any(r["eval_reward_mean"] is not None for r in rows):
        a.plot(its, [r["eval_reward_mean"] for r in rows], marker="s", label="held-out tasks")
    a.set(xlabel="iteration", ylabel="mean reward", title="reward")
    a.legend()
    b.plot(its, [r["loss"] for r in rows], marker="o")
    b.set(xlabel="iteration", ylabel="loss", title="GRPO loss (last step)")
    for ax in (a, b):
        ax.set_xticks(its)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
