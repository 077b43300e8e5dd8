import os
from pathlib import Path

import pytest

from polar_mitm import launch
from polar_mitm.models import DEFAULT_MODEL_NAME, ensure_default_model
from provider_server import ProviderServer

# Session sandboxes (bwrap) see the node's system and Python read-only, and of the rest only
# what is exposed: the stand-in harnesses here (fake_harness.py) run inside them.
os.environ.setdefault("POLAR_SANDBOX_EXPOSE", str(Path(__file__).parent))


@pytest.fixture
def provider_server():
    with ProviderServer() as server:
        yield server


@pytest.fixture(scope="session")
def vllm_backend(tmp_path_factory):
    """The real vLLM server on the default model, started once per test run (minutes on
    CPU). .ci/run starts it ahead and passes POLAR_TEST_BACKEND to share it."""
    if os.environ.get("POLAR_TEST_BACKEND"):
        yield os.environ["POLAR_TEST_BACKEND"]
        return
    model_dir = ensure_default_model()
    port = launch.free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    service = launch.start_vllm(model_dir, port=port, served_name=DEFAULT_MODEL_NAME, log_path=log,
                                chat_template=launch.TEMPLATES / "smollm2_tools.jinja")
    yield f"http://127.0.0.1:{port}"
    service.stop()


class Proxy:
    def __init__(self, root: Path, backend: str, extra_sets=None, db_name="calls.duckdb"):
        self.backend = backend
        self.db = root / db_name
        self.confdir = root / "mitmproxy"
        self.port, self.reverse_port = launch.free_ports(2)
        self.log = root / "mitmdump.log"
        self.service = launch.start_proxy(db=self.db, backend=backend, port=self.port,
                                          confdir=self.confdir, log_path=self.log,
                                          reverse_port=self.reverse_port, extra_sets=extra_sets)
        self.ca = str(self.confdir / "mitmproxy-ca-cert.pem")

    def proxy_url(self, user: str | None = None) -> str:
        return f"http://{user + ':x@' if user else ''}127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.reverse_port}"

    def stop(self):
        self.service.stop()


@pytest.fixture
def start_proxy(tmp_path):
    started = []

    def start(backend: str, extra_sets=None, root: Path | None = None):
        proxy = Proxy(root or tmp_path, backend, extra_sets)
        started.append(proxy)
        return proxy

    yield start
    for p in started:
        p.stop()
