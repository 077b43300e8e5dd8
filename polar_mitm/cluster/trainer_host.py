"""The trainer where its resources are: a Ray actor (`polar-trainer`, `--trainer-gpus G`) that
holds the real Trainer (grpo/train.py) on its own node, and RemoteTrainer, the driver's handle,
which the loop uses exactly as it uses a Trainer (train_on, save, save_state, load_state,
publish, step).

No machine reads another's disk:
- the model folders go to the actor: the default model is made on the actor's node
  (models.ensure_default_model, from the installed package), any other folder (--model, a
  resumed run's checkpoint) is sent file by file in chunks through Ray, as is the trainer state;
- what the trainer writes comes back to the driver's --out the same way: a checkpoint (saved
  on the actor's node, then read back in chunks, several in flight), the trainer state, and each
  training call's metrics.jsonl/metrics.png;
- the weights a sync pulls are served by the actor itself (its own WeightServer on its node's
  address, a new secret path at each publish): they never pass through the driver.

Progress: the driver polls the actor for the steps done while train_on runs (the actor runs two
calls at once for that; its lock keeps every other call one at a time), so the loop's progress
bar moves step by step as on one machine.

The actor is not restarted (max_restarts=0): its weights and AdamW state live only in its
memory, so a lost trainer ends the run, and a rerun resumes from the driver's last checkpoint
and state, shipped again."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypedDict

import click

from ..grpo.config import TrainConfig
from ..grpo.results import Progress, StepMetrics, TrainResult
from ..trainer_input import Call, SessionReward

if TYPE_CHECKING:
    from ..grpo.weight_server import Published

log = logging.getLogger("polar.cluster")

ACTOR_NAME = "polar-trainer"
CHUNK = 8 << 20           # bytes per chunk through Ray (its object store takes anything above 100 KB)
IN_FLIGHT = 4             # chunks in flight each way: the transfer runs while the other side writes
METRIC_FILES = ("metrics.jsonl", "metrics.png")


class FileEntry(TypedDict):
    path: str             # relative, POSIX
    size: int


class Where(TypedDict):
    node_id: str
    address: str
    dir: str              # the actor's folder on its node
    pid: int
    gpus: list[str]       # Ray's GPU ids for it (empty on CPU)


@dataclass(frozen=True)
class ModelSource:
    """Where the actor gets a model folder: made on its node (the default model) or a folder
    the driver sent (its name among those received)."""
    received: str | None = None      # None: the default model, made on the actor's node


def manifest(root: Path) -> list[FileEntry]:
    """Every regular file under root (a single file: itself, as its name), sorted; links are
    not followed (a checkpoint folder holds none)."""
    if root.is_file():
        return [FileEntry(path=root.name, size=root.stat().st_size)]
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out.append(FileEntry(path=p.relative_to(root).as_posix(), size=p.stat().st_size))
    return out


def _inside(root: Path, rel: str) -> Path:
    """root/rel, refused unless rel is a plain relative path (no .., not absolute)."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or any(p in ("..", "") for p in parts):
        raise ValueError(f"not a relative path: {rel!r}")
    return root.joinpath(*parts)


