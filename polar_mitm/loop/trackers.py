"""Experiment trackers (--report-to tensorboard,wandb,mlflow,trackio, as TRL names them): every
figure of the loop's iteration table, on the iteration axis (1-based, as the table prints it),
and every optimizer step's metrics, on the trainer's global_step axis.

Each tracker logs on this machine by default, under the run's --out, unless the library's own
environment variables say otherwise (they win): OUT/tensorboard/RUN, OUT/wandb (offline
unless WANDB_MODE is set: nothing leaves the machine unasked), sqlite:///OUT/mlflow.db
(MLflow 3's file store is in maintenance mode), OUT/trackio. A run keeps one tracker run
across resumes: named after the loop's run id (OUT/tracker_run.json for `polar-train train`).

Only the standard library and click at import: each library is imported when its tracker
opens (they cost seconds, and trackio fixes its directory at import)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import secrets
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Mapping, Protocol, Sequence

import click

if TYPE_CHECKING:
    from ..store.loop import IterationRow

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
PROJECT = "polar-mitm"      # wandb project, mlflow experiment, trackio project (unless their env says)
RUN_TAG = "polar_run_id"    # mlflow: the tag that finds the run again on resume

# The iteration row's columns under their tracker names; any other numeric column is
# iteration/COLUMN. The iteration itself is the step; run_id and checkpoint are not figures.
ITERATION_NAMES = {
    "reward_mean": "reward/mean", "reward_std": "reward/std", "eval_reward_mean": "reward/held_out",
    "eval_reward_std": "reward/held_out_std", "reward_n": "reward/n", "eval_reward_n": "reward/held_out_n",
    "sessions_done": "sessions/done", "sessions_failed": "sessions/failed",
    "sessions_timed_out": "sessions/timed_out", "sessions_released": "sessions/released",
    "rollout_s": "time/rollout_s", "train_s": "time/train_s", "sync_s": "time/sync_s",
    "sync_drain_s": "time/sync_drain_s", "sync_reload_s": "time/sync_reload_s", "sync_stall_s": "time/sync_stall_s",
    "sync_reset_s": "time/sync_reset_s", "sync_wake_s": "time/sync_wake_s", "sleep_s": "time/sleep_s",
}
_SKIPPED = frozenset({"run_id", "iteration", "checkpoint", "per_task", "released_why"})
ITERATION_PREFIXES = ("reward/", "sessions/", "time/", "iteration/")   # on the iteration axis
STEP_PREFIX = "train/"                                                 # on the global_step axis
_UNSAFE = re.compile(r"[^A-Za-z0-9_./: -]")   # MLflow's metric-name alphabet (task ids may hold +=@)


class TrackerError(click.ClickException):
    """A tracker that cannot be used: one line, before anything starts."""


def metric_name(name: str) -> str:
    return _UNSAFE.sub("_", name)


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def iteration_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The iteration row's figures, by tracker name: reward/mean, reward/held_out,
    reward/task/TASK, sessions/done, time/rollout_s, iteration/stale_dropped, ..."""
    out: dict[str, float] = {}
    for col, v in row.items():
        x = _number(v)
        if col not in _SKIPPED and x is not None:
            out[ITERATION_NAMES.get(col, f"iteration/{col}")] = x
    per_task = row.get("per_task") or {}
    if isinstance(per_task, str):   # as loop_iterations stores it
        per_task = json.loads(per_task)
    for task, r in per_task.items():
        if (x := _number(r.get("mean"))) is not None:
            out[metric_name(f"reward/task/{task}")] = x
    why = row.get("released_why") or {}
    if isinstance(why, str):
        why = json.loads(why)
    for cause, n in why.items():
        out[metric_name(f"sessions/released_why/{cause}")] = float(n)
    return out


def step_metrics(m: Mapping[str, Any]) -> dict[str, float]:
    """An optimizer step's numeric metrics as train/NAME (global_step is the step itself)."""
    return {metric_name(f"{STEP_PREFIX}{k}"): x for k, v in m.items()
            if k != "global_step" and (x := _number(v)) is not None}


