"""The test run's layout: the real vLLM server and how pytest-xdist hands out the tests.
tests/conftest.py's hooks call these functions.

The real vLLM server (tests that take the vllm_backend fixture, or carry the vllm marker) is
one per run, shared: set POLAR_TEST_BACKEND to reuse a server someone started; otherwise the
run's owner (pytest's own process, or pytest-xdist's controller) starts it in the background
as soon as the collection shows a test that needs it (shared_vllm.py), so its warm-up
(minutes on CPU) overlaps the tests that do not need it. Nothing starts it ahead of the run.

In parallel (scripts/test.sh runs `-n`), every test that needs vLLM is one unit of work
(VLLMGroupScheduling): they run one after another in one worker, as they would alone (two of
them reload the server's weights and put the base ones back). Each worker writes the ids of
its vLLM tests into the run's folder ($POLAR_TEST_RUN) as it collects; the controller reads
them to group the tests and to start the server. (xdist's own loadgroup renames node ids,
which pytest 9.2 no longer allows: its groups silently fall apart.)
Each worker picks ports from its own slice (launch.free_ports, $POLAR_PORT_SLICE), so two
workers never hand the same free port to their services."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from support import shared_vllm

VLLM_GROUP = "vllm"
RUN_ENV = "POLAR_TEST_RUN"     # the run's folder: the shared server's state and log, the workers' lists of vLLM tests
# files whose module-scoped fixture is a whole rollout (and a browser): one worker runs all of
# such a file's tests, so that the fixture is built once, not once per worker
ONE_WORKER_FILES = {"tests/dashboard/test_dashboard_browser.py", "tests/dashboard/test_dashboard_api.py",
                    "tests/store/test_export_sft.py", "tests/cluster/test_ray_loop.py",
                    "tests/cluster/test_trainer_host.py"}
_SHARED: shared_vllm.SharedVLLM | None = None     # the run owner's server, once started


def _worker(config) -> bool:
    return hasattr(config, "workerinput")


def _distributed(config) -> bool:
    return getattr(config.option, "dist", "no") != "no" and bool(getattr(config.option, "tx", None))


def needs_vllm(item) -> bool:
    return "vllm_backend" in getattr(item, "fixturenames", ()) or item.get_closest_marker("vllm") is not None


def configure(config) -> None:
    """A worker takes its slice of ports; the run's owner makes the run's folder and, unless
    a server is given or it only collects, the shared server (not started yet)."""
    global _SHARED
    if _worker(config):
        wid, count = config.workerinput["workerid"], config.workerinput["workercount"]
        os.environ["POLAR_PORT_SLICE"] = f"{int(wid.removeprefix('gw'))}/{count + 1}"
        return
    run = Path(tempfile.mkdtemp(prefix="polar-test-run-"))
    os.environ[RUN_ENV] = str(run)      # the workers inherit it
    if _distributed(config):
        os.environ["POLAR_PORT_SLICE"] = f"{len(config.option.tx)}/{len(config.option.tx) + 1}"
    if not os.environ.get("POLAR_TEST_BACKEND") and not config.option.collectonly:
        os.environ[shared_vllm.STATE_ENV] = str(run / "state.json")
        _SHARED = shared_vllm.SharedVLLM(run / "state.json")


def mark_and_order(config, items) -> None:
    """Marks the tests that need vLLM; a worker writes their ids for the controller; alone,
    they go last, so the server warms up while the others run."""
    vllm = [item for item in items if needs_vllm(item)]
    for item in vllm:
        item.add_marker(pytest.mark.vllm)
    if _worker(config) and os.environ.get(RUN_ENV):
        # read by the controller before it hands out any test (VLLMGroupScheduling)
        shared_vllm.write_json(Path(os.environ[RUN_ENV]) / f"vllm-tests.{config.workerinput['workerid']}.json",
                               [item.nodeid for item in vllm])
    if vllm and not _worker(config) and not _distributed(config):
        others = [item for item in items if not needs_vllm(item)]
        items[:] = others + vllm


def start_if_needed_alone(session) -> None:
    """Alone: start the server when a test that is left after deselection needs it."""
    if _SHARED is not None and not _worker(session.config) and not _distributed(session.config) \
            and any(needs_vllm(item) for item in session.items):
        _SHARED.start()


def _vllm_tests(worker: str) -> set[str]:
    """The ids of the tests that need vLLM, as the worker collected them."""
    try:
        return set(json.loads((Path(os.environ[RUN_ENV]) / f"vllm-tests.{worker}.json").read_text()))
    except (KeyError, FileNotFoundError):
        return set()


def start_if_worker_needs(node) -> None:
    """In the controller, before any test is handed out: start the server if a worker
    collected a test that needs it."""
    if _SHARED is not None and _vllm_tests(node.gateway.id):
        _SHARED.start()


def make_scheduler(config, log):
    """`-n N` (xdist's --dist load) by units of work: the tests that need vLLM are one unit,
    every other test is a unit of its own (but ONE_WORKER_FILES). The largest unit is handed
    out first, so the vLLM tests start at once and wait for the warm-up while the other
    workers go on. None: another --dist was asked for, xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VLLMGroupScheduling(LoadScopeScheduling):
        _vllm: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._vllm is None:     # first called once every worker has collected
                self._vllm = set().union(*(_vllm_tests(node.gateway.id) for node in self.nodes))
            if nodeid in self._vllm:
                return VLLM_GROUP
            file = nodeid.split("::", 1)[0]
            return file if file in ONE_WORKER_FILES else nodeid

    return VLLMGroupScheduling(config, log)


def finish(session) -> None:
    """The owner stops the server and removes the run's folder (kept, with the server's log,
    when the server failed)."""
    if _worker(session.config):
        return
    if _SHARED is not None:
        _SHARED.stop()
        if (shared_vllm.read(_SHARED.state) or {}).get("error"):
            return
    shutil.rmtree(os.environ[RUN_ENV], ignore_errors=True)
