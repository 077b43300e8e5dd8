"""scripts/slurm/polar_loop.sbatch, run by a real Slurm: a one-node cluster (munged, slurmctld,
slurmd from Debian's slurm-wlm) started here in a temporary directory, the script submitted with
a stand-in for the loop (POLAR_LOOP_CMD), and what the stand-in saw from inside the allocation:
a Ray head sized by the allocation, offering `polar_node`, with token authentication on and the
token on no command line; a clean stop (SIGTERM to the script, passed on to the loop) whose exit
status becomes the job's; and no Ray process left once the job has ended.

The end-to-end test skips only where Slurm cannot run: slurm-wlm not installed (scripts/install.sh
installs it where it can, as root), not root (slurmd must be), or the daemons do not come up (the reason, with their
log, is the skip's message). The script's own checks need no Slurm and always run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support.procs import until

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm" / "polar_loop.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}

# Runs on the head as the loop would (POLAR_LOOP_CMD): connects as the driver does, reports,
# then waits for the SIGTERM that `scancel --batch --signal=TERM` gives the script and exits 143
# as the loop does, so that the test sees the signal passed on and the status become the job's.
STAND_IN = r'''
import glob, json, os, signal, sys, threading
import ray
ray.init(address="auto", log_to_driver=False)
# after ray.init: it installs Ray's own SIGTERM handler (exit 15), over one set before
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
token = os.environ.get("RAY_AUTH_TOKEN", "")
on_argv = 0
for path in glob.glob("/proc/[0-9]*/cmdline"):
    try:
        with open(path, "rb") as f:
            on_argv += bool(token) and token.encode() in f.read()
    except OSError:
        pass
nodes = [n for n in ray.nodes() if n["Alive"]]
print("POLAR_STAND_IN " + json.dumps({
    "resources": ray.cluster_resources(), "node_ips": [n["NodeManagerAddress"] for n in nodes],
    "auth_mode": os.environ.get("RAY_AUTH_MODE"), "token_len": len(token), "token_on_argv": on_argv,
    "ray_tmpdir": os.environ.get("RAY_TMPDIR"), "job": os.environ.get("SLURM_JOB_ID")}), flush=True)
got = stop.wait(60)
print(f"stand-in: SIGTERM {'received' if got else 'never came'}", flush=True)
ray.shutdown()
sys.exit(143 if got else 7)
'''


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _free_port() -> int:
    """A free loopback port outside 10002-19999 (Ray's worker ports)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not 10002 <= port <= 19999:
            return port


def _ours(marker: str) -> list[int]:
    """Live processes whose command line or environment names marker (this test's directory):
    Ray's processes rename themselves (ray::IDLE), but keep the RAY_TMPDIR they were given."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
            blob = b""
            for part in ("cmdline", "environ"):
                with open(f"/proc/{pid}/{part}", "rb") as f:
                    blob += f.read()
        except OSError:
            continue
        if marker.encode() in blob:
            found.append(int(pid))
    return found


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class OneNodeSlurm:
    """munged + slurmctld + slurmd for this machine alone, every file under `base`, on loopback
    ports of their own; stop() ends all three."""

    def __init__(self, base: Path):
        self.base = base
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(base / "slurm.conf")

    def _write_config(self) -> None:
        b = self.base
        for d in ("munge", "state", "spool"):
            (b / d).mkdir(mode=0o700)
        key = b / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        (b / "plugstack.conf").write_text("")
        (b / "slurm.conf").write_text(f"""\
ClusterName=polartest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
# bind to the address the names resolve to (127.0.0.1), not to every interface
CommunicationParameters=NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={b}/munge/munge.socket
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd.pid
SlurmctldLogFile={b}/slurmctld.log
SlurmdLogFile={b}/slurmd.log
PlugStackConfig={b}/plugstack.conf
MailProg=/bin/true
# no cgroups: processes tracked by parentage, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.base / f"{name}.out", "wb")
        self.procs.append((name, subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                  env=self.env, start_new_session=True)))

    def _node_state(self) -> str:
        out = subprocess.run([_tool("sinfo"), "-h", "-n", self.node, "-o", "%t"], env=self.env,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip()

    def start(self) -> str | None:
        """None once the node takes jobs, else why not (with the daemons' logs)."""
        self._write_config()
        m = self.base / "munge"
        self._spawn("munged", [_tool("munged"), "--foreground", "--force", f"--socket={m}/munge.socket",
                               f"--key-file={m}/munge.key", f"--log-file={m}/munged.log",
                               f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed"])
        if not until(lambda: (m / "munge.socket").exists() or self._dead(), 10) or self._dead():
            return self._why("munged did not start")
        self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-i"])
        self._spawn("slurmd", [_tool("slurmd"), "-D", "-N", self.node])
        if not until(lambda: self._dead() or self._node_state() == "idle", 30):
            return self._why(f"the node is '{self._node_state()}', not idle, after 30 s")
        return self._why("a daemon exited") if self._dead() else None

    def _dead(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    def _why(self, what: str) -> str:
        logs = "\n".join(f"--- {name} (exit {p.poll()}):\n{_tail(self.base / f'{name}.out')}"
                         for name, p in self.procs)
        return f"one-node Slurm did not start here: {what}\n{logs}"

    def stop(self) -> None:
        for _name, p in reversed(self.procs):     # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


@pytest.fixture
def slurm():
    missing = [d for d in DAEMONS if not _tool(d)]
    if missing:
        pytest.skip(f"slurm-wlm is not installed (no {', '.join(missing)}): apt-get install slurm-wlm")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start job steps, and this test is not root")
    # A short base, not tmp_path: Slurm's and Ray's socket paths must fit in 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="polar-slurm-"))
    cluster = OneNodeSlurm(base)
    try:
        problem = cluster.start()
        if problem:
            pytest.skip(problem)
        yield cluster
    finally:
        cluster.stop()
        for pid in _ours(str(base)):           # what the job should have ended, if it did not
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def _job_state(env: dict, job: str) -> dict[str, str]:
    out = subprocess.run([_tool("scontrol"), "show", "job", "-o", job], env=env, capture_output=True,
                         text=True, timeout=10).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def test_the_sbatch_script_starts_a_ray_head_with_polar_node_inside_the_allocation(slurm):
    base = slurm.base
    stand_in = base / "stand_in.py"
    stand_in.write_text(STAND_IN)
    env = {k: v for k, v in slurm.env.items() if not k.startswith(("RAY_", "POLAR_"))}
    env.update({
        "POLAR_HOME": str(ROOT), "POLAR_VENV": str(Path(sys.executable).parent.parent),
        "POLAR_LOOP_CMD": f"exec {sys.executable} {stand_in}",
        "RAY_TMPDIR": str(base / "ray"),
        # one node: keep Ray on loopback (Ray refuses workers with this set; there are none)
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "POLAR_RAY_PORT": str(_free_port()),
        # ports of this test's own, should another Ray run on this machine
        "POLAR_RAY_START_ARGS": f"--dashboard-agent-listen-port={_free_port()} --object-store-memory={100 << 20}",
        "POLAR_RAY_HEAD_ARGS": f"--include-dashboard=false --ray-client-server-port={_free_port()}",
        "POLAR_RAY_WAIT_S": "60"})
    # One CPU of the node's: Ray must count the allocation's, not the machine's.
    submit = subprocess.run([_tool("sbatch"), "--parsable", "--nodes=1", "--cpus-per-task=1",
                             f"--output={base}/job-%j.out", str(SBATCH)],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]

    log_file = base / f"job-{job}.out"

    def log() -> str:
        return log_file.read_text(errors="replace") if log_file.exists() else ""

    # Slurm has no event a client can wait on (sbatch --wait itself polls, every 2-32 s): poll
    # the job's log for the stand-in's report, then its state for the end.
    reported = until(lambda: "POLAR_STAND_IN " in log() or _job_state(env, job).get("JobState") in TERMINAL, 90)
    assert reported and "POLAR_STAND_IN " in log(), f"job {job}: no report from the stand-in:\n{log()[-3000:]}"
    # A clean stop, as before a time limit: SIGTERM to the batch script only, which passes it on.
    cancel = subprocess.run([_tool("scancel"), "--batch", "--signal=TERM", job], env=env, capture_output=True,
                            text=True, timeout=30)
    assert cancel.returncode == 0, cancel.stderr
    state: dict[str, str] = {}

    def ended() -> bool:
        nonlocal state
        state = _job_state(env, job)
        return state.get("JobState") in TERMINAL
    assert until(ended, 60), f"job {job} still {state.get('JobState')} 60 s after SIGTERM:\n{log()[-3000:]}"
    text = log()

    report = [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("POLAR_STAND_IN ")]
    assert report, f"the stand-in printed nothing:\n{text[-3000:]}"
    seen = report[0]
    print(text)                                                # shown with -s: the job's log
    assert seen["job"] == job
    assert seen["resources"]["polar_node"] == 1.0              # the head runs sessions (one node)
    assert seen["resources"]["CPU"] == 1.0                     # the allocation's CPUs, not the machine's
    assert seen["resources"].get("GPU", 0) == 0                # no GPU allocated: none counted
    assert seen["node_ips"] == ["127.0.0.1"]                   # one node, on loopback
    assert seen["ray_tmpdir"] == f"{base}/ray/ray-{job}"       # Ray's files under RAY_TMPDIR, per job
    assert any(Path(seen["ray_tmpdir"], "ray").glob("session_*/logs/raylet.out"))
    assert seen["auth_mode"] == "token" and seen["token_len"] == 64
    assert seen["token_on_argv"] == 0                          # the token is in no process's argv

    assert f"ray_node.sh: head on {slurm.node}: 1 CPUs, 0 GPUs, polar_node=1" in text
    assert "wait_for_ray: 1/1 nodes alive" in text
    assert "stand-in: SIGTERM received" in text                # passed on by the script
    assert "the loop exited with status 143" in text
    assert state["ExitCode"] == "143:0", state                 # the loop's status is the job's
    # Nothing of the job outlives it: its Ray is stopped (the script's trap, then Slurm's step end).
    assert until(lambda: not _ours(str(base / "ray")), 15), [
        Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in _ours(str(base / "ray"))]


def test_outside_slurm_the_script_says_to_submit_it():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "submit it with sbatch" in out.stderr


@pytest.mark.parametrize("unset, message", [("POLAR_TASKS", "set POLAR_TASKS"), ("POLAR_OUT", "set POLAR_OUT"),
                                            ("POLAR_ITERATIONS", "set POLAR_ITERATIONS")])
def test_a_missing_setting_stops_the_job_before_any_node_starts(tmp_path, unset, message):
    """Checked before Ray starts: no srun runs (there is none on PATH here to run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "POLAR_"))}
    env.update({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "PATH": str(tmp_path) + ":/usr/bin:/bin",
                "POLAR_TASKS": "tasks.jsonl", "POLAR_OUT": "run", "POLAR_ITERATIONS": "3"})
    del env[unset]
    for tool in ("srun", "scontrol", "scancel"):                # a stand-in that records any call
        (tmp_path / tool).write_text(f"#!/bin/sh\necho {tool} >> {tmp_path}/called\nexit 1\n")
        (tmp_path / tool).chmod(0o755)
    out = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert message in out.stderr
    assert not (tmp_path / "called").exists()


def test_the_scripts_parse():
    for script in ("polar_loop.sbatch", "ray_node.sh"):
        out = subprocess.run(["bash", "-n", str(SBATCH.parent / script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