@dataclass(frozen=True)
class Point:
    """One step's metrics on one axis."""
    axis: Literal["iteration", "global_step"]
    step: int                  # on that axis
    order: int                 # increases across both axes, resumes included (wandb's own step)
    metrics: dict[str, float]


class Tracker(Protocol):
    name: str
    where: str                 # what a user looks at, said once at open

    def log(self, point: Point) -> None: ...

    def holds(self, point: Point) -> bool:
        """Whether the tracker's store held this point of the run when it opened: a resume
        logs again what it lacks (Trackers.catch_up). A tracker that writes each log before
        it returns holds every point of the iterations the loop completed."""
        ...

    def close(self) -> None: ...


# ---- the backends ---------------------------------------------------------------------------

class TensorBoard:
    """Event files in one directory per run: a resume writes a new file beside the others."""
    name = "tensorboard"

    def __init__(self, out: Path, run_id: str, config: Mapping[str, Any]):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir = out / "tensorboard" / run_id
        self.where = str(logdir)
        self._writer = EventFileWriter(str(logdir))

    def log(self, point: Point) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in point.metrics.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=point.step, summary=Summary(value=values)))
        self._writer.flush()   # once an iteration: a kill -9 loses nothing already logged

    def holds(self, point: Point) -> bool:
        return True

    def close(self) -> None:
        self._writer.close()


class WandB:
    """id = the run id with resume="allow": online it continues the run; offline each resume
    is a run folder of the same id, and `wandb sync` uploads them in order into one run.
    Its own step (`order`) grows across both axes and across resumes, so no row is dropped
    as out of order (an iteration redone after a kill -9 repeats its steps: online wandb keeps
    the first values, with a warning; the other trackers show the later ones last). Each
    family is charted on its own axis (define_metric)."""
    name = "wandb"

    def __init__(self, out: Path, run_id: str, config: Mapping[str, Any]):
        import wandb

        offline = "WANDB_MODE" not in os.environ
        # console off: the loop's output quotes harness output; the tracker gets the figures only
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, id=run_id, name=run_id,
                               resume="allow", dir=None if os.environ.get("WANDB_DIR") else str(out),
                               mode="offline" if offline else None, settings=wandb.Settings(console="off"))
        self._run.config.update(dict(config), allow_val_change=True)
        self._run.define_metric("iteration")
        self._run.define_metric("global_step")
        for prefix in ITERATION_PREFIXES:
            self._run.define_metric(f"{prefix}*", step_metric="iteration")
        self._run.define_metric(f"{STEP_PREFIX}*", step_metric="global_step")
        folder = Path(self._run.dir).parent
        self.where = f"{folder} ({'offline' if self._run.offline else 'online'})"
        # wandb's service writes behind the loop: a kill -9 loses what it still held. The last
        # step that reached the earlier folders' files (offline), or the server (online).
        if self._run.offline:
            earlier = [p for p in folder.parent.glob(f"offline-run-*-{run_id}") if p != folder]
            self._last = max((wandb_last_step(p / f"run-{run_id}.wandb") for p in earlier), default=-1)
        else:
            self._last = int(self._run.starting_step) - 1

    def log(self, point: Point) -> None:
        self._run.log({point.axis: point.step, **point.metrics}, step=point.order)

    def holds(self, point: Point) -> bool:
        return point.order <= self._last

    def close(self) -> None:
        self._run.finish()


WANDB_HEADER = b":W&B\xe1\xbe\x00"   # a .wandb file's magic and version
WANDB_BLOCK = 32768


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf Records of a .wandb file (wandb's LevelDB-style log: 32 KiB blocks, each
    chunk a 7-byte header of crc, length and type; wandb ships the Record message but no
    reader). A file cut short by a kill ends at its last whole record."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:7] != WANDB_HEADER:
        return
    i, record = 7, b""
    while i + 7 <= len(data):
        if WANDB_BLOCK - i % WANDB_BLOCK < 7:          # a block's tail too short for a header: padding
            i += WANDB_BLOCK - i % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[i:i + 7])
        if kind == 0 or i + 7 + length > len(data):    # zeroes, or a chunk the kill cut
            return
        chunk, i = data[i + 7:i + 7 + length], i + 7 + length
        record = chunk if kind in (1, 2) else record + chunk    # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            r = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            try:
                r.ParseFromString(record)
            except DecodeError:
                return
            yield r


