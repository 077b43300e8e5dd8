"""polar-train: GRPO on the sessions the proxy recorded.

Glue only: the store reads the DuckDB files (all SQL lives there), polar_mitm.grpo trains
(all torch lives there). Under torchrun every rank reads the files read-only."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any
from pathlib import Path

import click

from .params import MAX_TOKENS, WORKERS, backend_option, server_root, session_limit_option
from .lifecycle import LongRunning
from ..loop.options import LoopOptions
from ..stack.vllm import vllm_options
from ..grpo.config import BUILDERS, NORMALIZATIONS, AdvantageConfig, LossConfig, TrainConfig
from ..grpo.results import StepMetrics
from ..trainer_input import REWARD_COVERS, Call
from ..store.training import SAMPLING_REASONS, TrainingData, set_rewards, task_reward_covers, training_calls
from ..loop.trackers import report_to_option

_T, _L, _A = TrainConfig(), LossConfig(), AdvantageConfig()   # the defaults, in one place
_LOOP = {f.name: f.default for f in dataclasses.fields(LoopOptions)}


def _die(msg: str):
    raise click.ClickException(msg)


def _load(dbs, tasks, sessions, require_reward=True, temperature=_T.temperature,
          reward_covers=None) -> tuple[list[Call], TrainingData]:
    """reward_covers None: each task's own choice (its stored spec), else "all" or "main"."""
    if not dbs:
        _die("give at least one --db")
    try:
        covers = reward_covers or task_reward_covers(dbs)
        data = training_calls(dbs, tasks=list(tasks) or None, sessions=list(sessions) or None,
                              require_reward=require_reward, temperature=temperature, reward_covers=covers)
    except FileNotFoundError as e:
        _die(str(e))
    except Exception as e:  # a locked or foreign file: say which
        _die(f"cannot read {', '.join(dbs)}: {e}")
    return data.calls, data


def _sampling_line(data, temperature) -> str:
    """How many calls each sampling rule left out (store.training.sampling_exclusion)."""
    counts = ", ".join(f"{r} {data.skipped.get(r, 0)}" for r in SAMPLING_REASONS)
    return f"not sampled as the trainer samples (temperature {temperature:g}, top_p 1, top_k off): {counts}"


def _kinds_line(data) -> str:
    k = data.call_kinds
    return (f"calls of the main loop (the model each session called most) {k.get('main', 0)}, auxiliary "
            f"(a router's, a title call's) {k.get('auxiliary', 0)}, of which left out (reward_covers main) "
            f"{data.skipped.get('auxiliary_call', 0)}")


def _skipped_line(data) -> str:
    parts = [f"{k} {v}" for k, v in sorted(data.skipped.items())]
    extra = f"; {data.sessions_without_reward} sessions without a reward" if data.sessions_without_reward else ""
    return f"skipped calls: {', '.join(parts) or 'none'}{extra}"


def _default_model() -> str:
    from ..models import ensure_default_model
    return str(ensure_default_model(log=lambda m: click.echo(m, err=True)))


@click.group()
def main():
    """GRPO on recorded harness sessions."""


def trainer_options(f):
    """The options of train and loop, with TrainConfig's defaults."""
    for option in reversed([
        click.option("--builder", type=click.Choice(BUILDERS), default=_T.builder, show_default=True),
        click.option("--lr", default=_T.lr, show_default=True),
        click.option("--warmup-steps", default=_T.warmup_steps, show_default=True,
                     help="Linear learning-rate warmup, in optimizer steps (over a whole loop)"),
        click.option("--epochs", default=_T.epochs, show_default=True),
        click.option("--groups-per-step", default=_T.groups_per_step, show_default=True,
                     help="0: all groups in one optimizer step"),
        click.option("--token-budget", default=_T.token_budget, show_default=True, help="Tokens per micro-batch row"),
        click.option("--normalization", type=click.Choice(NORMALIZATIONS), default=_T.normalization,
                     show_default=True),
        click.option("--std/--no-std", "scale_std", default=_A.scale_std, show_default=True,
                     help="Divide advantages by the group's reward std"),
        click.option("--leave-one-out", is_flag=True, default=_A.leave_one_out,
                     help="Baseline = mean of the other sessions of the group"),
        click.option("--clip-low", default=_L.clip_low, show_default=True),
        click.option("--clip-high", default=_L.clip_high, show_default=True),
        click.option("--tis-cap", default=_L.tis_cap, show_default=True, help="Truncated importance sampling cap"),
        click.option("--kl-coef", default=_L.kl_coef, show_default=True,
                     help="k3 KL to the initial policy (or --ref-model)"),
        click.option("--max-grad-norm", default=_T.max_grad_norm, show_default=True),
        click.option("--weight-decay", default=_T.weight_decay, show_default=True),
        click.option("--gradient-checkpointing", is_flag=True, default=_T.gradient_checkpointing,
                     help="Recompute each row in backward (less memory)"),
        click.option("--temperature", default=_T.temperature, show_default=True,
                     help="The policy's sampling temperature: the gateway's (polar_sampling) and the "
                          "trainer's; calls sampled otherwise are not trained"),
        click.option("--seed", default=_T.seed, show_default=True),
    ]):
        f = option(f)
    return f


