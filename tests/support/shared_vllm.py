"""The test run's one real vLLM server, started in the background as soon as the run knows
it will need it, so its warm-up (minutes on CPU) overlaps the tests that do not.

The process that owns the run starts it: pytest's own process, or pytest-xdist's controller
(which sees every worker's collection). It writes what it knows to a small JSON state file,
$POLAR_TEST_VLLM_STATE, that the workers inherit: {"url", "log"} at once, then "ready": true
or "error". The vllm_backend fixture waits on that file (tests/conftest.py), and the owner
stops the server when the session ends; if the owner is killed, the janitor (which
launch.Service tells about every service) ends it."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from polar_mitm.stack import launch

STATE_ENV = "POLAR_TEST_VLLM_STATE"
WAIT_S = 1800.0     # warm-up on a loaded CPU machine plus the worst start we saw, with room


def write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)   # readers never see half a file


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


class SharedVLLM:
    """Started once by the run's owner (start() returns at once)."""

    def __init__(self, state: Path):
        self.state = state
        self.service: launch.Service | None = None
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            write_json(self.state, {"starting": True})
            self._thread = threading.Thread(target=self._run, name="shared-vllm", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        from polar_mitm.models import DEFAULT_MODEL_NAME, ensure_default_model

        log = self.state.with_name("vllm.log")
        state: dict = {"log": str(log)}
        try:
            model_dir = ensure_default_model()
            port = launch.free_port()
            state["url"] = f"http://127.0.0.1:{port}"
            write_json(self.state, state)
            self.service = launch.start_vllm(model_dir, port=port, served_name=DEFAULT_MODEL_NAME, log_path=log,
                                             chat_template=launch.TEMPLATES / "smollm2_tools.jinja")
            state["ready"] = True
        except BaseException as e:   # noqa: BLE001  (every waiting test reports it)
            state["error"] = f"{type(e).__name__}: {e}"
        write_json(self.state, state)

    def stop(self) -> None:
        """Stops a started server. One still warming up ends with this process (janitor)."""
        if self.service is not None:
            self.service.stop()
            self.service = None


def wait(path: Path, timeout: float = WAIT_S) -> str:
    """The shared server's URL once it answers; its start's error, or a timeout, as an error."""
    deadline = time.monotonic() + timeout
    state = read(path) or {}
    while time.monotonic() < deadline:
        state = read(path) or {}
        if state.get("ready"):
            return state["url"]
        if "error" in state:
            break
        time.sleep(0.5)
    tail = ""
    if state.get("log") and Path(state["log"]).exists():
        tail = "\n".join(Path(state["log"]).read_text(errors="replace").splitlines()[-30:])
    why = state.get("error") or f"not ready after {timeout:.0f} s"
    raise RuntimeError(f"the shared vLLM server did not start: {why}\n{tail}")
