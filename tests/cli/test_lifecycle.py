"""Every long-running command lives one life (cli/lifecycle.py's LongRunning): started as
a user starts it, then stopped with SIGTERM it exits 143 and with Ctrl-C (SIGINT) 130, with
no traceback, and what it started stops with it. Stand-ins keep each start cheap: a fake vLLM,
a tiny model, a harness that only sleeps."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

import httpx
import pytest

from support.fake_vllm import FakeVLLM
from support.grpo_data import synthetic_calls, tiny_model_dir, write_calls
from support.procs import alive, token, until
from polar_mitm.cli.lifecycle import LongRunning, interrupted_exit_code
from polar_mitm.stack import launch
from polar_mitm.stack.local import Stack
from polar_mitm.store import init_db
from polar_mitm.store.training import set_rewards

BIN = Path(sys.executable).parent
POLAR, TRAIN = str(BIN / "polar-mitm"), str(BIN / "polar-train")


class StandIns:
    """What the commands run against, shared by the module's tests, each made when first asked
    for (a test of one command makes only its own)."""

    def __init__(self, here: Path, started: ExitStack):
        self.here, self.started = here, started
        self.sleep = token()     # the harness's sleep: none may outlive its command

    @cached_property
    def backend(self) -> str:
        """A fake vLLM's root URL."""
        return self.started.enter_context(FakeVLLM()).url

    @cached_property
    def server(self) -> str:
        """A rollout server's root URL, for `node`."""
        stack = self.started.enter_context(Stack())
        return stack.start_server(str(self.here / "server.duckdb"), port=0).url

    @cached_property
    def model(self) -> Path:
        return tiny_model_dir(self.here / "model")

    @cached_property
    def rewarded(self) -> Path:
        """A database of rewarded sessions, for `train`."""
        db = self.here / "rewarded.duckdb"
        calls = synthetic_calls()
        write_calls(db, calls)
        set_rewards(db, [{"session_id": c.session_id, "reward": c.reward} for c in calls])
        return db

    @cached_property
    def tasks(self) -> Path:
        """Two tasks whose harness sleeps until it is stopped."""
        tasks = self.here / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"task_id": t, "instruction": "x", "harness": "command",
                                             "command": f"sleep {self.sleep}", "evaluator": "echo 1"}) + "\n"
                                 for t in "ab"))
        return tasks


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    with ExitStack() as started:
        yield StandIns(tmp_path_factory.mktemp("stand-ins"), started)


@dataclass(frozen=True)
class Command:
    argv: list[str]
    ready: Callable[[str], bool]     # on what it printed so far: it runs
    env: dict[str, str] = field(default_factory=dict)
    stopped: Callable[[], bool] | None = None   # what must hold within 5 s of its exit


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _closed(*ports: int) -> bool:
    for port in ports:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return False
    return True


def _printed(text: str) -> Callable[[str], bool]:
    return lambda out: text in out


def _exists(path: Path) -> Callable[[str], bool]:
    return lambda out: path.exists()


def up(tmp: Path, s: StandIns) -> Command:
    # signalled once its proxy served a call; within 5 s of its exit mitmdump is gone and
    # neither port listens (a proxy left behind would hold the database)
    port, reverse = launch.free_ports(2)
    return Command([POLAR, "up", "--db", str(tmp / "r.duckdb"), "--backend", s.backend, "--port", str(port),
                    "--reverse-port", str(reverse), "--confdir", str(tmp / "conf")],
                   lambda out: "point a base URL" in out and _answers(f"http://127.0.0.1:{reverse}/v1/models"),
                   {"POLAR_MITM_CACHE": str(tmp / "cache")},     # its logs
                   lambda: not alive(str(tmp)) and _closed(port, reverse))


def dashboard(tmp: Path, s: StandIns) -> Command:
    init_db(tmp / "r.duckdb")
    return Command([POLAR, "dashboard", "--db", str(tmp / "r.duckdb"), "--port", str(launch.free_port())],
                   _printed("dashboard of"))


def rollout(tmp: Path, s: StandIns) -> Command:
    return Command([POLAR, "rollout", str(s.tasks), "--db", str(tmp / "r.duckdb"), "--backend", s.backend,
                    "--workers", "1"], _printed("rollout server http"))


def rollout_server(tmp: Path, s: StandIns) -> Command:
    return Command([POLAR, "rollout-server", "--db", str(tmp / "r.duckdb"), "--port", "0"],
                   _printed("rollout server on"))


def node(tmp: Path, s: StandIns) -> Command:
    # stopped once the server heard from it: a node at work, not one still starting
    name = f"node-{token()}"
    return Command([POLAR, "node", "--server", s.server, "--backend", s.backend, "--db", str(tmp / "node.duckdb"),
                    "--workers", "1", "--node-id", name],
                   lambda out: "proxy on 127.0.0.1:" in out and name in httpx.get(f"{s.server}/status").json()["nodes"])