def train_config(*, scale_std, leave_one_out, clip_low, clip_high, tis_cap, kl_coef, **options) -> TrainConfig:
    """trainer_options' values as the config: the others are TrainConfig's own fields."""
    return TrainConfig(advantage=AdvantageConfig(scale_std=scale_std, leave_one_out=leave_one_out),
                       loss=LossConfig(clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap, kl_coef=kl_coef),
                       **options)


reward_covers_option = click.option(
    "--reward-covers", type=click.Choice(REWARD_COVERS), default=None,
    help="Which calls a session's reward covers: all, or its main loop only (default: each task's "
         "reward_covers, else all)")


@main.command()
@click.option("--db", "dbs", multiple=True, required=True, help="DuckDB file (repeat for one per gateway machine)")
@click.option("--model", default="", help="Hugging Face model directory (default: the embedded SmolLM2)")
@click.option("--out", required=True, help="Output directory: metrics.jsonl, metrics.png, checkpoint/")
@click.option("--task", "tasks", multiple=True, help="Only these tasks (GRPO groups)")
@click.option("--session", "sessions", multiple=True, help="Only these sessions")
@reward_covers_option
@report_to_option
@trainer_options
@LongRunning("training stopped; no checkpoint was saved")
def train(dbs, model, out, tasks, sessions, reward_covers, report_to, **options):
    """Run GRPO on the rewarded sessions and save a checkpoint vLLM serves."""
    from ..grpo.train import TrainError, dist_env
    from ..grpo.train import train as run_train
    from ..loop.trackers import Trackers, open_trackers, tracker_run_id

    rank, _ = dist_env()
    cfg = train_config(**options)
    calls, data = _load(dbs, tasks, sessions, temperature=cfg.temperature, reward_covers=reward_covers)
    if rank == 0:
        click.echo(f"{len(calls)} calls of {data.sessions} rewarded sessions; {_skipped_line(data)}")
    if not calls:
        _die("no rewarded sessions to train on: set rewards with `polar-train reward --db DB rewards.jsonl` "
             "(or check --task/--session)")
    model = model or _default_model()
    bar = None
    trackers = Trackers()
    if rank == 0 and report_to:   # rerunning the same command continues the same tracker run
        trackers = open_trackers(report_to, Path(out), tracker_run_id(Path(out)),
                                 config={"train": dataclasses.asdict(cfg), "model": model, "db": list(dbs)})

    def progress(n: int, total: int, m: StepMetrics) -> None:
        nonlocal bar
        if rank != 0:
            return
        trackers.log_steps([m.as_dict()])
        if bar is None:
            bar = click.progressbar(length=total, label="training", file=sys.stderr,
                                    item_show_func=lambda s: s)
            bar.__enter__()
        bar.update(1, f"loss {m.loss:+.4f} clip {m.clip_frac:.3f} |dlp| {m.logprob_abs_diff:.4f}")

    try:
        result = run_train(calls, model, out, cfg, progress=progress, session_rewards=data.rewards)
    except TrainError as e:
        _die(str(e))
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
        trackers.close()
    if rank == 0:
        last = result.last
        click.echo(f"{result.steps} steps" + (f"; last loss {last.loss:+.5f}, clip fraction {last.clip_frac:.3f}, "
                   f"mean |trainer - vLLM| logprob {last.logprob_abs_diff:.4f}" if last else ""))
        click.echo(f"checkpoint: {result.checkpoint}\nmetrics: {result.metrics_path} and "
                   f"{result.metrics_path.with_suffix('.png')}")


@main.command()
@click.option("--db", "dbs", multiple=True, required=True)
@click.option("--model", default="", help="Also measure trainer-vs-vLLM logprob parity with this model")
@click.option("--task", "tasks", multiple=True)
@click.option("--session", "sessions", multiple=True)
@click.option("--temperature", type=float, default=_T.temperature, show_default=True,
              help="The trainer's: calls vLLM sampled at another temperature are counted, not used")