def wandb_last_step(path: Path) -> int:
    """The last history step (wandb's own step) a .wandb file holds (-1: none, or no file)."""
    last = -1
    try:
        for r in wandb_records(path):
            if r.WhichOneof("record_type") == "history":
                last = max(last, int(r.history.step.num))
    except FileNotFoundError:
        pass
    return last


class MLflow:
    """One run per run id, found again by its tag; metrics logged through the client (no
    global active run, no background thread)."""
    name = "mlflow"

    def __init__(self, out: Path, run_id: str, config: Mapping[str, Any]):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")   # nothing leaves the machine unasked
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out / 'mlflow.db'}"
        self._client = client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        exp = client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(
            name, artifact_location=None if os.environ.get("MLFLOW_TRACKING_URI") else (out / "mlartifacts").as_uri())
        runs = client.search_runs([exp_id], filter_string=f"tags.{RUN_TAG} = '{run_id}'", max_results=1)
        if runs:
            self._id = runs[0].info.run_id
            client.update_run(self._id, status="RUNNING")
        else:
            self._id = client.create_run(exp_id, run_name=run_id, tags={RUN_TAG: run_id}).info.run_id
            # params are write-once in MLflow: the first open's, not a resume's
            params = [Param(k[:250], str(v)[:6000]) for k, v in config.items()]
            for i in range(0, len(params), 100):
                client.log_batch(self._id, params=params[i:i + 100])
        self.where = f"{uri} (experiment {name}, run {self._id})"

    def log(self, point: Point) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, point.step) for k, v in point.metrics.items()]
        for i in range(0, len(metrics), 1000):   # log_batch's limit
            self._client.log_batch(self._id, metrics=metrics[i:i + 1000])

    def holds(self, point: Point) -> bool:
        return True   # log_batch commits before it returns

    def close(self) -> None:
        self._client.set_terminated(self._id)


