"""How busy the model backend is: the gateway node's separate pools with a READY buffer, against
a naive loop where each worker sets up, runs and evaluates one session after another.

Both arms run in this one process, side by side, on the same sessions: the same fake backend
(RUN-slot-many sequences at once), the same fake harness (a few model calls in a row), and the
same set-up and evaluation times, drawn from a long-tailed mix (most set-ups are quick, some
clone a big repo; most evaluations are quick, some run a slow test suite). The pooled arm is
the real RolloutServer and GatewayNode, with a runtime whose set-up and evaluation sleep.

Busy fraction = time-average of (sequences in flight / backend slots), from the first call to
the last. NVIDIA Polar's anchor: 20.4% naive -> 87.7% with its buffer. Target: >= 85%.

    .venv/bin/python scripts/bench_utilization.py [--sessions 240] [--slots 8] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polar_mitm.rollout import GatewayNode, NodeConfig, RolloutServer  # noqa: E402
from polar_mitm.rollout.harnesses import Launch  # noqa: E402
from polar_mitm.rollout.runtime import RunResult  # noqa: E402


@dataclass(frozen=True)
class Draw:
    setup_s: float
    calls: int
    eval_s: float


def draws(n: int, scale: float, seed: int = 7) -> dict[int, Draw]:
    rng = random.Random(seed)

    def mix(p_slow: float, fast: float, slow: float) -> float:
        median = slow if rng.random() < p_slow else fast
        return median * rng.lognormvariate(0.0, 0.5) * scale

    return {i: Draw(setup_s=mix(0.2, 0.3, 2.0), calls=rng.randint(4, 10), eval_s=mix(0.15, 0.3, 2.0))
            for i in range(n)}


class FakeBackend:
    """Serves `slots` sequences at once; each call takes call_s. Integrates busy time."""

    def __init__(self, slots: int, call_s: float):
        self.slots, self.call_s = slots, call_s
        self._sem = threading.Semaphore(slots)
        self._lock = threading.Lock()
        self.inflight, self.busy, self.first, self.last, self._t = 0, 0.0, None, None, None

    def _tick(self, delta: int) -> None:
        with self._lock:
            now = time.monotonic()
            if self._t is not None:
                self.busy += min(self.inflight, self.slots) / self.slots * (now - self._t)
            self._t, self.inflight = now, self.inflight + delta
            self.first = self.first if self.first is not None else now
            self.last = now

    def call(self) -> None:
        with self._sem:
            self._tick(+1)
            time.sleep(self.call_s)
            self._tick(-1)

    def fraction(self) -> float:
        return self.busy / (self.last - self.first)


def fake_harness(backend: FakeBackend, d: Draw) -> None:
    for _ in range(d.calls):
        backend.call()


class FakeSandbox:
    def __init__(self, backend: FakeBackend, d: Draw):
        self.backend, self.d = backend, d
        self.workdir = self.home = Path("/nonexistent")

    def run(self, argv, env, timeout, log_name, proxy_port=None) -> RunResult:
        t0 = time.monotonic()
        if log_name == "harness":
            fake_harness(self.backend, self.d)
            return RunResult(0, False, False, time.monotonic() - t0, "")
        time.sleep(self.d.eval_s)
        return RunResult(0, False, False, time.monotonic() - t0, "1.0\n")

    def cancel(self) -> None:
        pass

    def teardown(self) -> None:
        pass


class FakeRuntime:
    def __init__(self, backend: FakeBackend, plan: dict[int, Draw]):
        self.backend, self.plan = backend, plan

    def prepare(self, session_id, workspace) -> FakeSandbox:
        d = self.plan[int(session_id.rsplit("~", 1)[1].split(".")[0])]
        time.sleep(d.setup_s)
        return FakeSandbox(self.backend, d)


def pooled(plan: dict[int, Draw], slots: int, call_s: float, init_workers: int, post_workers: int) -> tuple[float, float]:
    backend = FakeBackend(slots, call_s)
    with tempfile.TemporaryDirectory() as tmp:
        server = RolloutServer(str(Path(tmp) / "bench.duckdb"), flush_s=0.5).start()
        node = GatewayNode(NodeConfig(server_url=server.url, proxy_port=1, ca_path="", init_workers=init_workers,
                                      run_workers=slots, post_workers=post_workers, heartbeat_s=0.05),
                           runtime=FakeRuntime(backend, plan),
                           launcher=lambda name, ctx: Launch(["fake-harness"], {})).start()
        t0 = time.monotonic()
        server.submit({"task_id": "bench", "instruction": "x", "harness": "command", "command": "fake",
                       "num_samples": len(plan), "evaluator": "fake", "timeout": 3600})
        ok = server.wait(["bench"], timeout=3600)
        wall = time.monotonic() - t0
        done = server.status()["sessions"].get("done", 0)
        node.stop()
        server.stop()
    assert ok and done == len(plan), f"pooled arm finished {done} of {len(plan)}"
    return backend.fraction(), wall


def naive(plan: dict[int, Draw], slots: int, call_s: float) -> tuple[float, float]:
    backend = FakeBackend(slots, call_s)
    todo = list(plan.values())
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                d = todo.pop(0)
            time.sleep(d.setup_s)
            fake_harness(backend, d)
            time.sleep(d.eval_s)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(slots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return backend.fraction(), time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=240)
    ap.add_argument("--slots", type=int, default=8, help="backend sequences at once = RUN slots")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every duration")
    ap.add_argument("--init-workers", type=int, default=0, help="default 3 x slots")
    ap.add_argument("--post-workers", type=int, default=0, help="default 2 x slots")
    args = ap.parse_args()
    plan = draws(args.sessions, args.scale)
    call_s = 0.08 * args.scale
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    run_mean = mean([d.calls for d in plan.values()]) * call_s
    setups, evals = sorted(d.setup_s for d in plan.values()), sorted(d.eval_s for d in plan.values())
    p99 = lambda xs: xs[int(0.99 * (len(xs) - 1))]  # noqa: E731
    print(f"{args.sessions} sessions, {args.slots} backend slots; per session: set-up mean {mean(setups):.2f}s "
          f"p99 {p99(setups):.2f}s, run mean {run_mean:.2f}s, evaluation mean {mean(evals):.2f}s p99 {p99(evals):.2f}s")
    init_w, post_w = args.init_workers or 3 * args.slots, args.post_workers or 2 * args.slots
    n_frac, n_wall = naive(plan, args.slots, call_s)
    print(f"naive one-pool loop ({args.slots} workers):              busy {n_frac:6.1%}  wall {n_wall:6.1f}s")
    p_frac, p_wall = pooled(plan, args.slots, call_s, init_w, post_w)
    print(f"pools + READY buffer (INIT {init_w}, RUN {args.slots}, POST {post_w}): busy {p_frac:6.1%}  wall {p_wall:6.1f}s")
    print(f"ratio {p_frac / n_frac:.2f}x busier, {n_wall / p_wall:.2f}x faster; "
          f"Polar's anchor 20.4% -> 87.7%; target >= 85%: {'PASS' if p_frac >= 0.85 else 'FAIL'}")
    return 0 if p_frac >= 0.85 else 1


if __name__ == "__main__":
    sys.exit(main())
