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
Each step is a function of steps.py with a typed result; the iteration's row is built once
from them. The stack (vLLM, proxy, rollout server, node: Stack.start_rollouts) starts once
and runs across iterations; a finished run starts nothing.
State in OUT/loop.json, written after each iteration's sync: rerunning the same command
continues after the last completed iteration; a kill -9 loses at most the one in progress
(its finished rollouts are kept, in the database, and trained on by the rerun).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from contextlib import ExitStack, closing, contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, cast

import click

from ..grpo.config import TrainConfig
from ..models import model_dir_problem
from ..rollout.client import ServerClient
from ..rollout.spec import TaskRequest, spec_changes, task_from_json
from ..session_ids import parse_run_task
from ..stack.local import Stack, check_workspaces, ensure_harnesses, read_tasks
from ..stack.vllm import VLLMSettings
from ..store import init_db, rollout_journal
from ..store.loop import IterationRow
from ..store.loop import iterations as stored_iterations
from ..store.loop import steps as stored_steps
from . import steps
from .figures import Rise, held_out_rise, iteration_line, iteration_table, plot_loop, standard_error
from .options import LoopOptions
from .state import LoopError, LoopState
from .steps import JournalFigures, Loop, Nodes, Tasks, one_line
from .trackers import Trackers, open_trackers

if TYPE_CHECKING:
    from ..grpo.train import Trainer

__all__ = ["LoopError", "LoopOptions", "LoopState", "Rise", "held_out_rise", "iteration_table", "plot_loop",
           "run_loop", "standard_error"]


def run_loop(opts: LoopOptions, train_cfg: TrainConfig, echo: Callable[[str], None] = click.echo) -> list[dict]:
    """The loop (module docstring). A finished run returns before anything starts (no vLLM,
    no model, no torch); a disk that fills up is a LoopError (rerun to resume)."""
    _check_options(opts)
    out = opts.out.resolve()
    db = str(out / ("loop.duckdb" if opts.server else "rollouts.duckdb"))   # one machine: the calls' too
    with _disk_full_is_a_loop_error(opts.out), ExitStack() as running:
        running.enter_context(_only_loop_on(out))
        state = LoopState.load(out)
        if state is not None and state.completed >= opts.iterations:
            return _nothing_to_run(state, opts, db, echo)
        tasks = _checked_tasks(opts, state, db, out)   # everything that can be checked, before anything starts
        state = state or LoopState.new(out)
        trackers = running.enter_context(closing(_trackers(opts, train_cfg, out, state, echo)))
        base = _initial_policy(opts, echo)
        _open_database(db, state, trackers)
        if opts.ray:
            loop = _on_ray(opts, train_cfg, running, out, db, state, tasks, base, trackers, echo)
            for it in range(state.completed, opts.iterations):
                echo(iteration_line(_iteration(loop, it)))
            return _summary(db, state.run_id, out, echo)
        stack = running.enter_context(Stack())
        where = stack.start_rollouts(   # the stack, once, across iterations
            server=opts.server, backend=opts.backend and opts.backend.rstrip("/"), db=db, work=_work(out),
            weights=state.checkpoint or base, version=state.version, vllm=_vllm_settings(opts, train_cfg),
            workers=opts.workers, max_tokens=opts.max_tokens, temperature=train_cfg.temperature,
            # synchronous, the loop folds the journal between iterations; async, the server every 30 s
            fold_s=3600.0 if opts.max_staleness == 0 else None, echo=echo, limits=opts.session_limits,
            sync_mode=opts.sync_mode)
        nodes = Nodes(running.enter_context(closing(ServerClient(where.server, token=where.token))), stack)
        if opts.backend or opts.server:
            # vLLM may hold anything (a run killed mid-sync, another run's weights): every
            # node serves the version this run knows before any call is sampled.
            nodes.sync(state.version, state.checkpoint or base)
        loop = Loop(opts, train_cfg, out, db, state, tasks, nodes, where.backend, base,
                    _trainer(state, base, train_cfg), trackers, echo)
        if opts.weights_from == "memory":   # each version served from the trainer's memory
            from ..grpo.weight_server import WeightServer
            loop.weights = running.enter_context(WeightServer())
        for it in range(state.completed, opts.iterations):
            echo(iteration_line(_iteration(loop, it)))
        return _summary(db, state.run_id, out, echo)


