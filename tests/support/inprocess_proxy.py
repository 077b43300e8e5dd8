"""The gateway behind mitmproxy's own proxy server, in this process: what `mitmdump -s
polar_addon.py` runs (launch.start_proxy's options and modes, mitmdump's flow log and
termlog into the same log file), without starting a process and importing everything again
for each test. Harnesses and SDKs reach it over real sockets, so what they see is what a
mitmdump would answer. Tests of the launcher, of TLS and of the process itself (signals,
kill -9, file modes) use mitmdump_proxy.Proxy (a real mitmdump)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

from polar_mitm.stack import launch

_ROOT_LEVEL = threading.Lock()
_RUNNING: list["InProcessProxy"] = []
_SAVED_LEVEL: list[int] = []


class _Thread:
    """What launch.wait_port and wait_addon ask of a service."""

    def __init__(self, proxy: "InProcessProxy"):
        self.proxy, self.name = proxy, "in-process mitmproxy"

    def alive(self) -> bool:
        return self.proxy._thread.is_alive()

    def tail(self, n: int = 40) -> str:
        text = self.proxy.log.read_text(errors="replace") if self.proxy.log.exists() else ""
        return "\n".join(text.splitlines()[-n:] + ([repr(self.proxy.error)] if self.proxy.error else []))


class ProxyLayout:
    """What a test's proxy is, however it runs: its files under root, its two ports (regular
    and reverse mode) and the URLs a harness or an SDK is given."""

    def __init__(self, root: Path, backend: str, db_name: str = "calls.duckdb"):
        self.backend = backend
        self.db = root / db_name
        self.confdir = root / "mitmproxy"
        self.port, self.reverse_port = launch.free_ports(2)
        self.log = root / "mitmdump.log"
        self.ca = str(self.confdir / "mitmproxy-ca-cert.pem")

    def proxy_url(self, user: str | None = None) -> str:
        return f"http://{user + ':x@' if user else ''}127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.reverse_port}"


class InProcessProxy(ProxyLayout):
    """mitmdump_proxy.Proxy's interface (ProxyLayout's, pid and stop), served from a thread of this
    process."""

    def __init__(self, root: Path, backend: str, extra_sets=None, db_name="calls.duckdb"):
        super().__init__(root, backend, db_name)
        self.pid = os.getpid()
        self.error: BaseException | None = None
        self.master = None
        self._extra_sets = list(extra_sets or [])
        self._ready = threading.Event()
        self._starter = threading.get_ident()
        self.confdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "a", buffering=1)
        _log_info_while_running(self, True)
        self._thread = threading.Thread(target=self._run, name=f"mitmproxy@{self.port}", daemon=True)
        self._thread.start()
        service = _Thread(self)
        try:
            self._ready.wait(30)
            if self.error is not None:
                raise RuntimeError(f"the in-process proxy did not start:\n{service.tail()}") from self.error
            launch.wait_port(self.port, service)
            launch.wait_addon(self.port, service)   # type: ignore[arg-type]
            launch.wait_port(self.reverse_port, service)
        except BaseException:
            self.stop()
            raise

    def _run(self) -> None:
        try:
            with asyncio.Runner() as runner:
                runner.get_loop().set_exception_handler(_quiet_cancel)
                runner.run(self._main())
        except BaseException as e:   # noqa: BLE001  (shown by the starter and by tail())
            self.error = e
        finally:
            self._ready.set()

    async def _main(self) -> None:
        from mitmproxy import master, options
        from mitmproxy.addons import default_addons, dumper, errorcheck, termlog

        from polar_mitm.addons.gateway import PolarGateway

        opts = options.Options()
        m = master.Master(opts)
        tl = termlog.TermLog(out=self._log_file)
        # what this test's own clients log (httpx's request lines) is not mitmdump's
        tl.logger.addFilter(lambda record: record.thread != self._starter)
        m._termlog_addon = tl            # uninstalled by the master's done(), as mitmdump's
        m.addons.add(tl)
        # mitmdump's addons in its order; the gateway where -s puts a script's addons (under
        # the script loader). A new PolarGateway: polar_addon.py's module-level one would be
        # this process's one for every proxy.
        defaults = default_addons()
        at = next(i for i, a in enumerate(defaults) if type(a).__name__ == "ScriptLoader") + 1
        m.addons.add(*defaults[:at])
        m.addons.add(PolarGateway())
        m.addons.add(*defaults[at:])
        m.addons.add(dumper.Dumper(outfile=self._log_file), errorcheck.ErrorCheck(repeat_errors_on_stderr=True))
        # launch.start_proxy's command line, option for option
        opts.update(listen_host="127.0.0.1", mode=[f"regular@{self.port}",
                                                   f"reverse:{self.backend}@{self.reverse_port}"],
                    confdir=str(self.confdir), polar_db=str(self.db), polar_backend=self.backend,
                    connection_strategy="lazy", upstream_cert=False)
        if self._extra_sets:
            opts.set(*self._extra_sets)
        self.master = m
        self._ready.set()
        await m.run()

    def stop(self) -> None:
        if self.master is not None and self._thread.is_alive():
            self.master.shutdown()
        self._thread.join(30)
        if not self._log_file.closed:
            self._log_file.close()
        _log_info_while_running(self, False)


def _quiet_cancel(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """Connections still open at shutdown are cancelled: not an error (mitmdump's exit
    does not show them either)."""
    if not isinstance(context.get("exception"), asyncio.CancelledError):
        loop.default_exception_handler(context)


def _log_info_while_running(proxy: InProcessProxy, running: bool) -> None:
    """mitmdump logs at INFO (its root logger is at DEBUG, its termlog at INFO): the same
    while an in-process proxy runs, so its log file gets what mitmdump's would."""
    root = logging.getLogger()
    with _ROOT_LEVEL:
        if running:
            if not _RUNNING:
                _SAVED_LEVEL[:] = [root.level]
                root.setLevel(min(root.level or logging.WARNING, logging.INFO))
            _RUNNING.append(proxy)
        elif proxy in _RUNNING:
            _RUNNING.remove(proxy)
            if not _RUNNING and _SAVED_LEVEL:
                root.setLevel(_SAVED_LEVEL.pop())
