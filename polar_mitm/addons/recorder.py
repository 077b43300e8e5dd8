"""The recorder, as an addon: it owns the call writer (store/writer.py) that makes each model
call durable before the harness gets its answer. The writer is opened when the proxy runs
(not in configure at load: tests and `polar-mitm options` load the addon with the default
polar_db, a file in the working directory), opened anew in configure when a --set moves
polar_db, and closed in done."""

from __future__ import annotations

from mitmproxy import ctx
from mitmproxy.addonmanager import Loader

from polar_mitm.store import CallRecord, CallWriter, SessionInfo


class Recorder:
    def __init__(self) -> None:
        self.writer: CallWriter | None = None
        self._running = False

    def load(self, loader: Loader) -> None:
        loader.add_option("polar_db", str, "rollouts.duckdb", "DuckDB file the calls are written to.")

    def configure(self, updated: set[str]) -> None:
        if "polar_db" in updated and self.writer is not None and self.writer.db_path != ctx.options.polar_db:
            self.writer.close()
            self.writer = None
            if self._running:
                self.open()

    def running(self) -> None:
        self._running = True
        self.open()

    def done(self) -> None:
        self._running = False
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def open(self) -> CallWriter:
        """The writer, started on first use: a start that failed (another proxy holds the
        database) is tried again by the next call."""
        if self.writer is None:
            self.writer = CallWriter(ctx.options.polar_db).start()
        return self.writer

    def salt(self) -> str:
        """The database's salt for hashed API keys (sessions.py). A method, not a property:
        mitmproxy reads every attribute of an addon as it loads it (looking for commands)."""
        return self.open().salt

    async def record(self, session: SessionInfo, record: CallRecord, t0: float) -> int:
        """The call's seq in its session, once its record is durable. t0: the call's
        time.perf_counter() start; the writer stamps total_ms at the durable append, which
        is what the harness waits for."""
        return await self.open().submit_async(session, record, t0=t0)
