"""What polar-mitm adds to a model call, next to plain mitmdump, measured side by side in one run.

    .venv/bin/python scripts/bench_gateway.py [--concurrency 1,8,64] [--sessions 1] [--turns 20]
                                              [--style mix] [--soak 600] [--out FILE.json]
                                              [--workload ordered|out-of-order]
                                              [--polar-set polar_OPTION=VALUE ...] [--compare-routes]
    .venv/bin/python scripts/bench_gateway.py --store-load [10000] --concurrency 64 [--workload both]
                                              [--agents 4-8] [--agent-turns 8]

Three configurations, the same client code and the same bodies:
  direct  clients -> fake provider server (scripts/workload.py, its own process, instant answers)
  plain   clients -> mitmdump without any addon, reverse mode -> the fake provider
  polar   clients -> polar-mitm (launch.start_proxy, its reverse-mode listener) -> the fake,
          asked in vLLM's token-returning format; each call is recorded before it is answered
Both mitmdumps run with the same mitmproxy options; only the addon (and its polar_* options)
differs. The workload: coding-agent sessions of 20 turns, bodies ~43 KB at turn 1 growing to
~200 KB at turn 20, half OpenAI Chat and half Anthropic Messages (--style mix), one session key
per session (polar-NAME). Clients run in this process (asyncio, one keep-alive connection each,
a minimal HTTP/1.1 client so they take little CPU); the backend and each mitmdump run in their
own processes. Added latency is a percentile of a configuration minus the same percentile of
direct at the same concurrency. Measurements run in rounds (--rounds, pooled), each round all
concurrencies and configurations back to back. Before each measurement every server process is
left to go idle, and the CPU a proxy spends after its clients finished (deferred work) is
reported too. Peak RSS is VmHWM of the mitmdump process tree, reset (clear_refs) before each
measurement; the table shows round 1's, the RSS target uses the highest over all rounds.
Windows at the highest concurrency hold at least --top-calls calls (2560), so that polar's
loader loads a whole row group into DuckDB while the clients run: the RSS target counts
only if one did.
--compare-routes measures polar twice instead of plain and polar, a proxy per backend route:
polar_backend_route=chat (one POST /v1/chat/completions) and =generate (render ->
/inference/v1/generate -> derender), in the order A B in odd rounds and B A in even ones, and
prints calls/s, CPU per call and added latency of each, and generate's over chat's; it fails
where generate's CPU per call is above x1.3 chat's or its calls/s at the top concurrency below
x0.9. The stand-in answers either route at about the same CPU per call (workload.WorkloadVLLM).
--soak SECONDS then runs polar alone (--soak-clients, new sessions as old ones finish) and
prints calls/s, latency, RSS and store size per minute; --concurrency '' runs only the soak.

--workload out-of-order (default ordered, the sessions above) gives each session key 4-8
(--agents) independent sub-agent conversations of --agent-turns turns (6: bodies 43 -> ~85 KB),
each with its own system prompt and content, listed together so that clients starting together
run them at once: a key's turns arrive interleaved, the proxy's log thread rarely finds a
call's own previous turn among the last calls of its session to delta against, and its call
log lines are ~100-150 KB instead of ~30 (below --agents' MIN clients nothing interleaves).
--store-load CALLS replaces the comparison: polar alone at the highest --concurrency, for at
least CALLS calls per workload (both: ordered, then out-of-order), each through a fresh proxy
on a fresh database in the work dir. One table, a column per workload: calls/s, CPU per call of
the loader (polar-loader), the log thread (polar-log) and the event loop, peak RSS (and above
the idle proxy's), the mean call log line (bytes appended to <db>.log/*.jsonl, each segment's
size read from a descriptor held open since it appeared, so segments the loader deleted count),
the log's size on disk, loads and failed loads (/_polar/health), the time of a read while the
proxy runs (it loads what is pending first) and of one after it stopped, the database's size.
It exits non-zero if a call or a load failed, or an answered call is missing or duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402

from polar_mitm.stack import launch  # noqa: E402
from polar_mitm.store import calllog, log_dir, query  # noqa: E402

CONFIGS = ("direct", "plain", "polar")
# --compare-routes: polar twice, one proxy per polar_backend_route, in place of plain and polar
ROUTES = ("chat", "generate")
HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# ---- /proc -------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (via /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_mb(pid: int) -> float:
    return sum(_status_kb(p, "VmHWM") for p in process_tree(pid)) / 1024


def rss_mb(pid: int) -> float:
    return sum(_status_kb(p, "VmRSS") for p in process_tree(pid)) / 1024


def reset_peak(pid: int) -> bool:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
    ok = True
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            ok = False
    return ok


def _stat_cpu_s(path: str) -> float:
    """utime + stime of a /proc/.../stat file (a process: all its threads), in seconds;
    0 if it is gone."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_s(pids: list[int]) -> float:
    return sum(_stat_cpu_s(f"/proc/{p}/stat") for root in pids for p in process_tree(root))


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process tree by thread name (comm): polar names its log and loader
    threads; the event loop's thread is named after the process (mitmdump)."""
    out: dict[str, float] = {}
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            out[name] = out.get(name, 0.0) + _stat_cpu_s(f"/proc/{p}/task/{tid}/stat")
    return out


def machine_ticks() -> tuple[int, int]:
    """(idle, all) jiffies of all CPUs since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return values[3] + values[4], sum(values[:8])   # idle + iowait; guest time is in user


def settle(pids: list[int], timeout: float = 60.0, window: float = 0.5, busy: float = 0.03) -> float:
    """Wait until the processes use under `busy` of a core over `window` seconds; the
    seconds waited (a proxy still working after its clients are done shows here)."""
    t0 = time.perf_counter()
    last = cpu_s(pids)
    while time.perf_counter() - t0 < timeout:
        time.sleep(window)
        now = cpu_s(pids)
        if now - last <= busy * window + 1.0 / CLK_TCK:
            return time.perf_counter() - t0
        last = now
    return time.perf_counter() - t0


def du_mb(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total / 2**20


# ---- the processes -------------------------------------------------------------------------


class Fake:
    """scripts/workload.py serve, in its own process (not sharing the clients' GIL)."""

    def __init__(self, log: Path):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, str(Path(workload.__file__)), "serve"],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith("port "):
            self.proc.kill()
            raise RuntimeError(f"fake backend did not start: {line!r}")
        self.port = int(line.split()[1])
        self.url = f"http://{HOST}:{self.port}"

    def stats(self) -> dict:
        async def get():
            conn = workload.HttpConn(HOST, self.port)
            try:
                return orjson.loads((await conn.request("GET", "/_fake/counts", {}))[1])
            finally:
                conn.close()
        return asyncio.run(get())

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def start_plain(backend: str, work: Path, flow_detail: int | None) -> tuple[launch.Service, int]:
    """mitmdump with the same modes and mitmproxy options as launch.start_proxy, no addon."""
    port, rp = launch.free_ports(2)
    argv = [launch.mitmdump_path(), "--listen-host", HOST, "--mode", f"regular@{port}",
            "--mode", f"reverse:{backend}@{rp}", "--set", f"confdir={work / 'plain-conf'}",
            "--set", "connection_strategy=lazy", "--set", "upstream_cert=false"]
    if flow_detail is not None:
        argv += ["--set", f"flow_detail={flow_detail}"]
    service = launch.Service("mitmdump-plain", argv, None, work / "plain-mitmdump.log")
    try:
        launch.wait_port(port, service)
        launch.wait_port(rp, service)
    except BaseException:
        service.stop()
        raise
    return service, rp