def _on_ray(opts: LoopOptions, train_cfg: TrainConfig, running: ExitStack, out: Path, db: str, state: LoopState,
           tasks: Tasks, base: str, trackers: Trackers, echo: Callable[[str], None]) -> Loop:
    """The loop's stack on a Ray cluster (cluster/ray_stack.py): the trainer here, first (a
    resumed run's replicas load its weights from its memory: no machine reads another's
    disk); then the rollout server, the replicas and a gateway node per Ray node."""
    from ..cluster.ray_env import connect, node_address
    from ..cluster.ray_stack import ClusterOptions, RayStack, RolloutSetup
    from ..grpo.weight_server import WeightServer
    from ..rollout.protocol import WeightPull

    assert opts.ray
    connect(opts.ray)
    if opts.trainer_gpus or opts.trainer_actor:   # where its GPUs are; it serves its own weights
        from ..cluster.trainer_host import RemoteTrainer
        trainer = cast("Trainer", running.enter_context(RemoteTrainer.start(   # duck-typed: what the loop uses
            state.checkpoint or base, train_cfg, ref_model=base, trainer_state=state.trainer_state,
            gpus=opts.trainer_gpus, echo=echo)))
    else:
        trainer = _trainer(state, base, train_cfg)
    weights = running.enter_context(WeightServer(host=node_address()))
    pull = None
    if state.version:   # the replicas start on the base model: they pull the run's version
        published = trainer.publish(weights)
        pull = WeightPull(url=published.url, sha256=published.sha256)
    backends = tuple(b.strip().rstrip("/") for b in (opts.backend or "").split(",") if b.strip())
    cluster = running.enter_context(RayStack(ClusterOptions(
        address=opts.ray, nodes=opts.nodes, replicas=opts.replicas, backends=backends,
        replica_gpus=opts.replica_gpus, replica_dp=opts.replica_dp, model=opts.model or "",
        vllm=_vllm_settings(opts, train_cfg)), echo))
    harnesses = tuple(sorted({t.harness for t in [*tasks.train, *tasks.held_out]}))
    url = cluster.start(db, RolloutSetup(
        workers=opts.workers, max_tokens=opts.max_tokens, temperature=train_cfg.temperature,
        limits=dict(opts.session_limits), harnesses=harnesses, version=state.version,
        fold_s=3600.0 if opts.max_staleness == 0 else None), (state.version, state.checkpoint or base, pull))
    nodes = Nodes(running.enter_context(closing(ServerClient(url, token=cluster.token))), cluster)
    loop = Loop(opts, train_cfg, out, db, state, tasks, nodes, cluster.backends[0] if cluster.backends else None,
                base, trainer, trackers, echo)
    loop.weights = weights
    return loop


def _iteration(loop: Loop, it: int) -> IterationRow:
    """One iteration, its steps in order (steps.py); its row, stored and logged."""
    version = loop.state.version
    done = steps.rollouts(loop, it)
    calls = steps.trainable_calls(loop, it, done)
    trained = steps.train(loop, it, calls)
    synced = steps.publish_and_sync(loop, trained)
    row = steps.iteration_row(loop.state.run_id, it, version, done, calls, trained, synced,
                              JournalFigures.read(loop.nodes.stack))
    steps.record(loop, row, trained)
    return row


# before anything starts -------------------------------------------------------------------------

def _check_options(opts: LoopOptions) -> None:
    if opts.server and opts.backend:
        raise LoopError("--server or --backend, not both: the rollout server's nodes have their own backends")
    if opts.colocate and opts.max_staleness:
        raise LoopError("--colocate needs --max-staleness 0: vLLM sleeps while the trainer runs, so "
                        "nothing can be sampled then")
    if opts.backend and "," in opts.backend and not opts.ray:
        raise LoopError("several --backend URLs are replicas on a Ray cluster: add --ray")
    if not opts.ray and (opts.trainer_gpus or opts.trainer_actor):
        raise LoopError("--trainer-gpus and --trainer-actor place the trainer on a Ray cluster: add --ray")
    if opts.ray and (opts.server or opts.colocate):
        raise LoopError("--ray runs its own rollout server and replicas: not with --server or --colocate")
    if opts.weights_from == "memory" and opts.server:
        raise LoopError("--weights-from memory serves the weights on this machine's loopback: not with --server "
                        "(its nodes' vLLMs read checkpoints from a filesystem both sides see)")
    if opts.model and (problem := model_dir_problem(opts.model)):   # before anything syncs to it
        raise LoopError(f"--model: {problem}")