@click.option("--json", "as_json", is_flag=True)
@reward_covers_option
def stats(dbs, model, tasks, sessions, temperature, as_json, reward_covers):
    """Compare the three builders on the recorded calls (and, with --model, logprob parity),
    after the calls each rule leaves out (the sampling rule's included)."""
    from ..grpo.trajectories import build

    calls, data = _load(dbs, tasks, sessions, require_reward=False, temperature=temperature,
                        reward_covers=reward_covers)
    if not calls:
        _die(f"no trainable calls in {', '.join(map(str, dbs))}; {_skipped_line(data)}")
    rows = [build(calls, b).stats.as_dict() for b in reversed(BUILDERS)]
    report: dict[str, Any] = {"skipped": dict(data.skipped), "builders": rows, "call_kinds": dict(data.call_kinds),
              "sampling": {"temperature": temperature,
                           "excluded": {r: data.skipped.get(r, 0) for r in SAMPLING_REASONS}}}
    if model:
        from ..grpo.train import TrainError, logprob_parity
        try:
            report["parity"] = logprob_parity(calls, model)
        except TrainError as e:
            _die(str(e))
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{len(calls)} calls, {len({c.session_id for c in calls})} sessions, "
               f"{len({c.group for c in calls})} groups; {_skipped_line(data)}")
    click.echo(_sampling_line(data, temperature))
    click.echo(_kinds_line(data))
    click.echo(format_builders(rows))
    if model:
        p = report["parity"]
        click.echo(f"trainer vs vLLM logprob over {p['tokens']} tokens: mean |diff| {p['mean_abs_diff']:.4f}, "
                   f"p99 {p['p99_abs_diff']:.4f}, max {p['max_abs_diff']:.4f}")


def format_builders(rows: list[dict]) -> str:
    base = next(r for r in rows if r["builder"] == "per_request")
    cols = ["sequences", "forward_tokens", "trained_tokens", "branches", "dropped_calls", "drift_events",
            "drift_tokens"]
    lines = [f"{'builder':15}" + "".join(f"{c:>16}" for c in cols) + f"{'fwd vs per_req':>16}"]
    for r in rows:
        ratio = base["forward_tokens"] / max(r["forward_tokens"], 1)
        lines.append(f"{r['builder']:15}" + "".join(f"{r[c]:>16,}" for c in cols) + f"{ratio:>15.2f}x")
    return "\n".join(lines)


@main.command()
@click.option("--tasks", "tasks_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Task file (JSONL, as for polar-mitm rollout)")
@click.option("--iterations", required=True, type=click.IntRange(1), help="Iterations in all (a rerun continues)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Run directory: database, "
              "checkpoints, loop.json, loop.png; rerun with the same --out to resume")
@click.option("--harness", default=None, help="For tasks that name none (default pi)")
@click.option("--samples", type=click.IntRange(1, 1024), default=None, help="num_samples for tasks that give none")
@click.option("--model", default="", help="The initial policy (default: the embedded SmolLM2)")
@backend_option("A running vLLM (its root URL, http://HOST:PORT) started with VLLM_SERVER_DEV_MODE=1 "
                "(default: start one, kept across iterations); with --ray, several as URL,URL,...", many=True)
@click.option("--eval-tasks", "eval_tasks_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Held-out tasks: run with the current policy (see --eval-every), never trained on")
@click.option("--eval-every", default=_LOOP["eval_every"], show_default=True, type=click.IntRange(1),
              help="Run the held-out tasks at the first iteration, every K-th and the last")
@click.option("--workers", default=_LOOP["workers"], show_default=True, type=WORKERS, help="RUN slots of the node")
@click.option("--max-tokens", default=_LOOP["max_tokens"], show_default=True, type=MAX_TOKENS,
              help="Cap on each call's output tokens")
@click.option("--keep", default=_LOOP["keep"], show_default=True, type=click.IntRange(1), help="Checkpoints kept")
@vllm_options
@click.option("--max-staleness", default=_LOOP["max_staleness"], show_default=True, type=click.IntRange(0),
              help="Policy versions a trained token may lag (older ones are context only): 0 is "
                   "synchronous; with K >= 1 the next iteration's rollouts run while this one trains")
@click.option("--server", default="", callback=server_root, help="A running rollout server "
              "(polar-mitm rollout-server) whose nodes (polar-mitm node) sample; each node syncs its vLLM in its heartbeats. The nodes' databases "
              "and the checkpoints must be on a filesystem both sides see")
@click.option("--colocate", is_flag=True, help="One GPU for vLLM and the trainer: vLLM sleeps (its weights "
              "and KV cache freed) while the trainer runs and wakes with the new weights. Needs vLLM's "
              "sleep mode (GPU), and --max-staleness 0")
@click.option("--sync-mode", default=_LOOP["sync_mode"], show_default=True,
              type=click.Choice(["auto", "inflight", "drain"]),
              help="How a sync swaps vLLM's weights: inflight (vLLM pauses its calls where they are, "
                   "reloads, tags, resumes; every token keeps its version), drain (new calls held, calls "
                   "in flight finish, then the reload), auto (inflight where vLLM has the token route)")
