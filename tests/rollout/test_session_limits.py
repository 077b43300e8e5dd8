"""Every session is bounded (limits.py, cgroups.py): real probes, each a `command` session in the
real bwrap sandbox through a real gateway (a mitmdump proxy, the FakeVLLM stand-in), each with
small limits of its task's own: a fork loop, an allocation past its memory, a /tmp and a
/dev/shm filler, a workspace filler, a log flood, too many open files, a CPU hog. Each ends as
the policy's failure with the limit named (the CPU hog is throttled and scores), while a
sibling session makes model calls in a loop: its calls/s, the node's RSS and the proxy's
answers are measured around every probe and printed as a table. Then the same limits without
cgroups (rlimits, tmpfs sizes, the disk watcher, the capped log), the task field's checks, and
the cgroup layouts (v1 as here, v2 on a stand-in tree)."""

from __future__ import annotations

import logging
import ssl
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from polar_mitm.rollout import bwrap as bw
from polar_mitm.rollout import cgroups
from polar_mitm.rollout import runtime as rt
from polar_mitm.rollout.limits import KIB, MIB, DEFAULTS, Limits, parse_limits, parse_options
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.spec import TaskError, Workspace, parse_task
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts

needs_bwrap = pytest.mark.skipif(bw.probe()[0] is None, reason=f"no bwrap sandbox here: {bw.probe()[1]}")
needs_cgroups = pytest.mark.skipif(not cgroups.host().enabled, reason=f"no cgroups here: {cgroups.host().why}")

PY = sys.executable     # the node's Python: the sandbox sees it read-only

SIBLING = textwrap.dedent("""\
    import os, time, httpx
    with httpx.Client(proxy=os.environ["HTTPS_PROXY"], verify=os.environ.get("SSL_CERT_FILE") or True,
                      timeout=30, trust_env=False) as c:
        while not os.path.exists("stop"):
            r = c.post("https://api.openai.com/v1/chat/completions", headers={"authorization": "Bearer x"},
                       json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            r.raise_for_status()
            print(f"call {time.time():.3f}", flush=True)
    """)

OPEN_FILES = textwrap.dedent("""\
    import os
    fds = []
    try:
        while True:
            fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as e:
        print(f"open files: {len(fds) + 3} then errno {e.errno}")
        raise SystemExit(3)
    """)