def start_polar(backend: str, work: Path, flow_detail: int | None, polar_sets: list[str],
                name: str = "polar") -> tuple[launch.Service, int, int, Path]:
    """polar-mitm on a database of its own: <work>/<name>-store/calls.duckdb."""
    store = work / f"{name}-store"
    store.mkdir(parents=True, exist_ok=True)
    db = store / "calls.duckdb"
    port, rp = launch.free_ports(2)
    sets = ([f"flow_detail={flow_detail}"] if flow_detail is not None else []) + polar_sets
    service = launch.start_proxy(db=db, backend=backend, port=port, confdir=work / f"{name}-conf",
                                 log_path=work / f"{name}-mitmdump.log", reverse_port=rp, extra_sets=sets)
    return service, port, rp, db


def polar_health(port: int) -> dict:
    async def get():
        conn = workload.HttpConn(HOST, port)
        try:
            status, data = await conn.request("GET", "http://polar.health/_polar/health", {})
            return orjson.loads(data) if status == 200 else {"status": status}
        finally:
            conn.close()
    try:
        return asyncio.run(get())
    except (OSError, ValueError) as e:
        return {"error": repr(e)}


# ---- measuring -----------------------------------------------------------------------------


def pct(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of an ascending list."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize(windows: list[list[workload.CallRecord]]) -> dict:
    """Pooled over measurement windows (rounds); wall is the sum of the windows' walls."""
    records = [r for w in windows for r in w]
    ok = sorted(r.ms for r in records if r.status == 200 and not r.error)
    by_turn: dict[int, list[float]] = {}
    size_by_turn: dict[int, list[int]] = {}
    for r in records:
        if r.status == 200 and not r.error:
            by_turn.setdefault(r.turn, []).append(r.ms)
        size_by_turn.setdefault(r.turn, []).append(r.request_bytes)
    wall = sum(max(r.end for r in w) - min(r.start for r in w) for w in windows if w)
    return {"calls": len(records), "ok": len(ok), "errors": len(records) - len(ok),
            "first_errors": [r.error for r in records if r.error or r.status != 200][:3],
            "wall_s": wall, "calls_per_s": len(ok) / wall if wall else 0.0,
            "p50_ms": pct(ok, 50), "p90_ms": pct(ok, 90), "p99_ms": pct(ok, 99),
            "mean_ms": statistics.fmean(ok) if ok else float("nan"), "max_ms": ok[-1] if ok else float("nan"),
            "p50_by_turn_ms": {t: statistics.median(v) for t, v in sorted(by_turn.items())},
            "body_kb_by_turn": {t: statistics.fmean(v) / 1024 for t, v in sorted(size_by_turn.items())}}


def run_load(port: int, sessions: list[workload.Session], concurrency: int) -> list[workload.CallRecord]:
    return asyncio.run(workload.run_clients(HOST, port, sessions, concurrency))


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="polar-bench-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.run_id = f"{int(time.time()) % 100000:05d}"
        self.health: dict = {}     # polar's /_polar/health at the end
        self.fake = self.plain = self.polar = None
        self.routes: dict[str, tuple[launch.Service, int, Path]] = {}   # --compare-routes: route -> (proxy, port, db)
        self.route_health: dict[str, dict] = {}
        self.ports: dict[str, int] = {}
        self.results: list[dict] = []
        self.soak: dict | None = None
        self.answered_by_polar = 0
        concs = [int(c) for c in args.concurrency.split(",") if c.strip()]
        self.top = (64 if 64 in concs else max(concs)) if concs else None   # the targets' concurrency

    def turns(self, wl: str) -> int:
        return self.args.turns if wl == "ordered" else self.args.agent_turns

    def session_maker(self, wl: str, prefix: str, first_seed: int):
        """Conversation i of a workload: ordered, one session per key; out-of-order, the
        sub-agents of a key consecutive, so clients that start together interleave them."""
        a = self.args
        if wl == "ordered":
            def one(i):
                style = a.style if a.style != "mix" else workload.STYLES[i % 2]
                return workload.Session(style, f"polar-{prefix}~{i}", seed=first_seed + i, turns=a.turns)
            return one
        return workload.SubAgents(style=a.style, prefix=prefix, turns=a.agent_turns,
                                  first_seed=first_seed, agents=a.agents)

    def sessions(self, wl: str, n: int, prefix: str, first_seed: int) -> list[workload.Session]:
        make = self.session_maker(wl, prefix, first_seed)
        return [make(i) for i in range(n)]

    def start(self):
        self.fake = Fake(self.work / "fake.log")
        if self.args.compare_routes:
            self.start_routes()
            return
        self.plain, plain_rp = start_plain(self.fake.url, self.work, self.args.flow_detail)
        self.polar, self.polar_port, polar_rp, self.db = start_polar(self.fake.url, self.work,
                                                                      self.args.flow_detail,
                                                                      self.args.polar_set)
        self.ports = {"direct": self.fake.port, "plain": plain_rp, "polar": polar_rp}
        self.proc = {"direct": None, "plain": self.plain.proc.pid, "polar": self.polar.proc.pid}
        self.servers = [self.fake.proc.pid, self.plain.proc.pid, self.polar.proc.pid]

    def start_routes(self):
        """--compare-routes: a polar-mitm per route, each on a database of its own."""
        self.ports, self.proc = {"direct": self.fake.port}, {"direct": None}
        for route in ROUTES:
            service, port, rp, db = start_polar(self.fake.url, self.work, self.args.flow_detail,
                                                [*self.args.polar_set, f"polar_backend_route={route}"],
                                                name=f"polar-{route}")
            self.routes[route] = (service, port, db)
            self.ports[route], self.proc[route] = rp, service.proc.pid
        self.servers = [self.fake.proc.pid] + [s.proc.pid for s, _, _ in self.routes.values()]

    def health_port(self, cfg: str) -> int | None:
        """The control port of the polar-mitm that config cfg measures (None: not polar)."""
        return self.polar_port if cfg == "polar" else self.routes[cfg][1] if cfg in self.routes else None

    def stop(self):
        for s in (self.polar, self.plain, *(s for s, _, _ in self.routes.values())):
            if s is not None:
                s.stop()
        if self.fake is not None:
            self.fake.stop()

    def warm_up(self):
        for cfg in self.ports:
            sessions = workload.make_sessions(2, style=self.args.style, prefix=f"warm{self.run_id}-{cfg}",
                                              turns=3, first_seed=10**6)
            recs = run_load(self.ports[cfg], sessions, 2)
            bad = [r for r in recs if r.error or r.status != 200]
            if bad:
                raise RuntimeError(f"warm-up through {cfg} failed: {bad[0].status} {bad[0].error}")
            if self.health_port(cfg):
                self.answered_by_polar += len(recs)

    def measure(self, cfg: str, concurrency: int, round_: int = 0) -> dict:
        """One measurement window; the same sessions (content) for every config of a round."""
        a = self.args
        n = max(concurrency * a.sessions, a.min_sessions)
        if concurrency == self.top:
            # long enough for polar's loader to load a whole row group (2048 calls) while the
            # clients run: its memory and CPU belong in the window the RSS target judges
            n = max(n, math.ceil(a.top_calls / self.turns(a.workload)))
        sessions = self.sessions(a.workload, n, f"b{self.run_id}-{cfg}-c{concurrency}-r{round_}",
                                 concurrency * 1000 + round_ * 100_000)
        pid, hport = self.proc[cfg], self.health_port(cfg)
        waited = settle(self.servers)
        if pid:
            reset_peak(pid)
        before = self.fake.stats()
        loads0 = polar_health(hport).get("loads", 0) if hport else 0
        proxy0 = cpu_s([pid]) if pid else 0.0
        threads0, machine0 = thread_cpu_s(pid) if pid else {}, machine_ticks()
        fake0, self0 = cpu_s([self.fake.proc.pid]), time.process_time()
        records = run_load(self.ports[cfg], sessions, concurrency)
        proxy1 = cpu_s([pid]) if pid else 0.0
        threads1, machine1 = thread_cpu_s(pid) if pid else {}, machine_ticks()
        fake1, self1 = cpu_s([self.fake.proc.pid]), time.process_time()
        # polar's loader loads whole row groups while calls come, the rest when a reader
        # asks: the calls it left in its log are loaded (and their CPU counted) later
        health = polar_health(hport) if hport else {}
        pending, loads = health.get("log_pending"), health.get("loads", 0) - loads0
        after_s = settle(self.servers)
        proxy2 = cpu_s([pid]) if pid else 0.0
        after = self.fake.stats()
        part = {"records": records, "sessions": n, "settle_before_s": waited, "settle_after_s": after_s,
                "log_pending": pending, "loads": loads if hport else None,
                "proxy_cpu_s": proxy1 - proxy0, "proxy_deferred_cpu_s": proxy2 - proxy1,
                "fake_cpu_s": fake1 - fake0, "client_cpu_s": self1 - self0,
                "thread_cpu_s": {k: v - threads0.get(k, 0.0) for k, v in threads1.items()},
                "machine_idle": (machine1[0] - machine0[0]) / max(1, machine1[1] - machine0[1]),
                "peak_rss_mb": peak_rss_mb(pid) if pid else None, "rss_after_mb": rss_mb(pid) if pid else None,
                "backend_requests": {k: after.get(k, 0) - before.get(k, 0) for k in after
                                     if after.get(k, 0) != before.get(k, 0) and k != "/_fake/counts"}}
        if hport:
            self.answered_by_polar += sum(1 for r in records if r.status == 200 and not r.error)
        return part

    @staticmethod
    def combine(cfg: str, concurrency: int, parts: list[dict]) -> dict:
        """The rounds of one (config, concurrency) pooled: percentiles over all calls,
        calls/s over the summed windows, peak RSS the highest of the windows."""
        res = summarize([p["records"] for p in parts])
        ok = max(res["ok"], 1)
        proxied = parts[0]["peak_rss_mb"] is not None
        requests: dict[str, int] = {}
        for p in parts:
            for k, v in p["backend_requests"].items():
                requests[k] = requests.get(k, 0) + v
        res.update(config=cfg, concurrency=concurrency, rounds=len(parts),
                   sessions=sum(p["sessions"] for p in parts),
                   settle_after_s=max(p["settle_after_s"] for p in parts),
                   proxy_cpu_ms_per_call=sum(p["proxy_cpu_s"] for p in parts) * 1000 / ok if proxied else None,
                   proxy_deferred_cpu_ms_per_call=(sum(p["proxy_deferred_cpu_s"] for p in parts) * 1000 / ok
                                                   if proxied else None),
                   fake_cpu_ms_per_call=sum(p["fake_cpu_s"] for p in parts) * 1000 / ok,
                   client_cpu_ms_per_call=sum(p["client_cpu_s"] for p in parts) * 1000 / ok,
                   thread_cpu_ms_per_call={k: sum(p["thread_cpu_s"].get(k, 0.0) for p in parts) * 1000 / ok
                                           for k in {k for p in parts for k in p["thread_cpu_s"]}},
                   machine_idle=statistics.mean(p["machine_idle"] for p in parts),
                   # the first round's window: later rounds start from RSS kept after 64 clients
                   peak_rss_mb=parts[0]["peak_rss_mb"],
                   peak_rss_max_mb=max(p["peak_rss_mb"] for p in parts) if proxied else None,
                   rss_after_mb=parts[-1]["rss_after_mb"], backend_requests=requests,
                   windows=[{k: v for k, v in p.items() if k != "records"} | {"calls": len(p["records"])}
                            for p in parts],
                   raw_columns=["round", "session", "turn", "style", "request_bytes", "start_s", "ms", "status"],
                   raw=[[i, r.session, r.turn, r.style, r.request_bytes, round(r.start - t0, 4), round(r.ms, 3),
                         r.status]
                        for i, p in enumerate(parts) if p["records"]
                        for t0 in [min(x.start for x in p["records"])] for r in p["records"]])
        return res

    def run_soak(self, seconds: float, clients: int) -> dict:
        """polar alone, clients keep starting new sessions until the time is up."""
        bucket = 60.0 if seconds >= 120 else max(seconds / 4, 1.0)
        pid, store = self.proc["polar"], self.db.parent
        settle(self.servers)
        reset_peak(pid)
        samples = []
        start = time.perf_counter()
        deadline = start + seconds
        prefix = f"soak{self.run_id}"

        new_session = self.session_maker(self.args.workload, prefix, 10**5)

        async def sampler():
            while time.perf_counter() < deadline:
                samples.append({"t": time.perf_counter() - start, "rss_mb": rss_mb(pid),
                                "store_mb": du_mb(store), "cpu_s": cpu_s([pid])})
                await asyncio.sleep(min(5.0, bucket / 4))

        async def go():
            task = asyncio.create_task(sampler())
            recs = await workload.run_clients(HOST, self.ports["polar"], [], clients, deadline=deadline,
                                              new_session=new_session)
            await task
            return recs

        print(f"soak: polar, {clients} clients, {seconds:.0f} s ...", file=sys.stderr, flush=True)
        records = asyncio.run(go())
        ok = [r for r in records if r.status == 200 and not r.error]
        self.answered_by_polar += len(ok)
        nb = max(int(seconds // bucket), 1)
        buckets = []
        for b in range(nb):
            lo, hi = start + b * bucket, start + (b + 1) * bucket
            inb = sorted(r.ms for r in ok if lo <= r.end < hi)
            smp = [s for s in samples if b * bucket <= s["t"] < (b + 1) * bucket]
            buckets.append({"from_s": b * bucket, "to_s": (b + 1) * bucket, "calls": len(inb),
                            "calls_per_s": len(inb) / bucket, "p50_ms": pct(inb, 50), "p99_ms": pct(inb, 99),
                            "rss_mb": smp[-1]["rss_mb"] if smp else None,
                            "store_mb": smp[-1]["store_mb"] if smp else None})
        return {"seconds": seconds, "clients": clients, "bucket_s": bucket, "calls": len(records),
                "errors": len(records) - len(ok), "buckets": buckets, "peak_rss_mb": peak_rss_mb(pid),
                "settle_after_s": settle(self.servers), "samples": samples}


# ---- the store's loader under load (--store-load) --------------------------------------------


class SegmentWatch:
    """Bytes appended to a call log (<db>.log/NNN.jsonl), however soon the loader deletes
    loaded segments: each segment is opened as soon as it shows, and its size read from the
    open file (fstat works after an unlink) once a newer segment exists (the writer appends
    to its newest only) or at the end. A segment created and deleted between two looks (it
    would have to fill 32 MB and be loaded within `interval`) shows as a gap in the numbers."""

    def __init__(self, directory: Path, interval: float = 0.05):
        self.dir, self.interval = directory, interval
        self.open: dict[int, int] = {}    # segment -> fd
        self.sizes: dict[int, int] = {}   # finished segments' bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="segment-watch", daemon=True)
        self._thread.start()

    def _look(self) -> None:
        ids = calllog.segment_ids(self.dir)
        for seg in ids:
            if seg not in self.open and seg not in self.sizes:
                try:
                    self.open[seg] = os.open(calllog.segment_path(self.dir, seg), os.O_RDONLY)
                except FileNotFoundError:
                    pass
        for seg in [s for s in self.open if ids and s < ids[-1]]:
            self._finish(seg)

    def _finish(self, seg: int) -> None:
        fd = self.open.pop(seg)
        self.sizes[seg] = os.fstat(fd).st_size
        os.close(fd)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._look()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._look()
        for seg in list(self.open):
            self._finish(seg)
        seen = sorted(self.sizes)
        gaps = sorted(set(range(seen[0], seen[-1] + 1)) - set(seen)) if seen else []
        return {"bytes": sum(self.sizes.values()), "segments": len(seen), "gaps": gaps}


def timed_query(db: Path, sql: str) -> tuple[float, list | None, str | None]:
    """(seconds, the first row, error): a reader as any tool is, through polar_mitm.store."""
    t0 = time.perf_counter()
    try:
        _, rows = query(db, sql, timeout=600)
        return time.perf_counter() - t0, list(rows[0]), None
    except Exception as e:   # a failing read is a result here, not a crash of the bench
        return time.perf_counter() - t0, None, repr(e)[:300]


def db_mb(db: Path) -> float:
    return sum(p.stat().st_size for p in (db, Path(f"{db}.wal")) if p.exists()) / 2**20


def store_load(bench: "Bench", wl: str, calls: int, clients: int) -> dict:
    """One workload through a fresh polar-mitm (its own database) at `clients` clients for at
    least `calls` calls; then reads the database while the proxy runs and after it stopped."""
    a = bench.args
    name = f"store-{wl}-{bench.run_id}"
    service, port, rp, db = start_polar(bench.fake.url, bench.work, a.flow_detail, a.polar_set, name=name)
    bench.polar = service   # stopped by Bench.stop if anything below fails
    pid = service.proc.pid
    try:
        settle([bench.fake.proc.pid, pid])
        idle_mb = rss_mb(pid)
        reset_peak(pid)
        n = math.ceil(calls / bench.turns(wl))
        sessions = bench.sessions(wl, n, f"s{bench.run_id}-{wl}", 200_000 if wl == "ordered" else 300_000)
        print(f"store load: {wl}, {n} conversations, {clients} clients, database {db} ...",
              file=sys.stderr, flush=True)
        watch = SegmentWatch(log_dir(db))
        threads0 = thread_cpu_s(pid)
        records = run_load(rp, sessions, clients)
        threads1 = thread_cpu_s(pid)
        health1 = polar_health(port)
        log_end_mb = du_mb(log_dir(db))
        # a reader makes the proxy load what is pending first: this read's time includes it
        read_running = timed_query(db, "SELECT count(*), count(DISTINCT call_id) FROM call_records")
        threads2 = thread_cpu_s(pid)
        health2 = polar_health(port)
        peak_mb, log_stop_mb = peak_rss_mb(pid), du_mb(log_dir(db))
        log = watch.stop()
    finally:
        t0 = time.perf_counter()
        service.stop(timeout=300)
        stop_s, rc = time.perf_counter() - t0, service.proc.returncode
        bench.polar = None
    read_stopped = timed_query(db, "SELECT count(*) FROM calls")
    _, shape, _ = timed_query(db, "SELECT avg(request_chars), avg((base_call IS NULL)::INT), "
                                  "avg(length(request_middle)), avg(length(prompt_suffix)) FROM call_records")
    ok = sum(1 for r in records if r.status == 200 and not r.error)
    rows = read_running[1][1] if read_running[1] else None

    def per_call(name, t_a, t_b):
        return (t_b.get(name, 0.0) - t_a.get(name, 0.0)) * 1000 / max(ok, 1)

    res = summarize([records])
    res.update(workload=wl, clients=clients, conversations=n, keys=len({s.key for s in sessions}), db=str(db),
               loader_ms_while=per_call("polar-loader", threads0, threads1),
               loader_ms=per_call("polar-loader", threads0, threads2),
               log_ms=per_call("polar-log", threads0, threads2),
               loop_ms=per_call("mitmdump", threads0, threads2),
               idle_rss_mb=idle_mb, peak_rss_mb=peak_mb, log_bytes=log["bytes"], log_segments=log["segments"],
               log_gaps=log["gaps"], line_kb=log["bytes"] / rows / 1024 if rows else None,
               log_end_mb=log_end_mb, log_stop_mb=log_stop_mb, health_end=health1, health=health2,
               read_running_s=read_running[0], read_running=read_running[1], read_running_error=read_running[2],
               stop_s=stop_s, stop_rc=rc, read_stopped_s=read_stopped[0],
               read_stopped=read_stopped[1], read_stopped_error=read_stopped[2], db_mb=db_mb(db),
               request_kb=shape[0] / 1024 if shape and shape[0] is not None else None,
               stored_whole=shape[1] if shape else None,
               middle_kb=shape[2] / 1024 if shape and shape[2] is not None else None,
               prompt_suffix_kb=shape[3] / 1024 if shape and shape[3] is not None else None)
    return res


def recorded_rows(db: Path) -> str:
    """Rows in the calls table, read with the public CLI after the proxy stopped."""
    exe = Path(sys.executable).parent / "polar-mitm"
    try:
        out = subprocess.run([str(exe), "sql", "--db", str(db), "--format", "csv",
                              "SELECT count(*) FROM calls"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"? ({e!r})"
    lines = out.stdout.strip().splitlines()
    return lines[-1] if out.returncode == 0 and lines else f"? ({out.stderr.strip()[-200:]})"


# ---- report --------------------------------------------------------------------------------


def fmt(v, spec=".1f", none="-"):
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def store_rows(r: dict) -> list[tuple[str, str]]:
    """(label, value) of one workload's column in the store-load table."""
    h, he = r["health"], r["health_end"]
    counts = "/".join(str(v) for v in r["read_running"]) if r["read_running"] else f"? {r['read_running_error']}"
    rows = [("conversations (session keys)", f"{r['conversations']} ({r['keys']})"),
            ("calls answered 200 / failed", f"{r['ok']} / {r['errors']}"),
            ("calls/s", fmt(r["calls_per_s"])),
            ("p50 / p99 ms", f"{fmt(r['p50_ms'], '.0f')} / {fmt(r['p99_ms'], '.0f')}"),
            ("request KB, mean", fmt(r["request_kb"])),
            ("stored whole (no delta base)", fmt(r["stored_whole"] * 100 if r["stored_whole"] is not None
                                                 else None, ".0f") + " %"),
            ("stored request text + prompt ids KB, mean", f"{fmt(r['middle_kb'])} + {fmt(r['prompt_suffix_kb'])}"),
            ("log line KB, mean", fmt(r["line_kb"])),
            ("loader CPU ms/call, clients ran", fmt(r["loader_ms_while"], ".2f")),
            ("loader CPU ms/call, + reader's load", fmt(r["loader_ms"], ".2f")),
            ("log thread CPU ms/call", fmt(r["log_ms"], ".2f")),
            ("event loop CPU ms/call", fmt(r["loop_ms"], ".2f")),
            ("peak RSS MB (above idle)", f"{fmt(r['peak_rss_mb'], '.0f')} "
                                         f"(+{fmt(r['peak_rss_mb'] - r['idle_rss_mb'], '.0f')})"),
            ("call log MB on disk, clients done / before stop", f"{fmt(r['log_end_mb'])} / {fmt(r['log_stop_mb'])}"),
            ("loads / failed (health)", f"{h.get('loads')} / {h.get('load_errors')}"),
            ("log_pending, clients done / after read", f"{he.get('log_pending')} / {h.get('log_pending')}"),
            ("read while running s (count/distinct)", f"{r['read_running_s']:.2f} ({counts})"),
            ("proxy stop s (exit code)", f"{r['stop_s']:.1f} ({r['stop_rc']})"),
            ("read after stop s (calls)", f"{r['read_stopped_s']:.2f} "
                                          f"({r['read_stopped'][0] if r['read_stopped'] else r['read_stopped_error']})"),
            ("database MB", fmt(r["db_mb"]))]
    if isinstance(h.get("loader"), dict):   # newer proxies say what their loader is doing
        rows += [("loader state", str(h["loader"].get("state"))),
                 # its first line: DuckDB's errors go on with advice (the JSON has it whole)
                 ("loader last_error", (str(h["loader"].get("last_error")).splitlines() or [""])[0][:110])]
    return rows


def store_report(results: list[dict], extra: dict) -> bool:
    print()
    print(f"store load: polar only, {results[0]['clients']} clients, each workload on a fresh database")
    cols = [(r["workload"], dict(store_rows(r))) for r in results]
    labels = list(dict.fromkeys(k for _, rows in cols for k in rows))
    width = max(len(k) for k in labels)
    colw = [max(len(name), *(len(rows.get(k, "-")) for k in labels)) for name, rows in cols]
    print(f"{'':{width}s}  " + "  ".join(f"{name:>{w}s}" for (name, _), w in zip(cols, colw)))
    for k in labels:
        print(f"{k:{width}s}  " + "  ".join(f"{rows.get(k, '-'):>{w}s}" for (_, rows), w in zip(cols, colw)))
    print("(log line KB: bytes appended to <db>.log/*.jsonl, every segment's size read from a file "
          "descriptor held open from its creation, so segments the loader deleted count, divided by the "
          "distinct call_ids read; loader CPU: the polar-loader thread from the clients' start to the end "
          "of the clients / to the end of the read while running, which loads what was pending; read while "
          "running: query(db, count(*), count(DISTINCT call_id) FROM call_records) with the proxy up; read "
          "after stop: query(db, count(*) FROM calls) after SIGTERM)")
    print()
    for k, v in extra.items():
        print(f"{k}: {v}")
    print()
    checks: list[tuple[bool, str]] = []
    for r in results:
        wl, ok, h = r["workload"], r["ok"], r["health"]
        counted = r["read_running"] or [None, None]
        stopped = r["read_stopped"][0] if r["read_stopped"] else None
        checks += [(r["errors"] == 0, f"{wl}: failed calls: {r['errors']} {r['first_errors']}"),
                   (h.get("load_errors") == 0, f"{wl}: loads into DuckDB {h.get('loads')}, failed "
                                               f"{h.get('load_errors')}"),
                   (counted[0] == counted[1] == ok, f"{wl}: exactly once while running: count(*) {counted[0]} == "
                                                   f"count(DISTINCT call_id) {counted[1]} == answered {ok}"
                    + (f" ({r['read_running_error']})" if r["read_running_error"] else "")),
                   (stopped == ok, f"{wl}: after stop: calls {stopped} == answered {ok}"
                    + (f" ({r['read_stopped_error']})" if r["read_stopped_error"] else ""))]
        if r["log_gaps"]:
            print(f"warn  {wl}: call log segments {r['log_gaps']} were gone before the bench saw them: "
                  "log line KB is too low")
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return all(ok for ok, _ in checks)


def run_store_load(bench: "Bench", args, clients: int) -> tuple[list[dict], bool]:
    """--store-load: each workload in turn, on a fresh proxy and database."""
    workloads = ["ordered", "out-of-order"] if args.workload == "both" else [args.workload]
    t_start, load_before = time.perf_counter(), os.getloadavg()
    results = []
    try:
        bench.fake = Fake(bench.work / "fake.log")
        print(f"work dir {bench.work}; fake backend :{bench.fake.port}", file=sys.stderr, flush=True)
        for wl in workloads:
            results.append(store_load(bench, wl, args.store_load, clients))
    finally:
        bench.stop()
    extra = {"workloads": f"ordered: one conversation of {args.turns} turns per key; out-of-order: "
                          f"{args.agents[0]}-{args.agents[1]} sub-agent conversations of {args.agent_turns} "
                          "turns per key, each with its own system prompt, run at once by different clients",
             "bench wall time": f"{time.perf_counter() - t_start:.0f} s",
             "load average (1 min) before / after, on": f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f}, "
                                                       f"{os.cpu_count()} CPUs"}
    return results, store_report(results, extra)


def print_table(by: dict, concs: list[int]) -> None:
    print()
    head = (f"{'config':7s} {'clients':>7s} {'calls':>6s} {'err':>4s} {'p50 ms':>8s} {'p99 ms':>8s} "
            f"{'+p50 ms':>8s} {'+p99 ms':>8s} {'calls/s':>8s} {'cpu ms/call':>12s} {'deferred':>9s} "
            f"{'peak RSS MB':>11s}")
    print(head)
    print("-" * len(head))
    for c in concs:
        d = by.get(("direct", c))
        for cfg in CONFIGS:
            r = by.get((cfg, c))
            if not r:
                continue
            add50 = r["p50_ms"] - d["p50_ms"] if d and cfg != "direct" else None
            add99 = r["p99_ms"] - d["p99_ms"] if d and cfg != "direct" else None
            print(f"{cfg:7s} {c:7d} {r['calls']:6d} {r['errors']:4d} {fmt(r['p50_ms']):>8s} "
                  f"{fmt(r['p99_ms']):>8s} {fmt(add50):>8s} {fmt(add99):>8s} {fmt(r['calls_per_s']):>8s} "
                  f"{fmt(r['proxy_cpu_ms_per_call'], '.2f'):>12s} "
                  f"{fmt(r['proxy_deferred_cpu_ms_per_call'], '.2f'):>9s} {fmt(r['peak_rss_mb']):>11s}")
    print("(+pXX: the percentile minus direct's at the same concurrency; cpu ms/call: the mitmdump "
          "process tree's CPU while the clients ran, per call; deferred: its CPU per call after the "
          "clients finished, until idle; peak RSS: VmHWM of the mitmdump tree in round 1's window, reset "
          "before it (memory kept from earlier windows counts))")
    # Where a proxy's CPU goes, and whether the machine had any left: with every core busy,
    # calls/s (and so latency under load) follow CPU per call.
    for c in concs:
        for cfg in ("plain", "polar"):
            r = by.get((cfg, c))
            if not r or not r.get("thread_cpu_ms_per_call"):
                continue
            threads = sorted(r["thread_cpu_ms_per_call"].items(), key=lambda kv: -kv[1])
            print(f"{cfg:7s} {c:7d} clients, CPU ms/call by thread: "
                  + ", ".join(f"{name} {ms:.2f}" for name, ms in threads if ms >= 0.005)
                  + f"; machine idle {r['machine_idle'] * 100:.0f}% of its {os.cpu_count()} CPUs")


def report(bench: Bench, results: list[dict], soak: dict | None, extra: dict) -> bool:
    by = {(r["config"], r["concurrency"]): r for r in results}
    concs = sorted({r["concurrency"] for r in results})
    allr = [r for r in results if r["config"] == "direct"]
    kb = {}
    for r in allr:
        for t, v in r["body_kb_by_turn"].items():
            kb.setdefault(int(t), []).append(v)
    if kb:
        wl = bench.args.workload
        print(f"workload: {wl}, {bench.args.style} conversations of {bench.turns(wl)} turns"
              + (f" ({bench.args.agents[0]}-{bench.args.agents[1]} per session key)" if wl != "ordered" else "")
              + ", request body "
              f"{statistics.fmean(kb[min(kb)]):.0f} KB at turn {min(kb)} -> "
              f"{statistics.fmean(kb[max(kb)]):.0f} KB at turn {max(kb)}")
    if results:
        print_table(by, concs)
    for c in concs:
        r = by.get(("polar", c))
        if r:
            per = {k: v / max(r["ok"], 1) for k, v in r["backend_requests"].items()}
            print(f"polar at {c} clients: peak RSS {r['peak_rss_max_mb']:.1f} MB over all rounds, "
                  f"{r['rss_after_mb']:.1f} MB after; backend requests per call "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items()))
                  + f"; idle {r['settle_after_s']:.1f} s after the clients finished; loads into DuckDB "
                  f"per window: {[w.get('loads') for w in r['windows']]}; calls left in its log per "
                  f"window (loaded later): {[w.get('log_pending') for w in r['windows']]}")
    if soak:
        print()
        print(f"soak: polar, {soak['clients']} clients, {soak['seconds']:.0f} s, {soak['calls']} calls, "
              f"{soak['errors']} errors, peak RSS {soak['peak_rss_mb']:.1f} MB")
        print(f"{'from s':>7s} {'to s':>6s} {'calls':>6s} {'calls/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} "
              f"{'RSS MB':>7s} {'store MB':>9s}")
        for b in soak["buckets"]:
            print(f"{b['from_s']:7g} {b['to_s']:6g} {b['calls']:6d} {b['calls_per_s']:8.1f} "
                  f"{fmt(b['p50_ms']):>8s} {fmt(b['p99_ms']):>8s} {fmt(b['rss_mb']):>7s} "
                  f"{fmt(b['store_mb']):>9s}")
    print()
    for k, v in extra.items():
        print(f"{k}: {v}")
    print()

    checks: list[tuple[bool, str]] = []
    for c in concs:
        p, q, d = by.get(("polar", c)), by.get(("plain", c)), by.get(("direct", c))
        if p and q and d:
            ap, aq = p["p50_ms"] - d["p50_ms"], q["p50_ms"] - d["p50_ms"]
            checks.append((ap <= aq + 10, f"added p50 at {c:2d} clients: polar {ap:7.1f} ms <= plain "
                                          f"{aq:.1f} + 10 ms"))
    top = 64 if 64 in concs else (max(concs) if concs else None)
    p, q, d = by.get(("polar", top)), by.get(("plain", top)), by.get(("direct", top))
    if p and q and d:
        ap, aq = p["p99_ms"] - d["p99_ms"], q["p99_ms"] - d["p99_ms"]
        checks.append((ap <= aq + 50, f"added p99 at {top} clients: polar {ap:7.1f} ms <= plain {aq:.1f} + 50 ms"))
        ratio = p["calls_per_s"] / q["calls_per_s"] if q["calls_per_s"] else 0.0
        checks.append((ratio >= 0.5, f"calls/s at {top} clients: polar {p['calls_per_s']:.1f} >= 0.5 x plain "
                                     f"{q['calls_per_s']:.1f} (x{ratio:.2f})"))
        loaded = sum(w.get("loads") or 0 for w in p["windows"])
        checks.append((p["peak_rss_max_mb"] < 250 and loaded > 0,
                       f"peak RSS at {top} clients (all rounds, {loaded} loads into DuckDB in them): polar "
                       f"{p['peak_rss_max_mb']:.1f} MB < 250 MB (plain {q['peak_rss_max_mb']:.1f} MB)"
                       + ("" if loaded else "; no load fell in these windows: raise --top-calls")))
    for c in concs:
        p, q = by.get(("polar", c)), by.get(("plain", c))
        if p and q and c != top and q["calls_per_s"]:
            print(f"info: calls/s at {c} clients: polar {p['calls_per_s']:.1f}, plain {q['calls_per_s']:.1f} "
                  f"(x{p['calls_per_s'] / q['calls_per_s']:.2f}; latency-bound below saturation)")
    if soak:
        b = soak["buckets"]
        first, last = b[0]["calls_per_s"], b[-1]["calls_per_s"]
        checks.append((bool(first) and last >= 0.9 * first,
                       f"soak: last {soak['bucket_s']:.0f} s {last:.1f} calls/s >= 0.9 x first {first:.1f} "
                       f"(x{last / first if first else 0:.2f})"))
    errors = sum(r["errors"] for r in results) + (soak["errors"] if soak else 0)
    checks.append((errors == 0, f"failed calls: {errors}"))
    health = bench.health
    if "load_errors" in health:
        # a loader that keeps failing holds no file and spends no CPU: every figure looks better
        checks.append((health["load_errors"] == 0, f"loads into DuckDB while calls came: "
                       f"{health['loads']}, of which failed: {health['load_errors']}"))
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return all(ok for ok, _ in checks)


def route_report(bench: Bench, results: list[dict], extra: dict) -> bool:
    """--compare-routes: polar on each backend route at each concurrency, and generate / chat.
    The issue's targets: CPU per call (clients' window + deferred) at most x1.3, calls/s at
    the top concurrency at least x0.9."""
    by = {(r["config"], r["concurrency"]): r for r in results}
    concs = sorted({r["concurrency"] for r in results})

    def figures(r: dict, d: dict | None) -> dict[str, float | None]:
        t = r["thread_cpu_ms_per_call"]
        return {"calls/s": r["calls_per_s"], "cpu ms/call": r["proxy_cpu_ms_per_call"],
                "loop": t.get("mitmdump", 0.0), "log": t.get("polar-log", 0.0), "loader": t.get("polar-loader", 0.0),
                "deferred": r["proxy_deferred_cpu_ms_per_call"],
                "+p50 ms": r["p50_ms"] - d["p50_ms"] if d else None,
                "+p99 ms": r["p99_ms"] - d["p99_ms"] if d else None,
                "fake ms/call": r["fake_cpu_ms_per_call"], "idle %": r["machine_idle"] * 100}

    cols = ("calls/s", "cpu ms/call", "loop", "log", "loader", "deferred", "+p50 ms", "+p99 ms", "fake ms/call",
            "idle %")
    print()
    head = f"{'route':14s} {'clients':>7s} {'calls':>6s} {'err':>4s} " + " ".join(f"{c:>{max(len(c), 7)}s}" for c in cols)
    print(head)
    print("-" * len(head))
    checks: list[tuple[bool, str]] = []
    for c in concs:
        d, rows = by.get(("direct", c)), {}
        for route in ROUTES:
            r = by.get((route, c))
            if not r:
                continue
            rows[route] = f = figures(r, d)
            print(f"{route:14s} {c:7d} {r['calls']:6d} {r['errors']:4d} "
                  + " ".join(f"{fmt(f[k], '.2f'):>{max(len(k), 7)}s}" for k in cols))
        if len(rows) == 2:
            g, h = rows["generate"], rows["chat"]
            ratio = {k: g[k] / h[k] if g[k] is not None and h[k] else None for k in cols}
            print(f"{'generate/chat':14s} {c:7d} {'':6s} {'':4s} "
                  + " ".join(f"{fmt(ratio[k], '.2f'):>{max(len(k), 7)}s}" for k in cols))
            cpu_g, cpu_h = g["cpu ms/call"] + (g["deferred"] or 0), h["cpu ms/call"] + (h["deferred"] or 0)
            checks.append((cpu_g <= 1.3 * cpu_h, f"proxy CPU per call at {c:2d} clients (deferred included): "
                                                 f"generate {cpu_g:.2f} ms <= 1.3 x chat {cpu_h:.2f} ms "
                                                 f"(x{cpu_g / cpu_h:.2f})"))
            if c == bench.top:
                checks.append((g["calls/s"] >= 0.9 * h["calls/s"],
                               f"calls/s at {c} clients: generate {g['calls/s']:.1f} >= 0.9 x chat "
                               f"{h['calls/s']:.1f} (x{g['calls/s'] / h['calls/s']:.2f})"))
    print("(cpu ms/call: the mitmdump process tree's CPU while the clients ran, per call, of which loop "
          "(the event loop's thread), log and loader (polar's threads); deferred: its CPU per call after "
          "the clients finished, until idle; +pXX: the percentile minus direct's at the same concurrency; "
          "fake ms/call: the stand-in vLLM's CPU per call, on either route; idle: the machine's)")
    for c in concs:
        for route in ROUTES:
            r = by.get((route, c))
            if r:
                per = {k: v / max(r["ok"], 1) for k, v in r["backend_requests"].items()}
                print(f"{route} at {c} clients: backend requests per call "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items()))
                      + f"; loads into DuckDB per window: {[w.get('loads') for w in r['windows']]}")
    print()
    for k, v in extra.items():
        print(f"{k}: {v}")
    print()
    for route, health in bench.route_health.items():
        took = (health.get("backend_route") or {}).get("route")
        checks.append((took == route, f"the {route} proxy's route (health): {took}"))
        checks.append((health.get("load_errors") == 0, f"the {route} proxy's loads into DuckDB: "
                                                       f"{health.get('loads')}, failed: {health.get('load_errors')}"))
    errors = sum(r["errors"] for r in results)
    checks.append((errors == 0, f"failed calls: {errors}"))
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return all(ok for ok, _ in checks)


