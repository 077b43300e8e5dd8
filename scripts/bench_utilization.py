"""How busy the model backend is: the gateway node's separate pools with a READY buffer, against
a naive loop where each worker sets up, runs and evaluates one session after another.

Both arms run in this one process, side by side, on the same sessions: the same simulated vLLM
(RUN-slot-many sequences at once), the same fake harness (a few model calls in a row), and the
same set-up and evaluation times, drawn from a long-tailed mix (most set-ups are quick, some
clone a big repo; most evaluations are quick, some run a slow test suite). The pooled arm is
the real RolloutServer and GatewayNode, with a runtime whose set-up and evaluation sleep.

Slots busy = time-average of (sequences in flight / backend slots), from the first call to
the last. NVIDIA Polar's anchor: 20.4% naive -> 87.7% with its buffer. Target: >= 85%.

Next to them, real CLIs (default pi and gemini) through the whole stack of `polar-mitm rollout`:
the scripted stand-in for vLLM (tests/support/fake_vllm.py, scripted: the CLI's own shell tool, then an
answer; each completion takes --cli-call-s, a generation), the proxy, a rollout server and a
gateway node with --cli-workers RUN slots, each CLI's task --cli-sessions times. Its figures
are the ones `rollout` prints: backend busy = the union of the intervals in which at least one
call was at the backend (from the recorded calls in DuckDB) over the wall time, and sessions
finished per minute. The fake arms report the same two next to their slot measure.

    .venv/bin/python scripts/bench_utilization.py [--sessions 240] [--slots 8] [--scale 1.0] \
        [--clis pi,gemini] [--cli-sessions 8] [--cli-workers 2] [--cli-call-s 0.5]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))      # the scripted stand-in for vLLM

from polar_mitm import session_ids  # noqa: E402

from polar_mitm.stack import launch
from polar_mitm.rollout import GatewayNode, NodeConfig, RolloutServer, harnesses  # noqa: E402
from polar_mitm.rollout.harnesses import Launch  # noqa: E402
from polar_mitm.rollout.runtime import RunResult  # noqa: E402
from polar_mitm.cli.rollout import RunFigures  # noqa: E402
from polar_mitm.stack.local import Stack  # noqa: E402
from support.fake_vllm import MARKER, FakeVLLM  # noqa: E402


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


class SimulatedVLLM:
    """vLLM's batch as the two arms see it, simulated in this process (no server; the HTTP
    stand-in is tests/support/fake_vllm.py): it serves `slots` sequences at once, each call
    takes call_s. Integrates busy time."""

    def __init__(self, slots: int, call_s: float):
        self.slots, self.call_s = slots, call_s
        self._sem = threading.Semaphore(slots)
        self._lock = threading.Lock()
        self.inflight, self.busy, self.first, self.last, self._t = 0, 0.0, None, None, None
        self.any_busy = 0.0     # time with at least one call in flight (what `rollout` reports)

    def _tick(self, delta: int) -> None:
        with self._lock:
            now = time.monotonic()
            if self._t is not None:
                self.busy += min(self.inflight, self.slots) / self.slots * (now - self._t)
                self.any_busy += (now - self._t) if self.inflight else 0.0
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

    def any_fraction(self, wall: float) -> float:
        return self.any_busy / wall

    def at_once(self) -> float:
        """Calls in flight on average while at least one was."""
        return self.busy * self.slots / self.any_busy if self.any_busy else 0.0


def fake_harness(backend: SimulatedVLLM, d: Draw) -> None:
    for _ in range(d.calls):
        backend.call()


class FakeSandbox:
    def __init__(self, backend: SimulatedVLLM, d: Draw):
        self.backend, self.d = backend, d
        self.workdir = self.home = self.tmp = Path("/nonexistent")

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

    # the evaluator's fresh sandbox: itself (its evaluation is a sleep of the draw's eval_s)
    output: str | None = None

    def evaluation_box(self, reads=()) -> "FakeSandbox":
        return self

    def output_of(self, log_name: str, limit: int) -> bytes:
        return b""


class FakeRuntime:
    def __init__(self, backend: SimulatedVLLM, plan: dict[int, Draw]):
        self.backend, self.plan = backend, plan

    def prepare(self, session_id, workspace, **_) -> FakeSandbox:
        d = self.plan[session_ids.parse(session_id).sample]
        time.sleep(d.setup_s)
        return FakeSandbox(self.backend, d)


def pooled(plan: dict[int, Draw], slots: int, call_s: float, init_workers: int,
           post_workers: int) -> tuple[SimulatedVLLM, float]:
    backend = SimulatedVLLM(slots, call_s)
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
    return backend, wall


def naive(plan: dict[int, Draw], slots: int, call_s: float) -> tuple[SimulatedVLLM, float]:
    backend = SimulatedVLLM(slots, call_s)
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
    return backend, time.monotonic() - t0


@dataclass
class CliArm:
    name: str
    sessions: int
    done: int
    reward_mean: float
    wall_s: float
    per_minute: float | None
    busy: float | None
    calls: float
    at_once: float


def real_cli(name: str, sessions: int, workers: int, call_s: float, timeout: int = 300) -> CliArm:
    """One task of `sessions` samples of a real CLI, run as `polar-mitm rollout --backend`
    runs it (proxy, rollout server, gateway node), over the scripted backend; the figures
    are RunFigures', the code behind rollout's progress line and summary."""
    harnesses.executable(name)      # installed (polar-mitm harness install NAME), or say so
    task = f"bench-{name}"
    with FakeVLLM("scripted") as backend, tempfile.TemporaryDirectory() as tmp:
        backend.delay = call_s
        db = str(Path(tmp) / "bench.duckdb")
        with Stack() as stack:
            server = stack.start_server(db)
            stack.start_node(db=db, backend=backend.url, work=Path(tmp), proxy_port=launch.free_port(),
                             workers=workers, max_tokens=None, server_url=server.url)
            server.submit({"task_id": task, "harness": name, "num_samples": sessions, "timeout": timeout,
                           "instruction": "Run the shell command 'echo hi' and tell me what it printed.",
                           "evaluator": f"grep -q {MARKER} polar_proof.txt"})
            run = RunFigures(server, db, [task], db_every=1e9)
            server.wait([task], timeout=timeout * sessions)
            run.stop_clock()
            run.refresh(read_db=True)
    sess = run.groups[task]["sessions"]
    rewards = [s["reward"] or 0.0 for s in sess]
    per, busy = run.per_session(), run.busy
    return CliArm(name, sessions, sum(s["state"] == "done" for s in sess), sum(rewards) / len(rewards),
                  run.elapsed(), run.rate(), busy["share"] if busy else None, per["calls"] if per else 0.0,
                  busy["call_s"] / busy["busy_s"] if busy and busy["busy_s"] else 0.0)


def init_times(n: int) -> list[tuple[str, list[float], list[float]]]:
    """INIT per session (LocalRuntime.prepare: the bwrap sandbox's directories, the workspace,
    and with an image its layer and prepare action), n sessions each, side by side:
    today's workspace copy; the test image cold (a fresh cache: each session unpacks it, one
    after the other); the same image cached. (arm, INIT seconds, unpack seconds)."""
    from polar_mitm.rollout import images
    from polar_mitm.rollout.runtime import LocalRuntime
    from polar_mitm.rollout.spec import parse_task

    images.test_image()
    repo = ROOT / "examples" / "bugfix" / "repos" / "stats"
    prepare = ["git init -q && git add -A && git -c user.name=p -c user.email=p@localhost commit -qm task"]
    plain = parse_task({"task_id": "w", "instruction": "x", "workspace": str(repo)})
    imaged = parse_task({"task_id": "i", "instruction": "x", "workspace": str(repo),
                         "runtime": {"image": "polar-test:bookworm", "workdir": "/workspace", "prepare": prepare}})
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-init-") as d:
        rt = LocalRuntime(Path(d) / "sessions", sandbox="bwrap")
        for arm, task, cold in (("workspace copy (no image)", plain, False), ("image, cold cache", imaged, True),
                                ("image, cached", imaged, False)):
            took, unpack = [], []
            for i in range(n):
                if cold:   # a cache of its own: the image is pulled and unpacked again
                    rt.images = images.ImageCache(Path(d) / f"cache-{i}")
                t0 = time.monotonic()
                box = rt.prepare(f"{task.task_id}~{i}", task.workspace, task.runtime)
                took.append(time.monotonic() - t0)
                unpack.append(box.setup_s)
                box.teardown()
            out.append((arm, took, unpack))
            if cold:
                rt.images = images.ImageCache(Path(d) / f"cache-{n - 1}")   # cached from here on
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=240)
    ap.add_argument("--slots", type=int, default=8, help="backend sequences at once = RUN slots")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every duration")
    ap.add_argument("--init-workers", type=int, default=0, help="default 3 x slots")
    ap.add_argument("--post-workers", type=int, default=0, help="default 2 x slots")
    ap.add_argument("--clis", default="pi,gemini", help="real CLIs to run next to the fake harness ('' for none)")
    ap.add_argument("--cli-sessions", type=int, default=8, help="samples of each CLI's task")
    ap.add_argument("--cli-workers", type=int, default=2, help="the gateway node's RUN slots (and INIT workers)")
    ap.add_argument("--cli-call-s", type=float, default=0.5, help="seconds each scripted completion takes")
    ap.add_argument("--init-sessions", type=int, default=5, help="sessions per INIT arm (0: none)")
    args = ap.parse_args()
    if args.init_sessions:
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        print(f"INIT per session ({args.init_sessions} each, the bug-fix stats repository, bwrap; the image "
              "arms also run the task's prepare action, a git init and commit in the sandbox):")
        print(f"{'arm':28} {'median':>8} {'min':>8} {'max':>8} {'unpack median':>14}")
        for arm, took, unpack in init_times(args.init_sessions):
            print(f"{arm:28} {med(took):7.3f}s {min(took):7.3f}s {max(took):7.3f}s {med(unpack):13.3f}s")
        print()
    plan = draws(args.sessions, args.scale)
    call_s = 0.08 * args.scale
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    run_mean = mean([d.calls for d in plan.values()]) * call_s
    setups, evals = sorted(d.setup_s for d in plan.values()), sorted(d.eval_s for d in plan.values())
    p99 = lambda xs: xs[int(0.99 * (len(xs) - 1))]  # noqa: E731
    print(f"{args.sessions} sessions, {args.slots} backend slots; per session: set-up mean {mean(setups):.2f}s "
          f"p99 {p99(setups):.2f}s, run mean {run_mean:.2f}s, evaluation mean {mean(evals):.2f}s p99 {p99(evals):.2f}s")
    init_w, post_w = args.init_workers or 3 * args.slots, args.post_workers or 2 * args.slots
    n_backend, n_wall = naive(plan, args.slots, call_s)
    p_backend, p_wall = pooled(plan, args.slots, call_s, init_w, post_w)
    n_frac, p_frac = n_backend.fraction(), p_backend.fraction()
    calls = mean([d.calls for d in plan.values()])
    rows = [(f"naive one-pool loop ({args.slots} workers)", "fake", args.sessions, args.sessions, n_wall,
             args.sessions / n_wall * 60, n_backend.any_fraction(n_wall), n_backend.at_once(),
             f"slots busy {n_frac:.1%}, {calls:.1f} calls/session"),
            (f"pools + READY buffer (INIT {init_w}, RUN {args.slots}, POST {post_w})", "fake", args.sessions,
             args.sessions, p_wall, args.sessions / p_wall * 60, p_backend.any_fraction(p_wall), p_backend.at_once(),
             f"slots busy {p_frac:.1%}, {calls:.1f} calls/session")]
    failed = []
    for name in filter(None, (c.strip() for c in args.clis.split(","))):
        try:
            a = real_cli(name, args.cli_sessions, args.cli_workers, args.cli_call_s)
        except harnesses.HarnessMissing as e:
            print(f"{name}: skipped: {e}")
            continue
        rows.append((f"rollout node, scripted vLLM {args.cli_call_s:g} s/call (RUN {args.cli_workers})", name,
                     a.sessions, a.done, a.wall_s, a.per_minute or 0.0, a.busy or 0.0, a.at_once,
                     f"reward mean {a.reward_mean:.2f}, {a.calls:.1f} calls/session"))
        if a.done < a.sessions:
            failed.append(f"{name}: {a.done} of {a.sessions} sessions done")
    print(f"\n{'arm':58} {'harness':7} {'done':>7} {'wall':>7} {'sess/min':>8} {'backend busy':>12} "
          f"{'at once':>7}  notes")
    for arm, harness, n, done, wall, per_min, busy, at_once, note in rows:
        print(f"{arm:58} {harness:7} {f'{done}/{n}':>7} {wall:6.1f}s {per_min:8.1f} {busy:12.1%} {at_once:7.1f}  {note}")
    print("backend busy: the share of the wall time with at least one call at the backend (what `polar-mitm "
          "rollout` prints); at once: calls in flight on average while busy; slots busy: sequences in flight / "
          "slots (the fake backend's)")
    print(f"fake arms: ratio {p_frac / n_frac:.2f}x busier (slots), {n_wall / p_wall:.2f}x faster; "
          f"Polar's anchor 20.4% -> 87.7%; target >= 85%: {'PASS' if p_frac >= 0.85 else 'FAIL'}")
    for f in failed:
        print(f"real CLI arm incomplete: {f}")
    return 0 if p_frac >= 0.85 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
