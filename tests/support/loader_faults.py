"""Faults injected into the loader's DuckDB connection (store/loader.py), at every point of a
load: before the insert, after it, after a COMMIT that landed, in the checkpoint, a database
invalidated after COMMIT, out of memory, kill -9 right after a COMMIT. Shared by
tests/store/test_loader_faults.py and the writer process it kills."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections import Counter

import duckdb

from polar_mitm.store import CallRecord
from polar_mitm.store import loader as loader_module


def record(i: int) -> CallRecord:
    return CallRecord(f"c{i}", style="openai_chat", prompt_token_ids=[1, 2, 3], token_ids=[4, 5],
                      logprobs=[-0.5, -0.25], request_text=f'{{"i":{i}}}', started_at=time.time(),
                      status_code=200)


class Faults:
    """Which fault the next load gets (one plan entry per BEGIN), and where it fires."""

    BEFORE = {"before_insert": duckdb.IOException, "oom": duckdb.OutOfMemoryException}

    def __init__(self, plan):
        self.plan = itertools.cycle(plan)
        self.current = None
        self.fired: Counter = Counter()
        self.enabled = True

    def begin(self) -> None:
        self.current = next(self.plan) if self.enabled else None

    def fire(self, kind: str) -> bool:
        if self.current == kind:
            self.fired[kind] += 1
            self.current = None
            return True
        return False


class FaultyConnection:
    """A DuckDB connection that fails where Faults says (the rest is the real one)."""

    def __init__(self, con, faults: Faults):
        self._con, self._faults, self._invalid = con, faults, False

    def execute(self, sql: str, params=None):
        f = self._faults
        if self._invalid:
            raise duckdb.FatalException("FATAL Error: database has been invalidated (injected)")
        if sql == "BEGIN":
            f.begin()
        if sql.startswith("INSERT INTO call_records_"):
            for kind, error in Faults.BEFORE.items():
                if f.fire(kind):
                    raise error(f"injected: {kind}")
        if sql.startswith("INSERT INTO meta") and f.fire("after_insert"):
            raise duckdb.IOException("injected: after the insert")
        if sql == "CHECKPOINT" and f.fire("checkpoint"):
            raise duckdb.IOException("injected: checkpoint failed")
        result = self._con.execute(sql) if params is None else self._con.execute(sql, params)
        if sql == "COMMIT":
            if f.fire("after_commit"):
                raise duckdb.TransactionException("TransactionContext Error: Failed to commit: "
                                                  "COMMIT succeeded and is durable, but the "
                                                  "autocheckpoint failed (injected)")
            if f.fire("invalidated"):
                self._invalid = True
                raise duckdb.FatalException("FATAL Error: Checkpoint failed: database has been "
                                            "invalidated (injected)")
            if f.fire("kill"):
                os.kill(os.getpid(), signal.SIGKILL)
        return result

    def close(self):
        self._con.close()

    def __getattr__(self, name):
        return getattr(self._con, name)


def faulty_connect(faults: Faults):
    real = loader_module.connect

    def connect(*args, **kwargs):
        return FaultyConnection(real(*args, **kwargs), faults)
    return connect
