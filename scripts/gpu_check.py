"""The trainer on a CUDA GPU, for a bare machine with torch and transformers only (no vLLM,
no DuckDB, no network): run by scripts/gpu_check.sh.

1. Exactness: one training step on the test groups (a tiny random Llama, synthetic harness
   calls) on the CPU in float32 against CUDA with flex attention, in float32 and in bf16
   autocast: loss, per-token logprobs and gradients, as differences.
2. Speed: one forward+backward step at a Qwen3-1.7B-shaped random model (28 x 2048, GQA
   16/8, vocabulary 151,936) on a 15k-token shared prefix with 8 samples of 3 calls, for
   each builder (trie, prefix_merging, per_request): forward tokens, tokens/s, model FLOP/s
   (weights, attention pairs and lm_head: polar_mitm.grpo.flops) and its utilization of the
   GPU's dense bf16 peak, and the step's peak GPU memory; then the trie's tokens/s over
   prefix_merging's (bench_trainer's 0.9x target) beside the ratio equal FLOP/s allows.
3. Memory: the step's peak GPU memory (over what the model, its gradients and optimizer
   state hold) at budgets 16384, 4096 and 1024 on a 15k- and a 60k-token shared prefix,
   the trie on the Qwen3-1.7B shape: issue 21's rule, measured on CPU by
   scripts/bench_memory.py, that it does not grow as the budget shrinks.

    python scripts/gpu_check.py            # on the GPU machine
    python scripts/gpu_check.py --smoke    # the same code on CPU at toy sizes (the tests run it)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:   # a bare machine: torch is imported where it is used
    import torch

    from polar_mitm.grpo.results import StepMetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}   # dense, no sparsity


def tiny_model(path: Path, vocab: int = 64) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


_MODELS: dict[Path, tuple] = {}


def qwen3_shaped(path: Path, smoke: bool):
    """Random weights in Qwen3-1.7B's shape (or a toy one), saved once per path; returns
    (dir, non-embedding params, config)."""
    if path in _MODELS:
        return _MODELS[path]
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    shape = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 tie_word_embeddings=True)
    if smoke:
        shape.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = Qwen3Config(**shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        lm = Qwen3ForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n)
    lm.save_pretrained(path)
    del lm
    _MODELS[path] = path, params, config
    return _MODELS[path]


def test_calls(smoke: bool):
    from polar_mitm.grpo.synthetic import Shape, group
    rng = random.Random(0)
    shape = Shape(sessions=4, turns=3, shared=120 if smoke else 600, tool=(5, 20), response=(3, 12), vocab=64)
    return [c for t in range(2) for c in group(f"t{t}", shape, rng, reward=lambda i: float(i % 2))]


class OneStep(NamedTuple):
    """One step at lr 0 (the weights do not move): its metrics and its gradients."""
    attention: str
    metrics: StepMetrics
    grads: torch.Tensor


def one_step(model: str, calls, dtype: str, budget: int) -> OneStep:
    """Loss, logprobs and gradients of one step at lr 0 (the weights do not move)."""
    import torch

    from polar_mitm.grpo.config import TrainConfig
    from polar_mitm.grpo.train import Trainer
    t = Trainer(model, TrainConfig(lr=0.0, token_budget=budget, max_grad_norm=1e30, dtype=dtype))
    with tempfile.TemporaryDirectory(prefix="polar-gpu-check-") as scratch:
        result = t.train_on(calls, scratch)
    grads = torch.cat([p.grad.float().flatten().cpu() for p in t.policy.parameters() if p.grad is not None])
    return OneStep(t.attention, result.history[0], grads)


def exactness(smoke: bool, work: Path) -> None:
    import torch
    model = str(tiny_model(work / "tiny"))
    calls = test_calls(smoke)
    # the CPU reference in its own process: this one may hold the GPU
    ref_path = work / "cpu.pt"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, __file__, "--cpu-reference", model, str(ref_path), *(["--smoke"] if smoke else [])],
                   check=True, env=env)
    ref = torch.load(ref_path)
    if not torch.cuda.is_available():
        print("exactness: no CUDA here; the CPU reference ran (loss %.6f, %d gradient values)"
              % (ref["loss"], ref["grads"].numel()))
        return
    print(f"{'run':24}{'attention':>16}{'|d loss|':>12}{'max |d grad|':>14}{'grad cosine':>13}")
    for dtype in ("fp32", "bf16"):
        got = one_step(model, calls, dtype, budget=256)
        d = got.grads - ref["grads"]
        cos = float(torch.nn.functional.cosine_similarity(got.grads, ref["grads"], dim=0))
        print(f"{'cuda ' + dtype + ' vs cpu fp32':24}{got.attention:>16}{abs(got.metrics.loss - ref['loss']):>12.2e}"
              f"{float(d.abs().max()):>14.2e}{cos:>13.6f}")


def speed(smoke: bool, work: Path) -> None:
    import torch

    from polar_mitm.grpo.config import BUILDERS, TrainConfig
    from polar_mitm.grpo.flops import model_flops, token_cost
    from polar_mitm.grpo.synthetic import Shape, group
    from polar_mitm.grpo.trajectories import build
    model, params, config = qwen3_shaped(work / "qwen3", smoke)
    shape = Shape(sessions=8, turns=3, shared=300 if smoke else 15000, tool=(100, 1000) if not smoke else (5, 20),
                  response=(50, 300) if not smoke else (3, 12), drifts=0, side_calls=0,
                  vocab=512 if smoke else 151936)
    calls = group("task", shape, random.Random(0), reward=lambda i: float(i % 2))
    budget = 512 if smoke else 16384
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    print(f"\n{name}: Qwen3-1.7B-shaped random model ({params / 1e9:.2f}B non-embedding), "
          f"{shape.shared}-token shared prefix, {shape.sessions} samples x {shape.turns} calls, budget {budget}")
    print(f"{'builder':16}{'forward tokens':>15}{'model GFLOP':>15}{'seconds':>9}{'tokens/s':>11}{'TFLOP/s':>9}"
          f"{'MFU':>7}{'peak GB':>9}")
    samples = {b: build(calls, b).samples for b in BUILDERS}
    flops_of = {b: model_flops(config, samples[b]) for b in BUILDERS}
    tokens_of = {b: sum(len(x) for x in samples[b]) for b in BUILDERS}
    got = {}

    for builder in BUILDERS:
        # one builder failing (out of memory, say) still leaves the others' figures
        with part(f"speed of {builder}"):
            m, gb = second_step(model, calls, TrainConfig(lr=0.0, token_budget=budget, builder=builder,
                                                          dtype="bf16", gradient_checkpointing=not smoke))
            flops = flops_of[builder]
            assert m.forward_tokens == tokens_of[builder], "the FLOPs must count the trained samples"
            got[builder] = (m.tokens_per_s, flops / m.seconds)
            mfu = f"{flops / m.seconds / peak:.1%}" if peak else "-"
            print(f"{builder:16}{m.forward_tokens:>15,}{flops / 1e9:>15,.1f}{m.seconds:>9.2f}"
                  f"{m.tokens_per_s:>11,.0f}{flops / m.seconds / 1e12:>9.1f}{mfu:>7}{_gb(gb):>9}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "trie" not in got or "prefix_merging" not in got:
        return
    (tps, fps), (base_tps, base_fps) = got["trie"], got["prefix_merging"]
    cap = 1 / token_cost(flops_of, tokens_of, "trie", "prefix_merging")
    print(f"trie / prefix_merging: tokens/s {tps / base_tps:.2f}x (target 0.90x; {cap:.2f}x at equal FLOP/s), "
          f"model FLOP/s {fps / base_fps:.2f}x")


def second_step(model: Path, calls, cfg) -> tuple[StepMetrics, float | None]:
    """The metrics of the second of two steps (the first compiles flex and warms the
    allocator) and its peak GPU memory over what was allocated before it (the model, its
    gradients and optimizer state), in GB (None off CUDA); the trainer dies with this
    frame, also when a step fails."""
    import torch

    from polar_mitm.grpo.train import Trainer
    t = Trainer(str(model), cfg)
    with tempfile.TemporaryDirectory(prefix="polar-gpu-step-") as scratch:
        t.train_on(calls, scratch)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        m = t.train_on(calls, scratch).history[0]
    return m, (torch.cuda.max_memory_allocated() - before) / 1e9 if cuda else None


def _gb(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "-"


MEMORY = [(15000, (16384, 4096, 1024)), (60000, (16384, 4096, 1024))]   # prefix tokens, budgets


def memory(smoke: bool, work: Path) -> None:
    import torch

    from polar_mitm.grpo.config import TrainConfig
    from polar_mitm.grpo.synthetic import Shape, group
    model, _, _ = qwen3_shaped(work / "qwen3", smoke)
    configs = [(300, (512, 128, 32))] if smoke else MEMORY
    print("\npeak GPU memory of one trie step (GB over the model, gradients and optimizer state; rows "
          "checkpointed as in the speed part), 4 samples x 3 calls under one shared prefix, by token budget")
    for prefix, budgets in configs:
        shape = Shape(sessions=4, turns=3, shared=prefix, tool=(5, 20) if smoke else (100, 1000),
                      response=(3, 12) if smoke else (50, 300), vocab=512 if smoke else 151936)
        calls = group("task", shape, random.Random(0), reward=lambda i: float(i % 2))
        got: dict[int, float | None] = {}
        for budget in budgets:
            with part(f"memory at a {prefix}-token prefix, budget {budget}"):
                _, got[budget] = second_step(model, calls, TrainConfig(lr=0.0, token_budget=budget, dtype="bf16",
                                                                       gradient_checkpointing=not smoke))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(budget_line(prefix, budgets, [got.get(b) for b in budgets]))


def budget_line(prefix: int, budgets, peaks: list[float | None]) -> str:
    """One prefix's peaks by budget (largest budget first), with the verdict only where
    every budget gave a figure (a failed one is listed at the end of the check)."""
    line = f"prefix {prefix:>6}: " + ", ".join(f"budget {b} {_gb(x)}" for b, x in zip(budgets, peaks))
    if any(x is None for x in peaks):
        return line
    holds = all(b <= a for a, b in zip(peaks, peaks[1:]))   # type: ignore[operator]
    return line + f"; non-increasing as the budget shrinks: {'yes' if holds else 'NO'}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes, on whatever device there is")
    ap.add_argument("--cpu-reference", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch
    if args.cpu_reference:
        model, out = args.cpu_reference
        r = one_step(model, test_calls(args.smoke), "fp32", budget=256)
        torch.save({"loss": r.metrics.loss, "grads": r.grads}, out)
        return 0
    print(json.dumps({"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))
    with tempfile.TemporaryDirectory(prefix="polar-gpu-check-") as d:
        t0 = time.monotonic()
        with part("exactness"):
            exactness(args.smoke, Path(d))
        with part("speed"):
            speed(args.smoke, Path(d))
        with part("memory"):
            memory(args.smoke, Path(d))
        print(f"\ngpu_check done in {time.monotonic() - t0:.0f}s" + (f"; failed: {', '.join(FAILED)}" if FAILED else ""))
    return 1 if FAILED else 0


FAILED: list[str] = []


@contextlib.contextmanager
def part(name: str):
    """Runs one part of the check; a failure is printed with its traceback and the check
    goes on: a GPU session is short, and every figure it can still give counts."""
    try:
        yield
    except Exception:
        FAILED.append(name)
        print(f"\n{name} FAILED:\n{traceback.format_exc()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