class Trackio:
    """The run named after the run id, resume="allow"; its local database under OUT/trackio
    unless TRACKIO_DIR (or TRACKIO_SPACE_ID, TRACKIO_SERVER_URL) says otherwise."""
    name = "trackio"

    def __init__(self, out: Path, run_id: str, config: Mapping[str, Any]):
        global _trackio_dir_set
        user = os.environ.get("TRACKIO_DIR")
        wanted = Path(user) if user and user != _trackio_dir_set else out / "trackio"
        if "trackio" not in sys.modules:   # trackio reads it once, when first imported
            os.environ["TRACKIO_DIR"] = _trackio_dir_set = str(wanted)
        import trackio
        import trackio.utils

        if Path(trackio.utils.TRACKIO_DIR) != wanted:
            raise TrackerError(f"--report-to trackio: trackio was imported already, logging to "
                               f"{trackio.utils.TRACKIO_DIR}, not {wanted}")
        self._run = trackio.init(project=os.environ.get("TRACKIO_PROJECT") or PROJECT, name=run_id,
                                 resume="allow", config=dict(config), embed=False,
                                 auto_log_cpu=False, auto_log_gpu=False)
        self.where = str(wanted)
        self._trackio = trackio
        # its sender thread writes behind the loop: a kill -9 loses what it still queued. The
        # last step of each axis in its local database (a remote server's: not known, trusted).
        self._last: dict[str, int] | None = None
        if not (os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL")):
            from trackio.sqlite_storage import SQLiteStorage

            self._last = {"iteration": 0, "global_step": 0}
            for e in SQLiteStorage.get_logs(self._run.project, run=run_id, scalar_only=True):
                axis = "iteration" if any(str(k).startswith(ITERATION_PREFIXES) for k in e) else "global_step"
                self._last[axis] = max(self._last[axis], int(e["step"]))

    def log(self, point: Point) -> None:
        self._run.log(dict(point.metrics), step=point.step)

    def holds(self, point: Point) -> bool:
        return self._last is None or point.step <= self._last[point.axis]

    def close(self) -> None:
        self._trackio.finish()   # its current run (ours), which its exit hook would finish again


_trackio_dir_set: str | None = None   # the TRACKIO_DIR we set (not the user's)

BACKENDS: dict[str, Callable[[Path, str, Mapping[str, Any]], Tracker]] = {
    "tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "trackio": Trackio}
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


# ---- the fan-out ----------------------------------------------------------------------------

class Trackers:
    """Every tracker asked for, each fed the same points. A tracker that fails to log says so
    in one line and is dropped: the database keeps every figure, and a tracker's outage
    must not stop a long run."""

    def __init__(self, trackers: Sequence[Tracker] = (), echo: Callable[[str], None] | None = None):
        self.trackers = list(trackers)
        self._echo = echo or (lambda m: click.echo(m, err=True))
        self._global_step = 0

    def log_steps(self, history: Iterable[Mapping[str, Any]], iteration: int = 0) -> None:
        """Optimizer steps (the trainer's metrics dicts), at their global_step; iteration
        (0-based) is the one they belong to (0 for `polar-train train`)."""
        for m in history:
            g = int(m["global_step"])
            self._global_step = max(self._global_step, g)
            self._log(Point("global_step", g, g + iteration, step_metrics(m)))

    def log_iteration(self, row: IterationRow | Mapping[str, Any], global_step: int | None = None) -> None:
        """The iteration's row, at its 1-based number; global_step: the trainer's after it
        (default: the last one logged). After log_steps for its steps."""
        it = int(row["iteration"]) + 1
        g = self._global_step if global_step is None else global_step
        # above this iteration's steps (g + it - 1 at most), below the next one's first
        self._log(Point("iteration", it, g + it, iteration_metrics(row)))

    def catch_up(self, rows: Iterable[IterationRow | Mapping[str, Any]],
                 steps: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
        """On resume, before the next iteration: the completed iterations' rows and optimizer
        steps (loop_iterations, loop_steps) that a tracker lacks, because it wrote behind the
        loop when the last process was killed (Tracker.holds), logged to it again."""
        by_iteration: dict[int, list[Mapping[str, Any]]] = {}
        for it, m in steps:
            by_iteration.setdefault(it, []).append(m)
        g = 0
        points: list[tuple[int, Point]] = []   # (1-based iteration, point), with the steps they had
        for row in sorted(rows, key=lambda r: int(r["iteration"])):
            it = int(row["iteration"])
            for m in by_iteration.get(it, []):
                step = int(m["global_step"])
                g = max(g, step)
                points.append((it + 1, Point("global_step", step, step + it, step_metrics(m))))
            points.append((it + 1, Point("iteration", it + 1, g + it + 1, iteration_metrics(row))))
        self._global_step = max(self._global_step, g)
        for t in list(self.trackers):
            missing = [p for _, p in points if not t.holds(p)]
            if missing:
                held = max((it for it, p in points if p.axis == "iteration" and t.holds(p)), default=0)
                self._echo(f"--report-to {t.name}: it holds iterations 1-{held} of this run; logging "
                           f"{sum(p.axis == 'iteration' for p in missing)} more from the database")
            for p in missing:
                self._log(p, [t])

    def _log(self, point: Point, only: Sequence[Tracker] | None = None) -> None:
        for t in [t for t in self.trackers if only is None or t in only]:
            try:
                t.log(point)
            except Exception as e:
                self.trackers.remove(t)
                self._echo(f"--report-to {t.name}: logging failed ({type(e).__name__}: {_one_line(e)}); "
                           "it is off for the rest of this run (the database has every figure)")

    def close(self) -> None:
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:
                self._echo(f"--report-to {t.name}: closing failed ({type(e).__name__}: {_one_line(e)})")
        self.trackers = []


def open_trackers(names: Iterable[str], out: Path, run_id: str, config: Mapping[str, Any] | None = None,
                  echo: Callable[[str], None] | None = None) -> Trackers:
    """The trackers asked for, each on the run `run_id` (a new one, or the one a resume
    continues). A tracker that cannot open is a TrackerError, after the others are closed."""
    out = Path(out).resolve()
    flat = flat_config(config or {})
    opened: list[Tracker] = []
    for name in names:
        try:
            opened.append(BACKENDS[name](out, run_id, flat))
        except Exception as e:
            Trackers(opened).close()
            if isinstance(e, TrackerError):
                raise
            raise TrackerError(f"--report-to {name}: cannot start ({type(e).__name__}: {_one_line(e)})") from e
    trackers = Trackers(opened, echo)
    if opened:
        trackers._echo(f"reporting run {run_id} to " + "; ".join(f"{t.name} {t.where}" for t in opened))
    return trackers


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys; values other than numbers, strings and bools as text."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            ok = isinstance(v, (int, float, str, bool)) and not (isinstance(v, float) and not math.isfinite(v))
            out[f"{prefix}{k}"] = v if ok else str(v)
    return out


def tracker_run_id(out: Path) -> str:
    """`polar-train train`'s run id, kept in OUT/tracker_run.json: rerunning the same command
    continues the same tracker run."""
    path = Path(out) / "tracker_run.json"
    try:
        return str(json.loads(path.read_text())["run_id"])
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(4)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"run_id": run_id}))
    os.replace(tmp, path)
    return run_id


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