# name, the task's limits, its command, the limit its outcome names (None: none does)
PROBES = [
    ("fork loop", {"pids": 32}, "while :; do sleep 60 & done", "pids"),
    ("allocation", {"memory": "64MiB"}, f"{PY} -c \"b = b'x' * (256 << 20)\"; sleep 5", "memory"),
    ("/tmp filler", {"memory": "64MiB"},
     "i=0; while dd if=/dev/zero of=/tmp/f$i bs=1M count=8 2>/dev/null; do i=$((i+1)); done; sleep 5", "memory"),
    ("/dev/shm filler", {"memory": "64MiB"},
     "i=0; while dd if=/dev/zero of=/dev/shm/f$i bs=1M count=8 2>/dev/null; do i=$((i+1)); done; sleep 5",
     "memory"),
    ("workspace filler", {"disk": "32MiB"}, "while :; do dd if=/dev/zero of=f$(date +%N) bs=1M count=4; done",
     "disk"),
    ("log flood", {"log": "256KiB"}, "head -c 20000000 /dev/zero | tr '\\0' x; echo; echo END-OF-FLOOD", "log"),
    ("open files", {"nofile": 64}, f"{PY} open_files.py", None),
    ("CPU hog", {"cpus": 0.25}, "timeout 2 sh -c 'while :; do :; done'; true", None),
]
REASONS = {"pids": "process limit (32 processes", "memory": "memory limit (64 MiB)",
           "disk": "disk limit (32 MiB", "log": "log limit (256 KiB)"}


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def proxy_answers(proxy) -> float | None:
    """A model call through the proxy, as a session makes one: its latency in ms, None if it failed."""
    t0 = time.monotonic()
    try:
        with httpx.Client(proxy=proxy.proxy_url("health~0"), verify=ssl.create_default_context(cafile=proxy.ca),
                          timeout=10, trust_env=False) as c:
            r = c.post("https://api.openai.com/v1/chat/completions", headers={"authorization": "Bearer x"},
                       json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        return (time.monotonic() - t0) * 1000 if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def call_times(log: Path) -> list[float]:
    return [float(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("call ")]


def leftover_cgroups() -> list[str]:
    return [str(d) for p in cgroups.host().parents.values() if p.exists() for d in p.iterdir() if d.is_dir()]


@needs_bwrap
@needs_cgroups
def test_each_limit_ends_only_its_own_session_and_the_node_keeps_serving(start_proxy, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "sibling.py").write_text(SIBLING)
    (ws / "open_files.py").write_text(OPEN_FILES)
    sessions = tmp_path / "sessions"
    rows, outcomes, windows = [], {}, []
    with FakeVLLM() as backend:
        proxy = start_proxy(backend.url)
        runtime = LocalRuntime(sessions, keep=True, sandbox="bwrap")
        with Rollouts(proxy, runtime, workers=2) as rollouts:
            server = rollouts.server
            server.submit({"task_id": "sibling", "instruction": "x", "harness": "command", "timeout": 120,
                           "workspace": str(ws), "command": f"{PY} sibling.py"})
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                logs = list(sessions.glob("sibling-*/logs/harness.log"))
                if logs and len(call_times(logs[0])) >= 5:
                    break
                time.sleep(0.2)
            (sib_log,) = sessions.glob("sibling-*/logs/harness.log")
            t0 = time.time()
            time.sleep(1.5)
            windows.append(("(baseline: no probe)", t0, time.time()))
            rss0 = rss_mib()
            for i, (name, limits, command, _) in enumerate(PROBES):
                tid = f"probe-{i}"
                before = rss_mib()
                t0 = time.time()
                server.submit({"task_id": tid, "instruction": "x", "harness": "command", "timeout": 60,
                               "workspace": str(ws), "command": command, "evaluator": "echo 1", "limits": limits})
                assert server.wait([tid], timeout=90), server.task_status(tid)
                windows.append((name, t0, time.time()))
                (s,) = server.group(tid)["sessions"]
                outcomes[name] = s
                used = ", ".join(f"{k} {v}" for k, v in (s["stats"].get("usage") or {}).items() if v)
                rows.append((name, ", ".join(f"{k}={v}" for k, v in limits.items()),
                             f"{s['state']} {s['reward']}: {(s.get('reason') or '')[:130]}", used,
                             f"{before:.0f} -> {rss_mib():.0f}", proxy_answers(proxy),
                             f"{rss_mib(proxy.pid):.0f}"))
            rss1 = rss_mib()
            (sib_dir,) = sessions.glob("sibling-*")
            (sib_dir / "work" / "stop").touch()
            assert server.wait(["sibling"], timeout=60)
            sibling = server.group("sibling")["sessions"][0]
            times = call_times(sib_log)
            flood_log = next(sessions.glob(f"probe-{[p[0] for p in PROBES].index('log flood')}-*/logs/harness.log"))
            health = httpx.get(f"{backend.url}/v1/models", timeout=5).status_code
        assert leftover_cgroups() == [], "the sessions' cgroups outlived them"

    rates = {name: sum(a <= t <= b for t in times) / max(b - a, 1e-3) for name, a, b in windows}
    table = ["| probe | limit | outcome: reason | used (stats.usage) | sibling calls/s | node RSS MiB | "
             "proxy answer ms | proxy RSS MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
             f"| (baseline: no probe) | - | - | - | {rates['(baseline: no probe)']:.1f} | {rss0:.0f} | - | - |"]
    for name, limit, outcome, used, rss, answer, prss in rows:
        ms = f"{answer:.0f}" if answer is not None else "NO ANSWER"
        table.append(f"| {name} | {limit} | {outcome} | {used} | {rates[name]:.1f} | {rss} | {ms} | {prss} |")
    print("\n" + "\n".join(table))

    for name, _, _, limit in PROBES:
        s = outcomes[name]
        if name == "CPU hog":      # throttled, not ended: it scores
            assert s["state"] == "done" and s["reward"] == 1.0, s
            assert s["stats"]["usage"]["cpu_throttled_s"] > 0.5, s["stats"]
            continue
        assert s["state"] == "failed" and s["reward"] == 0.0, (name, s)      # the policy's failure
        if limit is None:          # open files: EMFILE inside, which no counter keeps
            assert "open files: 64 then errno 24" in s["reason"] and "limit" not in s["stats"], s
        else:
            assert s["stats"]["limit"] == limit and REASONS[limit] in s["reason"], (name, s)
    assert outcomes["workspace filler"]["stats"]["usage"]["disk_mib"] < 32 + 512, outcomes["workspace filler"]
    # the flood's log kept its tail, under its limit
    assert flood_log.stat().st_size <= 256 * KIB + 64 * KIB and flood_log.read_text().rstrip().endswith("END-OF-FLOOD")
    # the node, the proxy and the backend kept answering throughout
    assert sibling["state"] == "done" and sibling["stats"]["calls"] == len(times), sibling
    assert all(rates[name] > 0 for name, _, _ in windows), rates
    assert all(r[5] is not None for r in rows), rows
    assert health == 200
    assert rss1 - rss0 < 64, f"the node grew from {rss0:.0f} to {rss1:.0f} MiB"


@needs_bwrap
def test_without_cgroups_rlimits_tmpfs_sizes_the_disk_watcher_and_the_log_cap_still_hold(tmp_path, monkeypatch,
                                                                                         caplog):
    monkeypatch.setattr(rt, "cgroup_host", lambda: cgroups.Host(0, why="no controllers (a stand-in)"))
    monkeypatch.setattr(rt, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="polar.sandbox"):
        runtime = LocalRuntime(tmp_path / "s", sandbox="bwrap")
        LocalRuntime(tmp_path / "s2", sandbox="bwrap")
    assert [r.getMessage() for r in caplog.records].count(
        next(r.getMessage() for r in caplog.records if "WITHOUT cgroup limits" in r.getMessage())) == 1
    env = {"PATH": "/usr/bin:/bin"}
    box = runtime.prepare("t~0", Workspace(), limits={"memory": 32 * MIB, "disk": 48 * MIB, "log": 64 * KIB,
                                                      "nofile": 100})
    try:
        assert box.cgroup is None
        r = box.run(["/bin/sh", "-c", "echo nofile $(ulimit -n) data $(ulimit -d); "
                                      "dd if=/dev/zero of=/tmp/f bs=1M count=100; echo used $(du -m /tmp/f)"],
                    env, 30, "tmp")
        # each process's data segment at the memory limit; the tmpfs full at its size, not the node's RAM
        assert f"nofile 100 data {32 * 1024}" in r.output_tail and "No space left" in r.output_tail, r
        assert "used 32 /tmp/f" in r.output_tail and r.limit is None, r
        r = box.run(["/bin/sh", "-c", "while :; do dd if=/dev/zero of=f$(date +%N) bs=1M count=2 2>/dev/null; "
                                      "sleep 0.05; done"], env, 30, "disk")
        assert r.limit is not None and r.limit.name == "disk" and r.seconds < 10, r
        for f in box.workdir.iterdir():      # under its disk limit again
            f.unlink()
        r = box.run(["/bin/sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' y; echo; echo TAIL"], env, 30, "log")
        assert r.limit is not None and r.limit.name == "log" and r.exit_code == 0, r
        log = box.logs / "log.log"
        assert log.stat().st_size <= 64 * KIB + 64 * KIB and log.read_text().rstrip().endswith("TAIL")
        assert log.read_text().startswith("[polar: ") and r.usage["log_dropped_bytes"] > 2_800_000
    finally:
        box.teardown()


def test_a_tasks_limits_are_checked_and_kept_in_their_canonical_form():
    t = parse_task({"task_id": "t", "instruction": "x",
                    "limits": {"memory": "512MiB", "pids": 64, "cpus": 0.5, "disk": "1G", "log": 65536}})
    assert t.limits == {"memory": 512 * MIB, "pids": 64, "cpus": 0.5, "disk": 1 << 30, "log": 65536}
    assert DEFAULTS.merged(t.limits) == Limits(memory=512 * MIB, pids=64, cpus=0.5, nofile=4096, disk=1 << 30,
                                               log=65536)
    assert parse_task({"task_id": "t", "instruction": "x"}).limits == {}
    for bad, says in [({"memory": "lots"}, "t: limits.memory must be a size"),
                      ({"pids": 3}, "t: limits.pids must be at least 16"),
                      ({"cpus": "two"}, "t: limits.cpus must be a number of CPUs"),
                      ({"nofile": 1.5}, "t: limits.nofile must be an integer"),
                      ({"memory": "1MiB"}, "t: limits.memory must be at least 32 MiB"),
                      ({"swap": 1}, "t: limits: unknown field(s) swap"),
                      ("2GiB", "t: limits must be an object")]:
        with pytest.raises(TaskError, match=None) as e:
            parse_task({"task_id": "t", "instruction": "x", "limits": bad})
        assert str(e.value).startswith(says), (bad, str(e.value))
    assert parse_options(["memory=1GiB", "pids=100", "cpus=2"]) == {"memory": 1 << 30, "pids": 100, "cpus": 2.0}
    with pytest.raises(ValueError, match="--session-limit.disk must be a size"):
        parse_options(["disk=big"])
    assert parse_limits(None) == {}


def test_tmpfs_sizes_go_on_bwraps_writable_tmpfs_mounts_only():
    argv = ["/usr/bin/nsenter", "--net=x", "--", "/usr/bin/bwrap", "--args", "3", "--dev", "/dev", "--tmpfs",
            "/dev/shm", "--tmpfs", "/etc/ssh", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp", "--chdir", "/w", "--",
            "sh", "-c", "--tmpfs", "/tmp"]
    got = bw.sized(argv, "/usr/bin/bwrap", 1024)
    assert got == ["/usr/bin/nsenter", "--net=x", "--", "/usr/bin/bwrap", "--args", "3", "--dev", "/dev",
                   "--size", "1024", "--tmpfs", "/dev/shm", "--tmpfs", "/etc/ssh", "--size", "1024", "--tmpfs",
                   "/tmp", "--size", "1024", "--tmpfs", "/var/tmp", "--chdir", "/w", "--", "sh", "-c", "--tmpfs",
                   "/tmp"]
    assert bw.sized(got, "/usr/bin/bwrap", 1024) == got      # once
    assert bw.sized(["sh", "-c", "x"], "/usr/bin/bwrap", 1) == ["sh", "-c", "x"]


V1_MOUNTINFO = """\
30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory
31 25 0:27 / /sys/fs/cgroup/pids rw,relatime shared:10 - cgroup cgroup rw,pids
32 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:11 - cgroup cgroup rw,cpu,cpuacct
33 25 0:29 / /sys/fs/cgroup/unified rw,relatime shared:12 - cgroup2 cgroup2 rw
"""


def _fake_mounts(tmp_path: Path, text: str) -> str:
    return text.replace(" /sys/fs/cgroup", f" {tmp_path}/cg")


def test_cgroup_layouts_v1_with_separate_hierarchies_and_v2_delegated(tmp_path):
    """The files each version writes, on a stand-in tree (the kernel's own is used by the test above)."""
    for d in ("memory/node", "pids/node", "cpu,cpuacct/node", "unified/node"):
        (tmp_path / "cg" / d).mkdir(parents=True)
    (tmp_path / "cg/unified/node/cgroup.controllers").write_text("")        # v2 without controllers
    own = "4:memory:/node\n3:pids:/node\n2:cpu,cpuacct:/node\n0::/node\n"
    h = cgroups.detect(_fake_mounts(tmp_path, V1_MOUNTINFO), own, 4242)
    assert h.version == 1 and h.parents == {c: tmp_path / "cg" / m / "node/polar-4242" for c, m in
                                            [("memory", "memory"), ("pids", "pids"), ("cpu", "cpu,cpuacct")]}
    lim = Limits(memory=64 * MIB, pids=32, cpus=0.5)
    cg = cgroups.SessionCgroup(h, lim, name="s-1")
    assert (h.parents["memory"] / "s-1/memory.limit_in_bytes").read_text() == str(64 * MIB)
    assert (h.parents["pids"] / "s-1/pids.max").read_text() == "32"
    assert (h.parents["cpu"] / "s-1/cpu.cfs_quota_us").read_text() == "50000"
    assert [p.parent.name for p in cg.procs] == ["s-1"] * 3
    (h.parents["memory"] / "s-1/memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    (h.parents["memory"] / "s-1/memory.max_usage_in_bytes").write_text(str(64 * MIB))
    hit = cg.hit()
    assert hit is not None and hit.name == "memory" and "exceeded its memory limit (64 MiB)" in hit.reason
    assert cg.hit() is None                 # counted once
    (h.parents["pids"] / "s-1/pids.events").write_text("max 3\n")
    assert (hit := cg.hit()) is not None and hit.name == "pids"
    # v2: the unified hierarchy with memory and pids, delegated below this process's cgroup
    (tmp_path / "cg/unified/node/cgroup.controllers").write_text("cpuset cpu io memory pids")
    h2 = cgroups.detect(_fake_mounts(tmp_path, V1_MOUNTINFO), own, 4242)
    parent = tmp_path / "cg/unified/node/polar-4242"
    assert h2.version == 2 and set(h2.parents.values()) == {parent}
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    cg2 = cgroups.SessionCgroup(h2, lim, name="s-2")
    assert (parent / "s-2/memory.max").read_text() == str(64 * MIB)
    assert (parent / "s-2/pids.max").read_text() == "32" and (parent / "s-2/cpu.max").read_text() == "50000 100000"
    assert cg2.procs == [parent / "s-2/cgroup.procs"]
    (parent / "s-2/memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    assert (hit := cg2.hit()) is not None and hit.name == "memory"
    # neither
    none = cgroups.detect("", "0::/\n", 4242)
    assert not none.enabled and "no cgroup hierarchy" in none.why


@needs_cgroups
def test_a_killed_nodes_cgroups_are_removed_by_the_next_start(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    h = cgroups.host()
    made = [p.parent / f"{cgroups.PREFIX}{dead.pid}" / "s-left" for p in h.parents.values()]
    for d in made:
        d.mkdir(parents=True)
    cgroups.sweep(h)
    assert not any(d.parent.exists() for d in made)
    assert all(p.exists() for p in h.parents.values())        # this process's own stay
