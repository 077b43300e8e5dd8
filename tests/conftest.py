"""Fixtures, and the hooks of the test run's layout (the shared vLLM server, xdist's units of
work), which support/scheduling.py holds. tests/ is on sys.path from here: the helpers are
imported as `support.<module>`."""

import os
from pathlib import Path

import pytest

from polar_mitm.models import DEFAULT_MODEL_NAME, ensure_default_model
from polar_mitm.stack import launch
from support import scheduling, shared_vllm
from support.inprocess_proxy import InProcessProxy
from support.mitmdump_proxy import Proxy
from support.provider_server import ProviderServer

# Session sandboxes (bwrap) see the node's system and Python read-only, and of the rest only
# what is exposed: the stand-in harnesses here (support/fake_harness.py) run inside them.
os.environ.setdefault("POLAR_SANDBOX_EXPOSE", str(Path(__file__).parent))
# The Ray clusters of the tests live on loopback (support/ray_cluster.py): Ray reads this when
# it is imported, whichever test module imports it first.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def pytest_configure(config):
    scheduling.configure(config)


@pytest.hookimpl(trylast=True)   # after -k and -m deselected theirs
def pytest_collection_modifyitems(config, items):
    scheduling.mark_and_order(config, items)


def pytest_collection_finish(session):
    scheduling.start_if_needed_alone(session)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    scheduling.start_if_worker_needs(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return scheduling.make_scheduler(config, log)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    scheduling.finish(session)


@pytest.fixture
def provider_server():
    with ProviderServer() as server:
        yield server


@pytest.fixture(scope="session")
def vllm_backend(tmp_path_factory):
    """The real vLLM server on the default model, one per test run: $POLAR_TEST_BACKEND, or
    the run's shared server (started in the background by the run's owner: support/scheduling.py)."""
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


def _starter(tmp_path, cls):
    started = []

    def start(backend: str, extra_sets=None, root: Path | None = None):
        proxy = cls(root or tmp_path, backend, extra_sets)
        started.append(proxy)
        return proxy

    return start, started


@pytest.fixture
def start_proxy(tmp_path):
    """start_proxy(backend, extra_sets=None, root=None): a mitmdump (support/mitmdump_proxy.py)."""
    start, started = _starter(tmp_path, Proxy)
    yield start
    for p in started:
        p.stop()


@pytest.fixture
def start_inprocess_proxy(tmp_path):
    """start_proxy's gateway in this process (support/inprocess_proxy.py): no mitmdump to
    start, the same options, modes and log. Not for tests of the process itself."""
    start, started = _starter(tmp_path, InProcessProxy)
    yield start
    for p in started:
        p.stop()
