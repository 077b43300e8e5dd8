"""What `polar-train loop` is asked to do: its options and their defaults, in one place (the
command line reads its defaults from here, without importing the loop itself)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..stack.vllm import VLLMSettings


@dataclass
class LoopOptions:
    tasks_file: str
    iterations: int
    out: Path
    harness: str | None = None
    samples: int | None = None
    model: str | None = None              # the initial policy (default: the embedded SmolLM2)
    backend: str | None = None            # a running vLLM (dev mode); default: start one
    eval_tasks_file: str | None = None
    eval_every: int = 1                   # held-out tasks at the first iteration, every K-th, and the last
    workers: int = 4
    max_tokens: int = 512
    keep: int = 2                         # checkpoints kept (~517 MB each for the default model)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)   # how the loop starts vLLM (unless --backend)
    max_staleness: int = 0                # K: tokens of versions >= v - K are trained (K >= 1: async)
    server: str | None = None             # a running rollout server (its nodes, their vLLMs)
    colocate: bool = False                # one GPU: vLLM sleeps while the trainer runs
    # how each sync swaps vLLM's weights: inflight (paused where the calls are, each token keeps
    # its version), drain (hold, drain, reload), auto (inflight where vLLM has the token route)
    sync_mode: str = "auto"
    # where a sync's weights come from: disk (vLLM reads the checkpoint folder) or memory (the
    # trainer serves them over HTTP and vLLM pulls them; the folder is written meanwhile, for resume)
    weights_from: str = "disk"
    report_to: tuple[str, ...] = ()       # experiment trackers (trackers.TRACKERS)
    session_limits: dict = field(default_factory=dict)   # the node's limits per session (limits.parse_limits)
    # on a Ray cluster (auto, local or an address): gateway nodes on the Ray nodes that offer
    # polar_node (at most `nodes`), `replicas` vLLM actors (or --backend URL[,URL...]), the
    # trainer and the rollout server here; weights always from memory (no shared disk)
    ray: str | None = None
    nodes: int | None = None
    replicas: int = 1
    replica_gpus: float = 0.0
    replica_dp: int = 1                   # vLLM's own data parallelism per replica (sessions pinned to a rank)
    # the trainer as a Ray actor with these GPUs, where Ray finds them (0: in the driver's process)
    trainer_gpus: float = 0.0
    trainer_actor: bool = False           # the trainer as a Ray actor even without GPUs (CPU clusters, tests)

    def evaluates(self, it: int) -> bool:
        """Whether iteration `it` (from 0) runs the held-out tasks: the first and the last always,
        so a run's rise from its start to its end is measured."""
        return it % max(self.eval_every, 1) == 0 or it == self.iterations - 1