@click.option("--weights-from", default=_LOOP["weights_from"], show_default=True,
              type=click.Choice(["disk", "memory"]),
              help="Where a sync's weights come from: disk (vLLM reloads the checkpoint folder) or memory "
                   "(the trainer serves them over HTTP, vLLM's worker extension pulls and checks them; the "
                   "folder is still written, for resume, while the sync runs)")
@click.option("--ray", "ray_address", default=None, metavar="auto|local|ADDRESS",
              help="Run on a Ray cluster (pip install 'polar-mitm[ray]'): a gateway node on every Ray node "
                   "that offers the polar_node resource, --replicas vLLM actors (or --backend URL[,URL...]), "
                   "the trainer and rollout server here; no filesystem is shared (docs/cluster.md)")
@click.option("--nodes", type=click.IntRange(1), default=None, help="With --ray: at most this many gateway nodes")
@click.option("--replicas", type=click.IntRange(1), default=_LOOP["replicas"], show_default=True,
              help="With --ray: vLLM replicas, each a Ray actor; a session's calls stay on one")
@click.option("--replica-gpus", type=click.FloatRange(0), default=_LOOP["replica_gpus"], show_default=True,
              help="With --ray: GPUs per replica (0: CPU)")
@click.option("--replica-dp", type=click.IntRange(1), default=_LOOP["replica_dp"], show_default=True,
              help="With --ray: vLLM's own data parallelism in each replica (--data-parallel-size); each "
                   "session's calls are pinned to one engine (X-data-parallel-rank)")
@click.option("--trainer-gpus", type=click.FloatRange(0, 1), default=_LOOP["trainer_gpus"], show_default=True,
              help="With --ray: the trainer as a Ray actor (polar-trainer) with this many GPUs, where Ray finds "
                   "them; 0: the trainer runs in the driver's process")
@click.option("--trainer-actor", is_flag=True, help="With --ray: place the trainer as a Ray actor even without GPUs")
@report_to_option
@session_limit_option
@trainer_options
def loop(tasks_file, iterations, out, harness, samples, model, backend, eval_tasks_file, eval_every, workers,
         max_tokens, keep, vllm, max_staleness, server, colocate, sync_mode, weights_from, ray_address, nodes,
         replicas, replica_gpus, replica_dp, trainer_gpus, trainer_actor, report_to, session_limits, **options):
    """The closed loop: rollouts through a real harness, GRPO, the new weights synced into the
    running vLLM, the next rollouts.

    Exit status: 0 done; 1 an error (one line says which); 130 after Ctrl-C, 143 after SIGTERM
    (the stack is stopped; rerun the same command to resume)."""
    opts = LoopOptions(tasks_file=tasks_file, iterations=iterations, out=Path(out), harness=harness,
                       samples=samples, model=model or None, backend=backend or None,
                       eval_tasks_file=eval_tasks_file, eval_every=eval_every, workers=workers,
                       max_tokens=max_tokens, keep=keep, vllm=vllm, max_staleness=max_staleness,
                       server=server or None, colocate=colocate, report_to=report_to,
                       session_limits=session_limits, sync_mode=sync_mode, weights_from=weights_from,
                       ray=ray_address, nodes=nodes, replicas=replicas, replica_gpus=replica_gpus,
                       replica_dp=replica_dp, trainer_gpus=trainer_gpus, trainer_actor=trainer_actor)
    interruptible_loop(opts, train_config(**options))


def interruptible_loop(opts: LoopOptions, cfg: TrainConfig) -> None:
    """run_loop as a long-running command (`loop`, `demo`): Ctrl-C exits 130 and SIGTERM 143,
    with one line; the loop stops what it started on the way out (a rerun resumes)."""
    # first: a Ctrl-C while the loop loads exits 130 too, not click's 1
    with LongRunning(f"the loop stopped; rerun the same command to resume from {opts.out}"):
        from ..loop.run import run_loop
        run_loop(opts, cfg)


@main.command()
@click.option("--db", required=True)
@click.argument("rewards_file", type=click.Path(dir_okay=False))
def reward(db, rewards_file):
    """Set session rewards from a JSONL file of {"session_id": ..., "reward": ...}."""
    path = Path(rewards_file)
    if not path.exists():
        _die(f"no file {path}")
    records = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line.decode("utf-8")))
            except UnicodeDecodeError as e:
                _die(f"{path}:{n}: not UTF-8 text (byte 0x{line[e.start]:02x})")
            except json.JSONDecodeError as e:
                _die(f"{path}:{n}: not JSON ({e.msg})")
    try:
        count = set_rewards(db, records)
    except (ValueError, FileNotFoundError) as e:
        _die(str(e))
    click.echo(f"set {count} rewards in {db}")


if __name__ == "__main__":
    main(prog_name="polar-train")