def agents_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError("MIN-MAX with 1 <= MIN <= MAX")
    return lo, hi


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,64", help="client counts, comma-separated")
    ap.add_argument("--sessions", type=int, default=1, help="20-turn sessions per client")
    ap.add_argument("--min-sessions", type=int, default=16,
                    help="at least this many sessions per measurement (for low concurrency)")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--top-calls", type=int, default=2560,
                    help="at least this many calls per window at the highest concurrency: more than "
                         "the 2048 after which polar loads a row group into DuckDB while calls come")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measurement rounds, pooled; each round runs every concurrency and config "
                         "back to back, so load from elsewhere on the machine hits all three alike")
    ap.add_argument("--style", choices=("mix", *workload.STYLES), default="mix",
                    help="mix: sessions alternate OpenAI Chat and Anthropic Messages")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="subset of direct,plain,polar")
    ap.add_argument("--soak", type=float, default=0, help="then run polar alone this many seconds (e.g. 600)")
    ap.add_argument("--soak-clients", type=int, default=8)
    ap.add_argument("--flow-detail", type=int, default=None,
                    help="mitmproxy flow_detail for both mitmdumps (default: mitmdump's own, as "
                         "polar-mitm up runs it)")
    ap.add_argument("--compare-routes", action="store_true",
                    help="polar on each backend route (polar_backend_route=chat and =generate, a proxy "
                         "each) in place of plain and polar, in A B / B A order over the rounds: calls/s, "
                         "CPU per call and added latency side by side, and their ratios")
    ap.add_argument("--polar-set", action="append", default=[], metavar="OPTION=VALUE",
                    help="a polar_* option for polar's mitmdump (repeatable), e.g. polar_max_concurrency=32")
    ap.add_argument("--workload", choices=("ordered", "out-of-order", "both"), default="ordered",
                    help="ordered: one conversation per session key; out-of-order: several sub-agent "
                         "conversations per key, interleaved (both: only with --store-load)")
    ap.add_argument("--agents", type=agents_range, default=(4, 8), metavar="MIN-MAX",
                    help="out-of-order: sub-agent conversations per session key (drawn per key)")
    ap.add_argument("--agent-turns", type=int, default=6,
                    help="out-of-order: turns per sub-agent conversation (6: bodies 43 -> ~85 KB, log "
                         "lines ~150 KB at 64 clients; 8: ~170 KB)")
    ap.add_argument("--store-load", type=int, nargs="?", const=10_000, default=0, metavar="CALLS",
                    help="instead of the comparison: polar alone at the highest --concurrency, at least "
                         "CALLS calls (10000) per workload, each on a fresh database: loader CPU, RSS, "
                         "log line size, reads, exactly-once")
    ap.add_argument("--workdir", help="where the proxies keep their files (default: a new temp dir)")
    ap.add_argument("--out", help="raw results as JSON (default: /tmp/polar-bench-gateway-<time>.json)")
    args = ap.parse_args(argv)
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()]
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    if args.compare_routes:
        configs = ["direct", *ROUTES]
    out = Path(args.out or f"/tmp/polar-bench-gateway-{time.strftime('%Y%m%d-%H%M%S')}.json")
    if args.workload == "both" and not args.store_load:
        ap.error("--workload both needs --store-load (the comparison runs one workload)")

    bench = Bench(args)
    if args.store_load:
        results, ok = run_store_load(bench, args, max(concs) if concs else 64)
        out.write_text(json.dumps({"args": vars(args), "store_load": results, "workdir": str(bench.work)},
                                  indent=1, default=str))
        print(f"\nraw results: {out}")
        return 0 if ok else 1
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    results, soak, extra = [], None, {}
    try:
        bench.start()
        print(f"work dir {bench.work}; fake backend :{bench.fake.port}, "
              + ", ".join(f"{k} :{v}" for k, v in bench.ports.items() if k != "direct")
              + " (reverse mode)", file=sys.stderr, flush=True)
        bench.warm_up()
        parts: dict[tuple[str, int], list[dict]] = {}
        for rnd in range(args.rounds):
            # the routes' order flips every round (A B, B A, ...): neither always follows the other
            order = configs if not args.compare_routes or rnd % 2 == 0 else [configs[0], *configs[:0:-1]]
            for c in concs:
                for cfg in order:   # side by side: the configs back to back, every round
                    p = bench.measure(cfg, c, rnd)
                    parts.setdefault((cfg, c), []).append(p)
                    one = summarize([p["records"]])
                    print(f"  round {rnd + 1}/{args.rounds} {cfg:6s} {c:3d} clients: {one['calls']} calls in "
                          f"{one['wall_s']:.1f} s, p50 {one['p50_ms']:.1f} ms, {one['errors']} errors",
                          file=sys.stderr, flush=True)
        results = [bench.combine(cfg, c, parts[(cfg, c)]) for c in concs for cfg in configs]
        if args.soak > 0 and "polar" in configs:
            soak = bench.run_soak(args.soak, args.soak_clients)
        for route, (_, port, _) in bench.routes.items():
            bench.route_health[route] = polar_health(port)
        health = bench.health = polar_health(bench.polar_port) if bench.polar else {
            "calls": sum(h.get("calls") or 0 for h in bench.route_health.values())}
        extra["polar calls answered (health endpoint)"] = (
            f"{health.get('calls')} (this bench got {bench.answered_by_polar} answers with status 200 "
            "through polar, warm-up included)")
    finally:
        bench.stop()
    if bench.polar is not None:
        extra["rows in the calls table after stop (polar-mitm sql)"] = recorded_rows(bench.db)
        extra["polar store on disk"] = f"{du_mb(bench.db.parent):.1f} MB in {bench.db.parent}"
    for route, (_, _, db) in bench.routes.items():
        extra[f"rows in the {route} proxy's calls table after stop"] = recorded_rows(db)
    extra["bench wall time"] = f"{time.perf_counter() - t_start:.0f} s"
    extra["load average (1 min) before / after, on"] = (
        f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs (other work on the "
        "machine shows here and makes every number noisier)")
    ok = route_report(bench, results, extra) if args.compare_routes else report(bench, results, soak, extra)
    out.write_text(json.dumps({"args": vars(args), "results": results, "soak": soak, "extra": extra,
                               "workdir": str(bench.work)}, indent=1, default=str))
    print(f"\nraw results: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