# ---- the option -----------------------------------------------------------------------------

def parse_report_to(values: Iterable[str]) -> tuple[str, ...]:
    """--report-to's values: repeated and/or comma-separated, "none" for none; in order, once
    each. Unknown names are a ValueError."""
    names: list[str] = []
    for value in values:
        for name in (n.strip().lower() for n in value.split(",")):
            if name in ("", "none"):
                continue
            if name not in TRACKERS:
                raise ValueError(f"{name!r} is not a tracker: {', '.join(TRACKERS)} or none")
            if name not in names:
                names.append(name)
    return tuple(names)


def missing(names: Iterable[str]) -> list[str]:
    """The trackers whose library is not installed. A look-up, not an import: importing
    costs seconds, and trackio's import fixes its directory before --out is known."""
    gone = []
    for name in names:
        module = _MODULES[name]
        try:
            found = sys.modules[module] is not None if module in sys.modules \
                else importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            gone.append(name)
    return gone


def _report_to_callback(ctx: click.Context | None, param: click.Parameter | None,
                        value: tuple[str, ...] | None) -> tuple[str, ...]:
    try:
        names = parse_report_to(value or ())
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    for name in missing(names):
        raise TrackerError(f"--report-to {name}: the {_MODULES[name]} package is not installed: "
                           f"pip install 'polar-mitm[{name}]'")
    return names


report_to_option = click.option(
    "--report-to", "report_to", multiple=True, callback=_report_to_callback, metavar="TRACKER[,TRACKER]",
    help="Experiment trackers for every figure of the iteration table and each optimizer step's "
         "metrics: tensorboard, wandb, mlflow, trackio (repeat or comma-separate; none: off). Each logs "
         "on this machine under --out (OUT/tensorboard, OUT/wandb, OUT/mlflow.db, OUT/trackio) unless its "
         "own environment variables say otherwise (WANDB_MODE, WANDB_DIR, WANDB_PROJECT, MLFLOW_TRACKING_URI, "
         "MLFLOW_EXPERIMENT_NAME, TRACKIO_DIR, TRACKIO_PROJECT, TRACKIO_SPACE_ID); wandb runs offline unless "
         "WANDB_MODE is set. A resumed run continues the same tracker run. Each is an extra: "
         "pip install 'polar-mitm[wandb]' ('polar-mitm[trackers]': all four)")