def demo(tmp: Path, s: StandIns) -> Command:
    # the loop's state is saved once its checks passed: it runs
    return Command([POLAR, "demo", "--backend", s.backend, "--out", str(tmp / "run")],
                   _exists(tmp / "run" / "loop.json"))


def loop(tmp: Path, s: StandIns) -> Command:
    return Command([TRAIN, "loop", "--tasks", str(s.tasks), "--iterations", "1", "--out", str(tmp / "run"),
                    "--samples", "2", "--backend", s.backend, "--model", str(s.model), "--workers", "1",
                    "--max-tokens", "8"], _exists(tmp / "run" / "loop.json"))


def train(tmp: Path, s: StandIns) -> Command:
    # epochs enough to train for minutes: the signal comes first
    return Command([TRAIN, "train", "--db", str(s.rewarded), "--model", str(s.model), "--out", str(tmp / "run"),
                    "--epochs", "100000", "--token-budget", "32"], _printed("rewarded sessions"))


COMMANDS = [up, dashboard, rollout, rollout_server, node, demo, loop, train]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("command", COMMANDS, ids=[c.__name__.replace("_", "-") for c in COMMANDS])
def test_a_long_running_command_exits_143_on_sigterm_and_130_on_ctrl_c(command, sig, code, stand_ins, tmp_path):
    started = command(tmp_path, stand_ins)
    log = tmp_path / "output.txt"
    with log.open("w") as out:
        # Started as a script's background job is (`nohup ... &`), with SIGINT ignored: Python
        # would keep ignoring Ctrl-C, and the command must take it back. In its own session:
        # what it leaves behind when the test fails can be killed with it.
        p = subprocess.Popen(started.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, **started.env},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert until(lambda: started.ready(log.read_text()) or p.poll() is not None, 120), log.read_text()
        assert p.poll() is None, log.read_text()
        p.send_signal(sig)
        assert p.wait(60) == code, log.read_text()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    said = log.read_text()
    assert "Traceback" not in said and "Aborted!" not in said, said
    if started.stopped is not None:
        assert until(started.stopped, 5), "still running or listening 5 s after the exit"
    # what it started stopped with it (the proxy, the rollout server, a node, their harnesses)
    assert until(lambda: not alive(str(tmp_path)) and not alive(stand_ins.sleep), 15), \
        (alive(str(tmp_path)), alive(stand_ins.sleep))


# -- the lifecycle itself, in this process --------------------------------------------------------------
@pytest.fixture
def handlers_kept():
    """LongRunning installs its SIGINT and SIGTERM handlers for good: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


class Part:
    def __init__(self, name: str, stopped: list[str], fails: BaseException | None = None):
        self.name, self.stopped, self.fails = name, stopped, fails

    def stop(self) -> None:
        self.stopped.append(self.name)
        if self.fails is not None:
            raise self.fails


def test_what_a_command_started_stops_once_last_first_and_a_signal_is_its_exit_code(handlers_kept, capsys):
    stopped: list[str] = []
    with pytest.raises(SystemExit) as ended:
        with LongRunning("the run stopped") as life:
            life.stops(Part("server", stopped))
            life.stops(Part("proxy", stopped, fails=RuntimeError("already gone")))
            life.on_stop(lambda: stopped.append("streams"))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)          # the handler raises here
    assert ended.value.code == 143
    assert stopped == ["streams", "proxy", "server"]     # every one, though one failed
    assert capsys.readouterr().err.splitlines() == ["while stopping: RuntimeError: already gone",
                                                   "interrupted (SIGTERM): the run stopped"]
    assert interrupted_exit_code(KeyboardInterrupt()) == 130     # the signal was that command's only


def test_an_interrupt_a_library_turned_into_its_own_error_still_exits_with_the_signal(handlers_kept, capsys):
    """DuckDB turns the handler's KeyboardInterrupt into RuntimeError('Query interrupted')."""
    with pytest.raises(SystemExit) as ended:
        with LongRunning():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                raise RuntimeError("Query interrupted") from None
    assert ended.value.code == 130 and capsys.readouterr().err == ""


def test_a_failed_stop_after_a_run_that_ended_well_exits_1_saying_why(handlers_kept, capsys):
    with pytest.raises(SystemExit) as ended:
        with LongRunning() as life:
            life.stops(Part("proxy", [], fails=OSError("port still held")))
    assert ended.value.code == 1
    assert capsys.readouterr().err == "while stopping: OSError: port still held\n"
    with LongRunning() as life:        # nothing failed: nothing to say, no exit
        life.stops(Part("proxy", []))
