"""A test's proxy as the CLI starts it: a mitmdump process (launch.start_proxy), for the tests
of the process itself (signals, kill -9, file modes, TLS). The others use the in-process
gateway (inprocess_proxy.py), which has the same interface. The start_proxy and
start_inprocess_proxy fixtures (tests/conftest.py) start either kind and stop them after."""

from __future__ import annotations

from pathlib import Path

from polar_mitm.stack import launch
from support.inprocess_proxy import ProxyLayout


class Proxy(ProxyLayout):
    """A mitmdump process (launch.start_proxy), as the CLI starts it. control_token: the
    gateway's, handed over as Stack.start_node hands it (in a file the addon removes)."""

    def __init__(self, root: Path, backend: str, extra_sets=None, db_name="calls.duckdb",
                 control_token: str | None = None):
        super().__init__(root, backend, db_name)
        self.control_token = control_token
        self.service = launch.start_proxy(db=self.db, backend=backend, port=self.port,
                                          confdir=self.confdir, log_path=self.log,
                                          reverse_port=self.reverse_port, extra_sets=extra_sets,
                                          control_token=control_token)

    @property
    def pid(self) -> int:
        return self.service.proc.pid

    def stop(self):
        self.service.stop()
