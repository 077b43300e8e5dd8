"""Peak memory of one training step against --token-budget, on a long shared prefix.

    .venv/bin/python scripts/bench_memory.py [--threads 1]

A GRPO group of 4 sessions (3 turns each, a drift and a side call) under one shared
prompt of 15,000 tokens on a random Llama 8 layers x 256 (the shape of issue 21's
measurement), and of 60,000 tokens on a Llama 2 x 64 (so that it runs in minutes on a
CPU); one fwd+bwd step through the trainer's own step code (polar_sdpa attention, as
polar-train uses on CPU) at budgets 16384, 4096 and 1024, plus the 60k prompt at budget 50
(a prefix over 1,000 rows deep). Each configuration runs in a fresh subprocess; its peak
is the process's peak resident memory during the step (VmHWM, reset just before it) minus its resident memory once the
model, its gradients' buffers and the calls exist, i.e. what the step itself added.
Target: at each prefix, the peak does not grow as the budget shrinks and stays at or
under the 16384 figure."""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the tests' step inputs

CONFIGS = [  # prefix tokens, (layers, hidden), budgets
    (15000, (8, 256), (16384, 4096, 1024)),
    (60000, (2, 64), (16384, 4096, 1024, 50)),
]
VOCAB = 2048


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak() -> bool:
    """Linux forgets the process's peak resident memory (VmHWM) so far: a peak reached
    while importing or building the model (higher than the step's on some runs) does not
    mask the step's own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """The peak resident memory since reset_peak (else since the start: ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one(prefix: int, layers: int, hidden: int, budget: int, threads: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from polar_mitm.grpo.attention import register
    from polar_mitm.grpo.policy import TokenLogprobs
    from polar_mitm.grpo.synthetic import Shape, group
    from polar_mitm.grpo.config import TrainConfig
    from polar_mitm.grpo.step import prepare_step, run_step
    from support.grpo_step import step_inputs

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2,
                      max_position_embeddings=prefix + 8192, attn_implementation=register())
    lm = LlamaForCausalLM(cfg)
    for p in lm.parameters():   # the gradients' memory is the model's, not the step's
        p.grad = torch.zeros_like(p)
    shape = Shape(sessions=4, turns=3, shared=prefix, tool=(100, 300), response=(50, 150), vocab=VOCAB)
    calls = group("task", shape, random.Random(0), reward=lambda s: float(s % 2))
    train_cfg = TrainConfig(token_budget=budget)
    offsets, inputs = step_inputs(calls, torch.float32)
    step = prepare_step(calls, list(range(len(calls))), ["task"], offsets, train_cfg, torch.device("cpu"), 0, 1,
                        lm.config._attn_implementation, lm.dtype)
    base = rss_bytes()
    reset_peak()
    t0 = time.perf_counter()
    run = run_step(TokenLogprobs(lm), step, inputs, train_cfg.loss, lambda: torch.autocast("cpu", enabled=False))
    seconds = time.perf_counter() - t0
    peak = peak_bytes()
    runner = step.layout().runner
    depth = 0
    for r in runner.rows:   # rows on the longest chain of rows
        d, p = 1, r.parent_row
        while p >= 0:
            d, p = d + 1, runner.rows[p].parent_row
        depth = max(depth, d)
    return {"peak": peak - base, "seconds": seconds, "rows": len(runner.rows), "row_depth": depth,
            "forward_tokens": run.stats.forward_tokens, "loss": run.sums["loss"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: timings that do not depend on load)")
    ap.add_argument("--one", nargs=4, type=int, metavar=("PREFIX", "LAYERS", "HIDDEN", "BUDGET"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, threads=args.threads)))
        return 0

    ok = True
    print(f"peak memory of one fwd+bwd step over the model (VmHWM during the step - rss before it), {args.threads} threads")
    print(f"{'prefix':>7} {'model':>7} {'budget':>7} {'rows':>6} {'row depth':>10} {'fwd tokens':>11} "
          f"{'peak MB':>9} {'seconds':>8}")
    for prefix, (layers, hidden), budgets in CONFIGS:
        peaks = []
        for budget in budgets:
            cmd = [sys.executable, __file__, "--threads", str(args.threads), "--one", str(prefix), str(layers),
                   str(hidden), str(budget)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{prefix:>7} {layers}x{hidden:<5} {budget:>7}  FAILED\n{r.stderr[-2000:]}")
                ok = False
                continue
            m = json.loads(r.stdout.strip().splitlines()[-1])
            peaks.append(m["peak"])
            print(f"{prefix:>7} {f'{layers}x{hidden}':>7} {budget:>7} {m['rows']:>6} {m['row_depth']:>10} "
                  f"{m['forward_tokens']:>11,} {m['peak'] / 2**20:>9,.0f} {m['seconds']:>8.1f}", flush=True)
        if len(peaks) == len(budgets):
            steady = all(b <= a for a, b in zip(peaks, peaks[1:])) and all(p <= peaks[0] for p in peaks)
            ok &= steady
            print(f"{'PASS' if steady else 'FAIL'}  {prefix} prefix: peak non-increasing as the budget shrinks and "
                  f"<= the {budgets[0]} figure ({', '.join(f'{p / 2**20:,.0f}' for p in peaks)} MB)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