@contextmanager
def _only_loop_on(out: Path) -> Iterator[None]:
    """One loop at a time on a run directory."""
    out.mkdir(parents=True, exist_ok=True)
    lock = os.open(out / ".loop.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise LoopError(f"another loop is running on {out}") from None
    try:
        yield
    finally:
        os.close(lock)


def _nothing_to_run(state: LoopState, opts: LoopOptions, db: str, echo: Callable[[str], None]) -> list[dict]:
    """A finished run: nothing starts, and a shared --backend keeps what it serves."""
    echo(f"{opts.out.resolve()}: {state.completed} iterations done already (--iterations {opts.iterations}); "
         "nothing to run")
    rows = stored_iterations(db, state.run_id) if Path(db).exists() else []
    echo(iteration_table(rows))
    return rows


def _checked_tasks(opts: LoopOptions, state: LoopState | None, db: str, out: Path) -> Tasks:
    """The task files read, their workspaces there and, on resume, the tasks unchanged; the
    harnesses installed."""
    tasks = read_tasks(opts.tasks_file, opts.harness, opts.samples)
    held_out = read_tasks(opts.eval_tasks_file, opts.harness, opts.samples) if opts.eval_tasks_file else []
    if not opts.server:   # a remote server checks its own (its nodes may hold them)
        check_workspaces([*tasks, *held_out])
    if state is not None and state.checkpoint and (problem := model_dir_problem(state.checkpoint)):
        raise LoopError(f"{LoopState.path(out)} serves checkpoint {state.checkpoint}, but {problem}")
    if state is not None and not opts.server:
        _check_unchanged(db, state.run_id, tasks, held_out, opts.tasks_file, out)
    if not opts.server and not opts.ray:   # on Ray, each gateway node installs its own
        ensure_harnesses(t.harness for t in [*tasks, *held_out])
    return Tasks(tasks, held_out)


def _trackers(opts: LoopOptions, cfg: TrainConfig, out: Path, state: LoopState,
              echo: Callable[[str], None]) -> Trackers:
    """One tracker run per loop run: a resume continues it."""
    return open_trackers(opts.report_to, out, state.run_id, echo=echo,
                         config={"loop": asdict(opts), "train": asdict(cfg)})


def _initial_policy(opts: LoopOptions, echo: Callable[[str], None]) -> str:
    from ..models import ensure_default_model

    return str(Path(opts.model).resolve()) if opts.model else str(ensure_default_model(log=echo))


def _open_database(db: str, state: LoopState, trackers: Trackers) -> None:
    init_db(db)
    if state.completed:   # what a tracker writing behind the loop lost to a kill, from the database
        trackers.catch_up([r for r in stored_iterations(db, state.run_id) if r["iteration"] < state.completed],
                          [(it, m) for it, m in stored_steps(db, state.run_id) if it < state.completed])


def _work(out: Path) -> Path:
    work = out / "work"
    work.mkdir(mode=0o700, exist_ok=True)
    return work


def _vllm_settings(opts: LoopOptions, cfg: TrainConfig) -> VLLMSettings:
    """The loop's vLLM: asleep while the trainer runs under --colocate, and its logprobs after
    the temperature (the trainer's differ from vLLM's raw ones unless it is 1)."""
    return replace(opts.vllm, sleep_mode=opts.colocate, processed_logprobs=cfg.temperature != 1.0)


def _trainer(state: LoopState, base: str, cfg: TrainConfig) -> "Trainer":
    """One trainer for the run: its weights, AdamW state, KL reference (the initial policy)
    and learning-rate schedule live across iterations."""
    from ..grpo.train import Trainer

    trainer = Trainer(state.checkpoint or base, cfg, ref_model=base)
    if state.trainer_state:
        trainer.load_state(Path(state.trainer_state))
    return trainer


def _summary(db: str, run_id: str, out: Path, echo: Callable[[str], None]) -> list[dict]:
    rows = stored_iterations(db, run_id)
    echo(iteration_table(rows))
    if rows:
        rise = held_out_rise(rows)
        if rise is not None:
            echo(rise.line())
        plot_loop(rows, out / "loop.png")
        echo(f"database {db}; plot {out / 'loop.png'}")
    return rows


@contextmanager
def _disk_full_is_a_loop_error(out: Path) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        if isinstance(e, click.ClickException) or not disk_full(e, out):
            raise
        where = getattr(e, "filename", None) or out
        raise LoopError(f"no space left on the device of {where} ({one_line(e)}): free some space and "
                        "rerun the same command to resume") from None


def disk_full(e: BaseException, near: Path) -> bool:
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