def _pwrite(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _read(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def _chunks(entries: Sequence[FileEntry]) -> list[tuple[str, int, int]]:
    """(path, offset, length) of every chunk; an empty file is one empty chunk (it exists)."""
    out = []
    for e in entries:
        out.append((e["path"], 0, min(CHUNK, e["size"])))
        out += [(e["path"], off, min(CHUNK, e["size"] - off)) for off in range(CHUNK, e["size"], CHUNK)]
    return out


# ---- the actor ---------------------------------------------------------------------------------

class TrainerHost:
    """The trainer's actor: a folder of its own on its node, what the driver sent into it, the
    Trainer, and a WeightServer on the node's address. Made an actor by RemoteTrainer.start."""

    def __init__(self) -> None:
        from .ray_env import node_dir

        self.dir = Path(tempfile.mkdtemp(prefix="run-", dir=node_dir("trainer")))
        atexit.register(shutil.rmtree, self.dir, True)
        self._lock = threading.Lock()            # one call at a time, but progress()
        self._trainer: Any = None
        self._weights: Any = None
        self._steps: list[tuple[int, StepMetrics]] = []   # (steps in all, the step) of the running call
        self._serial = 0

    # -- where it runs --------------------------------------------------------------------
    def where(self) -> Where:
        import ray

        from .ray_env import node_address

        ctx = ray.get_runtime_context()
        return Where(node_id=ctx.get_node_id(), address=node_address(), dir=str(self.dir), pid=os.getpid(),
                     gpus=[str(g) for g in ray.get_gpu_ids()])

    # -- what the driver sends ------------------------------------------------------------
    def receive_begin(self, name: str, entries: list[FileEntry]) -> None:
        with self._lock:
            root = _inside(self.dir / "in", name)
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            for e in entries:
                path = _inside(root, e["path"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch(0o600)

    def receive_chunk(self, name: str, rel: str, offset: int, data: bytes) -> None:
        # no lock: chunks may land in any order (the actor runs two calls at once), each at its offset
        _pwrite(_inside(_inside(self.dir / "in", name), rel), offset, data)

    def receive_end(self, name: str, entries: list[FileEntry]) -> str:
        root = _inside(self.dir / "in", name)
        for e in entries:
            size = _inside(root, e["path"]).stat().st_size
            if size != e["size"]:
                raise OSError(f"{name}/{e['path']}: received {size} bytes of {e['size']}")
        return str(root)

    # -- the trainer ----------------------------------------------------------------------
    def start(self, model: ModelSource, ref_model: ModelSource | None, cfg: TrainConfig,
              trainer_state: str | None = None) -> int:
        """The Trainer, from received folders or the default model made here; trainer_state: a
        received file's name. Returns its step."""
        from ..grpo.train import Trainer

        with self._lock:
            self._trainer = Trainer(self._model(model), cfg,
                                    ref_model=self._model(ref_model) if ref_model is not None else None)
            if trainer_state is not None:
                self._load_state(trainer_state)
            return self._trainer.step

    def _model(self, source: ModelSource) -> str:
        if source.received is None:
            from ..models import ensure_default_model
            return str(ensure_default_model(log=log.info))
        return str(_inside(self.dir / "in", source.received))

    def train_on(self, calls: list[Call], session_rewards: dict[str, SessionReward] | None
                 ) -> tuple[TrainResult, dict[str, bytes]]:
        """One training call into a folder of its own here; the result and its metric files' bytes."""
        with self._lock:
            self._serial += 1
            out = self.dir / "train" / str(self._serial)
            self._steps = []

            def progress(n: int, total: int, m: StepMetrics) -> None:
                self._steps.append((total, m))

            try:
                result = self._trainer.train_on(calls, out, progress, session_rewards=session_rewards)
                files = {n: (out / n).read_bytes() for n in METRIC_FILES if (out / n).exists()}
                return result, files
            finally:
                shutil.rmtree(out, ignore_errors=True)

    def progress(self, since: int) -> list[tuple[int, StepMetrics]]:
        """The running (or last) training call's steps after the first `since`: (steps in all, step)."""
        return list(self._steps[since:])

    def step(self) -> int:
        with self._lock:
            return self._trainer.step

    # -- what goes back -------------------------------------------------------------------
    def save(self) -> tuple[str, list[FileEntry]]:
        """The checkpoint folder, saved here; (its token for read_chunk, its files)."""
        with self._lock:
            folder = self._outgoing()
            self._trainer.save(folder)
            return folder.name, manifest(folder)

    def save_state(self) -> tuple[str, list[FileEntry]]:
        """The trainer state, saved here as state.pt; (its token for read_chunk, [that file])."""
        with self._lock:
            folder = self._outgoing()
            folder.mkdir()
            self._trainer.save_state(folder / "state.pt")
            return folder.name, manifest(folder)

    def _outgoing(self) -> Path:
        """A new folder's path (not made) for what goes back to the driver."""
        self._serial += 1
        (self.dir / "out").mkdir(exist_ok=True)
        return self.dir / "out" / f"o{self._serial}"

    def read_chunk(self, token: str, rel: str, offset: int, n: int) -> bytes:
        return _read(_inside(_inside(self.dir / "out", token), rel), offset, n)

    def release(self, token: str) -> None:
        shutil.rmtree(_inside(self.dir / "out", token), ignore_errors=True)

    def load_state(self, name: str) -> int:
        with self._lock:
            self._load_state(name)
            return self._trainer.step

    def _load_state(self, name: str) -> None:
        root = _inside(self.dir / "in", name)
        files = [p for p in root.iterdir() if p.is_file()]
        if len(files) != 1:
            raise ValueError(f"trainer state {name}: expected one file, got {len(files)}")
        self._trainer.load_state(files[0])
        shutil.rmtree(root, ignore_errors=True)   # AdamW's moments: twice the weights, not kept here

    def publish(self) -> "Published":
        """The weights served from this node (its address, a new secret path each time)."""
        from ..grpo.weight_server import WeightServer
        from .ray_env import node_address

        with self._lock:
            if self._weights is None:
                self._weights = WeightServer(host=node_address())
            return self._trainer.publish(self._weights)

    def close(self) -> None:
        with self._lock:
            if self._weights is not None:
                self._weights.close()
                self._weights = None
            self._trainer = None
            shutil.rmtree(self.dir, ignore_errors=True)


# ---- the driver's side -------------------------------------------------------------------------

@dataclass
class Transfer:
    """One folder or file moved through Ray: its bytes, files and seconds."""
    bytes: int = 0
    files: int = 0
    seconds: float = 0.0


class RemoteTrainer:
    """The loop's trainer, in a Ray actor (TrainerHost): the interface of grpo.train.Trainer that
    the loop uses. Start it with RemoteTrainer.start; close() (or its `with`) ends the actor."""

    def __init__(self, actor: Any, where: Where):
        self.actor, self.where = actor, where
        self.transfers: dict[str, Transfer] = {}      # the last transfer of each kind (send, save, save_state)
        self._sent = 0

    @classmethod
    def start(cls, model: str | os.PathLike, cfg: TrainConfig, ref_model: str | os.PathLike | None = None,
              trainer_state: str | os.PathLike | None = None, gpus: float = 0.0, cpus: float = 1.0,
              resources: Mapping[str, float] | None = None, name: str = ACTOR_NAME,
              echo: Callable[[str], None] = log.info) -> "RemoteTrainer":
        """The actor placed where Ray finds `gpus` GPUs, `cpus` CPUs and `resources`, the model
        folders (and a resumed run's trainer state) sent to it, and its Trainer built there as
        Trainer(model, cfg, ref_model=ref_model) would be here."""
        import ray

        if gpus > 1:
            raise click.ClickException("--trainer-gpus: one trainer process uses one GPU; more than 1 is not "
                                       "supported yet (torchrun workers under Ray)")
        actor: Any = ray.remote(TrainerHost).options(
            name=name, num_gpus=gpus, num_cpus=cpus, resources=dict(resources or {}), max_restarts=0,
            max_concurrency=2).remote()
        try:
            trainer = cls(actor, _get(actor.where.remote()))
            sources: dict[str, ModelSource] = {}
            main = trainer._source(model, sources)
            ref = trainer._source(ref_model, sources) if ref_model is not None else None
            state = trainer._send(Path(trainer_state), "state") if trainer_state else None
            _get(actor.start.remote(main, ref, cfg, state))
        except BaseException:
            ray.kill(actor)
            raise
        sent = sum(t.bytes for t in trainer.transfers.values())
        echo(f"trainer: Ray actor {name} on node {trainer.where['node_id'][:8]} ({trainer.where['address']}), "
             f"GPUs {','.join(trainer.where['gpus']) or 'none'}; {sent / 1e6:.1f} MB sent to it")
        return trainer

    def _source(self, folder: str | os.PathLike, sent: dict[str, ModelSource]) -> ModelSource:
        """The default model: made there; another folder: sent once (the reference is most often
        the initial model)."""
        from ..models import default_model_dir

        path = Path(folder).resolve()
        if path == default_model_dir().resolve():
            return ModelSource(None)
        if str(path) not in sent:
            sent[str(path)] = ModelSource(self._send(path, "model"))
        return sent[str(path)]

    # -- driver -> actor ------------------------------------------------------------------
    def _send(self, path: Path, kind: str) -> str:
        """A folder or file of this machine into the actor's folder; its name there."""
        self._sent += 1
        name = f"{kind}{self._sent}"
        entries = manifest(path)
        root = path if path.is_dir() else path.parent
        t0 = time.perf_counter()
        _get(self.actor.receive_begin.remote(name, entries))
        pending: deque = deque()
        for rel, offset, n in _chunks(entries):
            if len(pending) >= IN_FLIGHT:
                _get(pending.popleft())
            pending.append(self.actor.receive_chunk.remote(name, rel, offset, _read(_inside(root, rel), offset, n)))
        while pending:
            _get(pending.popleft())
        _get(self.actor.receive_end.remote(name, entries))
        self.transfers[f"send {kind}"] = Transfer(sum(e["size"] for e in entries), len(entries),
                                                  time.perf_counter() - t0)
        return name

    # -- actor -> driver ------------------------------------------------------------------
    def _fetch(self, token: str, entries: list[FileEntry], place: Callable[[str], Path], kind: str) -> None:
        """The actor's outgoing folder `token`, each of its files written here at place(its path)."""
        t0 = time.perf_counter()
        try:
            for e in entries:
                path = place(e["path"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)
                path.touch(0o600)
            pending: deque = deque()
            for rel, offset, n in _chunks(entries):
                if len(pending) >= IN_FLIGHT:
                    rel0, offset0, ref = pending.popleft()
                    _pwrite(place(rel0), offset0, _get(ref))
                pending.append((rel, offset, self.actor.read_chunk.remote(token, rel, offset, n)))
            while pending:
                rel0, offset0, ref = pending.popleft()
                _pwrite(place(rel0), offset0, _get(ref))
            for e in entries:
                if (size := place(e["path"]).stat().st_size) != e["size"]:
                    raise OSError(f"{place(e['path'])}: {size} bytes of {e['size']} came back")
        finally:
            self.actor.release.remote(token)
        self.transfers[kind] = Transfer(sum(e["size"] for e in entries), len(entries), time.perf_counter() - t0)

    # -- the Trainer's interface ----------------------------------------------------------
    def train_on(self, calls: Sequence[Call], out_dir: str | os.PathLike, progress: Progress | None = None,
                 session_rewards: Mapping[str, SessionReward] | None = None) -> TrainResult:
        """Trainer.train_on in the actor; metrics.jsonl and metrics.png land in out_dir here, and
        progress is called for each step as the actor reports it (polled while it trains)."""
        import ray

        ref = self.actor.train_on.remote(list(calls), dict(session_rewards) if session_rewards else None)
        seen = 0
        while True:
            done, _ = ray.wait([ref], timeout=0.5)
            if progress is not None:
                for total, m in _get(self.actor.progress.remote(seen)):
                    seen += 1
                    progress(m.step, total, m)
            if done:
                break
        result, files = _get(ref)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (out / name).write_bytes(data)
        return replace(result, metrics_path=out / "metrics.jsonl")

    def save(self, target: Path) -> None:
        """The checkpoint folder, saved in the actor, written here at target (whole or not at all,
        as Trainer.save: into target.tmp, then renamed)."""
        target = Path(target)
        token, entries = _get(self.actor.save.remote())
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            self._fetch(token, entries, lambda rel: _inside(tmp, rel), "save")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)

    def save_state(self, path: Path) -> None:
        """AdamW's moments and the schedule's clock, written here at path (through path.tmp, as
        Trainer.save_state: the loop's prune removes a leftover one)."""
        path = Path(path)
        token, entries = _get(self.actor.save_state.remote())
        if [e["path"] for e in entries] != ["state.pt"]:
            raise OSError(f"the trainer's state came as {[e['path'] for e in entries]}")
        tmp = Path(str(path) + ".tmp")
        try:
            self._fetch(token, entries, lambda rel: tmp, "save_state")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)

    def load_state(self, path: Path) -> None:
        """This machine's trainer state file, sent to the actor and loaded there."""
        _get(self.actor.load_state.remote(self._send(Path(path), "state")))

    def publish(self, server: Any = None) -> "Published":
        """The weights served by the actor's own WeightServer on its node (server, the driver's,
        is not used: the weights are not here)."""
        return _get(self.actor.publish.remote())

    @property
    def step(self) -> int:
        return _get(self.actor.step.remote())

    def close(self) -> None:
        import ray

        try:
            _get(self.actor.close.remote(), timeout=30)
        except Exception as e:   # noqa: BLE001  (gone already: nothing left to close)
            log.debug("trainer actor close: %s", e)
        ray.kill(self.actor)

    def __enter__(self) -> "RemoteTrainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _get(ref: Any, timeout: float | None = None) -> Any:
    """ray.get, with the trainer's own errors (TrainError: no signal, a bad call) raised as
    themselves, as a Trainer here raises them."""
    import ray

    from ..grpo.train import TrainError

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, TrainError):
            raise e.cause from None
        raise


__all__ = ["ACTOR_NAME", "FileEntry", "ModelSource", "RemoteTrainer", "TrainerHost", "Transfer", "Where",
           "manifest"]
