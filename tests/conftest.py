"""Fixtures and the test run's layout.

The real vLLM server (tests that take the vllm_backend fixture, or carry the vllm marker) is
one per run, shared: set POLAR_TEST_BACKEND to reuse a server someone started; otherwise the
run's owner (pytest's own process, or pytest-xdist's controller) starts it in the background
as soon as the collection shows a test that needs it (tests/support/shared_vllm.py), so its warm-up
(minutes on CPU) overlaps the tests that do not need it. Nothing starts it ahead of the run.

In parallel (scripts/test.sh runs `-n`), every test that needs vLLM is one unit of work
(VLLMGroupScheduling): they run one after another in one worker, as they would alone (two of
them reload the server's weights and put the base ones back). Each worker writes the ids of
its vLLM tests into the run's folder ($POLAR_TEST_RUN) as it collects; the controller reads
them to group the tests and to start the server. (xdist's own loadgroup renames node ids,
which pytest 9.2 no longer allows: its groups silently fall apart.)
Each worker picks ports from its own slice (launch.free_ports, $POLAR_PORT_SLICE), so two
workers never hand the same free port to their services."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from support import shared_vllm
from support.inprocess_proxy import InProcessProxy, ProxyLayout
from polar_mitm.stack import launch
from polar_mitm.models import DEFAULT_MODEL_NAME, ensure_default_model
from support.provider_server import ProviderServer

# Session sandboxes (bwrap) see the node's system and Python read-only, and of the rest only
# what is exposed: the stand-in harnesses here (fake_harness.py) run inside them.
os.environ.setdefault("POLAR_SANDBOX_EXPOSE", str(Path(__file__).parent))

VLLM_GROUP = "vllm"
RUN_ENV = "POLAR_TEST_RUN"     # the run's folder: the shared server's state and log, the workers' lists of vLLM tests
_SHARED: shared_vllm.SharedVLLM | None = None     # the run owner's server, once started


def _worker(config) -> bool:
    return hasattr(config, "workerinput")


def _distributed(config) -> bool:
    return getattr(config.option, "dist", "no") != "no" and bool(getattr(config.option, "tx", None))


def needs_vllm(item) -> bool:
    return "vllm_backend" in getattr(item, "fixturenames", ()) or item.get_closest_marker("vllm") is not None


def pytest_configure(config):
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


@pytest.hookimpl(trylast=True)   # after -k and -m deselected theirs
def pytest_collection_modifyitems(config, items):
    vllm = [item for item in items if needs_vllm(item)]
    for item in vllm:
        item.add_marker(pytest.mark.vllm)
    if _worker(config) and os.environ.get(RUN_ENV):
        # read by the controller before it hands out any test (VLLMGroupScheduling)
        shared_vllm.write_json(Path(os.environ[RUN_ENV]) / f"vllm-tests.{config.workerinput['workerid']}.json",
                               [item.nodeid for item in vllm])
    if vllm and not _worker(config) and not _distributed(config):
        # alone, the vLLM tests go last: the server warms up while the others run
        others = [item for item in items if not needs_vllm(item)]
        items[:] = others + vllm


def pytest_collection_finish(session):
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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """In the controller, before any test is handed out: start the server if a worker
    collected a test that needs it."""
    if _SHARED is not None and _vllm_tests(node.gateway.id):
        _SHARED.start()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (xdist's --dist load) by units of work: the tests that need vLLM are one unit,
    every other test is a unit of its own. The largest unit is handed out first, so the vLLM
    tests start at once and wait for the warm-up while the other workers go on."""
    if config.getvalue("dist") != "load":
        return None     # another --dist asked for: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    ONE_WORKER_FILES = {"tests/dashboard/test_dashboard_browser.py", "tests/dashboard/test_dashboard_api.py", "tests/store/test_export_sft.py"}

    class VLLMGroupScheduling(LoadScopeScheduling):
        _vllm: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._vllm is None:     # first called once every worker has collected
                self._vllm = set().union(*(_vllm_tests(node.gateway.id) for node in self.nodes))
            if nodeid in self._vllm:
                return VLLM_GROUP
            # a file whose module-scoped fixture is a whole rollout (and a browser) runs on one
            # worker, so that it is built once, not once per worker
            file = nodeid.split("::", 1)[0]
            return file if file in ONE_WORKER_FILES else nodeid

    return VLLMGroupScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if _worker(session.config):
        return
    if _SHARED is not None:
        _SHARED.stop()
        if (shared_vllm.read(_SHARED.state) or {}).get("error"):
            return      # the run's folder keeps the server's log
    shutil.rmtree(os.environ[RUN_ENV], ignore_errors=True)


@pytest.fixture
def provider_server():
    with ProviderServer() as server:
        yield server


@pytest.fixture(scope="session")
def vllm_backend(tmp_path_factory):
    """The real vLLM server on the default model, one per test run: $POLAR_TEST_BACKEND, or
    the run's shared server (started in the background by the run's owner, see above)."""
    if os.environ.get("POLAR_TEST_BACKEND"):
        yield os.environ["POLAR_TEST_BACKEND"]
        return
    state = os.environ.get(shared_vllm.STATE_ENV)
    if state and shared_vllm.read(Path(state)) is not None:
        yield shared_vllm.wait(Path(state))
        return
    # A test the collection did not show needing it (getfixturevalue): started here.
    model_dir = ensure_default_model()
    port = launch.free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    service = launch.start_vllm(model_dir, port=port, served_name=DEFAULT_MODEL_NAME, log_path=log,
                                chat_template=launch.TEMPLATES / "smollm2_tools.jinja")
    yield f"http://127.0.0.1:{port}"
    service.stop()


class Proxy(ProxyLayout):
    """A mitmdump process (launch.start_proxy), as the CLI starts it."""

    def __init__(self, root: Path, backend: str, extra_sets=None, db_name="calls.duckdb"):
        super().__init__(root, backend, db_name)
        self.service = launch.start_proxy(db=self.db, backend=backend, port=self.port,
                                          confdir=self.confdir, log_path=self.log,
                                          reverse_port=self.reverse_port, extra_sets=extra_sets)

    @property
    def pid(self) -> int:
        return self.service.proc.pid

    def stop(self):
        self.service.stop()


def _starter(tmp_path, cls):
    started = []

    def start(backend: str, extra_sets=None, root: Path | None = None):
        proxy = cls(root or tmp_path, backend, extra_sets)
        started.append(proxy)
        return proxy

    return start, started


@pytest.fixture
def start_proxy(tmp_path):
    start, started = _starter(tmp_path, Proxy)
    yield start
    for p in started:
        p.stop()


@pytest.fixture
def start_inprocess_proxy(tmp_path):
    """start_proxy's gateway in this process (tests/support/inprocess_proxy.py): no mitmdump to
    start, the same options, modes and log. Not for tests of the process itself."""
    start, started = _starter(tmp_path, InProcessProxy)
    yield start
    for p in started:
        p.stop()
