"""`polar-train loop` as a child process (LoopRun), and the fake harness's two tasks, for
the tests that run the loop whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from support import SUPPORT

HERE = SUPPORT
TRAIN = str(Path(sys.executable).parent / "polar-train")


class LoopRun:
    """`polar-train loop` as a child process, its output collected as it comes."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env=env, cwd=cwd)
        self.output = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for chunk in iter(lambda: self.proc.stdout.read(1), ""):
            self.output += chunk

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code


def fake_tasks(tmp_path: Path, harness_args: str) -> Path:
    """Two tasks run by the fake harness (its arguments given), the sample index as reward."""
    harness = f"{sys.executable} {HERE / 'fake_harness.py'} {harness_args}"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"task_id": t, "instruction": "hi", "timeout": 60, "command": harness,
                                           "evaluator": "echo $POLAR_SAMPLE"}) for t in ("a", "b")) + "\n")
    return tasks
