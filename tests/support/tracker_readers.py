"""Each experiment tracker's run, read back with that tracker's own reader (the trackers
tests and scripts/bench_loop.py): {figure name: {step: value}}."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from polar_mitm.loop.trackers import ITERATION_PREFIXES, PROJECT, RUN_TAG, wandb_records

# the trackers' own telemetry off: nothing leaves the machine
QUIET = {"WANDB_SILENT": "true", "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
         "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "GRADIO_ANALYTICS_ENABLED": "False"}


def _axis(name: str) -> str:
    return "iteration" if name.startswith(ITERATION_PREFIXES) else "global_step"


def put_figure(seen: dict, name: str, step, value) -> None:
    """One figure's value at a step, into seen ({axis: {name: {step: value}}}, what a reader
    returns or a test expects). Later values of a step replace earlier ones: what a reader
    shows last."""
    seen.setdefault(_axis(name), {}).setdefault(name, {})[int(step)] = float(value)


# ---- each library's reader ------------------------------------------------------------------

def read_tensorboard(out: Path, run_id: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdirs = sorted(p.name for p in (out / "tensorboard").iterdir())
    assert logdirs == [run_id], logdirs           # one run: a resume writes into the same log dir
    acc = EventAccumulator(str(out / "tensorboard" / run_id), size_guidance={"scalars": 0})
    acc.Reload()
    seen: dict = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):                # in file order: a resume's file comes later
            put_figure(seen, tag, e.step, e.value)
    return seen


def read_wandb(out: Path, run_id: str) -> dict:
    runs = sorted((out / "wandb").glob("offline-run-*"))   # one folder per start, in time order
    assert runs and all(p.name.endswith(f"-{run_id}") for p in runs), runs
    seen: dict = {}
    ids = set()
    for folder in runs:
        for r in wandb_records(folder / f"run-{run_id}.wandb"):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                ids.add((r.run.run_id, r.run.project))
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                axis = "iteration" if "iteration" in row else "global_step"
                for k, v in row.items():
                    if not k.startswith("_") and k not in ("iteration", "global_step"):
                        assert _axis(k) == axis, (k, row)
                        put_figure(seen, k, row[axis], v)
    assert ids == {(run_id, PROJECT)}, ids        # every start continues the same run
    seen["segments"] = len(runs)
    return seen


def read_mlflow(out: Path, run_id: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name(PROJECT)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].data.tags[RUN_TAG] == run_id, runs    # one run, resumes included
    run = runs[0]
    seen: dict = {}
    for key in run.data.metrics:
        history = client.get_metric_history(run.info.run_id, key)
        for m in sorted(history, key=lambda m: m.timestamp):    # the latest of a step last
            put_figure(seen, key, m.step, m.value)
    return seen


TRACKIO_READER = """
import json, sys
import trackio
from trackio.sqlite_storage import SQLiteStorage
project, run = sys.argv[1:3]
runs = [r.name for r in trackio.Api().runs(project)]
print(json.dumps({"runs": runs, "logs": SQLiteStorage.get_logs(project, run)}, default=str))
"""


def read_trackio(out: Path, run_id: str) -> dict:
    # its own process: trackio fixes its directory when first imported
    env = {**os.environ, **QUIET, "TRACKIO_DIR": str(out / "trackio")}
    done = subprocess.run([sys.executable, "-c", TRACKIO_READER, PROJECT, run_id], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["runs"] == [run_id], got["runs"]   # one run, resumes included
    seen: dict = {}
    for entry in got["logs"]:                     # in the order logged
        for k, v in entry.items():
            if k not in ("step", "timestamp", "run", "run_id", "project", "log_id") and isinstance(v, (int, float)):
                put_figure(seen, k, entry["step"], v)
    return seen


READERS = {"tensorboard": read_tensorboard, "wandb": read_wandb, "mlflow": read_mlflow, "trackio": read_trackio}
