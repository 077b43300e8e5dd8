"""A real rollout for the dashboard's tests: an agent harness of ours (bash_agent.py: a system
prompt and one `bash` tool, over the OpenAI chat API through the proxy) in a workspace, run
by a rollout server and a gateway node through a mitmdump against the scripted stand-in
backend the test gives. Its database is what the dashboard reads."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from support import SUPPORT
from support.fake_vllm import FakeVLLM
from support.mitmdump_proxy import Proxy
from support.rollouts import Rollouts

AGENT = (SUPPORT / "bash_agent.py").read_text()


class AgentRollout:
    """backend: up already (stopped with the rest); evaluator: the tasks' (it runs in the
    finished workspace, $POLAR_SAMPLE says which sample)."""

    def __init__(self, root: Path, backend: FakeVLLM, evaluator: str):
        self.root, self.backend, self.evaluator = root, backend, evaluator
        self.ws = root / "repo"
        self.ws.mkdir()
        (self.ws / "agent.py").write_text(AGENT)
        self.proxy = Proxy(root, backend.url, db_name="rollouts.duckdb")
        self.db = str(self.proxy.db)
        try:
            self.rollouts = Rollouts(self.proxy, root / "sessions", backend_url=backend.url)
        except BaseException:   # what started so far must not outlive a failed start
            self.proxy.stop()
            backend.down()
            raise
        self.server = self.rollouts.server

    def task(self, task_id: str, samples: int) -> dict:
        return {"task_id": task_id, "instruction": f"Prove the shell works ({task_id}).", "harness": "command",
                "workspace": str(self.ws), "num_samples": samples, "timeout": 120,
                "command": f"{sys.executable} agent.py", "evaluator": self.evaluator}

    def run(self, tasks: dict[str, int], timeout: float = 90) -> None:
        """Runs these tasks (task id: samples) to the end."""
        self.rollouts.run([self.task(t, n) for t, n in tasks.items()], timeout)

    def stop(self, *first: Callable[[], None]) -> None:
        """`first` (what the test started on top), then the node, the server, the proxy and
        the backend: each one whatever the others' stops raised."""
        for stop in (*first, self.rollouts.stop, self.proxy.stop, self.backend.down):
            try:
                stop()
            except Exception as e:     # the others still stop
                print(f"stopping: {e!r}", file=sys.stderr)
