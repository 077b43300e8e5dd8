"""The proxy's writer: one thread that group-commits call records.

Hooks hand a record to submit() and await the returned future; it resolves only after
the record's transaction is committed (fsynced WAL), so every call the harness got an
answer for survives a SIGKILL. Records that arrive while a batch is being written go
into the next batch, so under load one commit covers many calls.

Opening a DuckDB file costs tens of milliseconds, so while calls keep coming the writer
keeps its connection (and so the file's lock) and lets go after `linger` seconds
without work. Readers of other processes ask for the file by leaving a request file in
`<db>.readers/` (store.reading does this); the writer sees it before its next batch,
closes, and waits for the readers to finish before opening again.

If another process holds the file past `lock_timeout`, the batch is appended to a
spool file beside the database (fsynced) and imported by the next batch that gets
the lock: the proxy never stalls on a long reader and nothing is lost."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import orjson
import pyarrow as pa

from .db import StoreBusy, connect, init_db, readers_waiting
from .schema import CALL_COLUMNS, JSON_COLUMNS

_ARROW_TYPES = {
    "seq": pa.int32(), "stream": pa.bool_(), "status_code": pa.int32(),
    "prompt_token_ids": pa.list_(pa.int32()), "token_ids": pa.list_(pa.int32()),
    "logprobs": pa.list_(pa.float32()), "prompt_tokens": pa.int32(),
    "completion_tokens": pa.int32(), "queue_ms": pa.float64(), "backend_ms": pa.float64(),
    "total_ms": pa.float64(), "dropped": pa.list_(pa.string()),
    "started_at": pa.timestamp("us", tz="UTC"),
}
_STOP = object()


def spool_path(db_path: str | os.PathLike) -> Path:
    return Path(f"{db_path}.spool.jsonl")


class CallWriter:
    def __init__(self, db_path: str | os.PathLike, *, lock_timeout: float = 10.0,
                 linger: float = 0.25):
        self.db_path = str(db_path)
        self.lock_timeout = lock_timeout
        self.linger = linger
        self._con = None
        self.salt = ""
        self._queue: queue.Queue = queue.Queue()
        self._seq: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="polar-writer", daemon=True)
        self.batches = 0
        self.spooled = 0

    def start(self) -> "CallWriter":
        self.salt = init_db(self.db_path, timeout=max(self.lock_timeout, 30))
        self._thread.start()
        return self

    def submit(self, session: dict, record: dict) -> concurrent.futures.Future:
        """session: {session_id, task_id, source, client, user_agent}; record: call columns
        (seq is assigned here). The future's result is the call's seq."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((session, record, fut))
        return fut

    def close(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    # ---- writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                item = self._queue.get(timeout=self.linger if self._con else None)
            except queue.Empty:
                self._release()  # idle: let other processes have the file
                continue
            batch = []
            while True:
                if item is _STOP:
                    stopping = True
                else:
                    batch.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._commit(batch)
        self._release()

    def _release(self) -> None:
        if self._con is not None:
            con, self._con = self._con, None
            try:
                con.close()
            except Exception:  # closing must never kill the writer thread
                pass

    def _connection(self):
        if readers_waiting(self.db_path):
            self._release()
            deadline = time.monotonic() + self.lock_timeout
            while readers_waiting(self.db_path) and time.monotonic() < deadline:
                time.sleep(0.005)
        if self._con is None:
            self._con = connect(self.db_path, timeout=self.lock_timeout)
        return self._con

    def _commit(self, batch: list) -> None:
        try:
            seqs = self._write([(s, r) for s, r, _ in batch])
        except StoreBusy:
            self._spool([(s, r) for s, r, _ in batch])
            seqs = [None] * len(batch)
        except Exception as e:  # never leave a hook waiting forever
            self._release()
            for _, _, fut in batch:
                fut.set_exception(e)
            return
        for (_, _, fut), seq in zip(batch, seqs):
            fut.set_result(seq)

    def _write(self, items: list[tuple[dict, dict]]) -> list[int]:
        spool = spool_path(self.db_path)
        con = self._connection()
        pending = _read_spool(spool)
        all_items = pending + items
        sessions = {s["session_id"]: s for s, _ in all_items}
        con.execute("BEGIN")
        try:
            con.executemany(
                "INSERT INTO sessions (session_id, task_id, source, client, user_agent) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [[s["session_id"], s.get("task_id"), s.get("source"), s.get("client"),
                  s.get("user_agent")] for s in sessions.values()])
            last = {sid: self._seq[sid] if sid in self._seq else con.execute(
                "SELECT coalesce(max(seq), 0) FROM calls WHERE session_id = ?", [sid]).fetchone()[0]
                for sid in sessions}
            rows, seqs = [], []
            for s, r in all_items:
                last[s["session_id"]] += 1
                seqs.append(last[s["session_id"]])
                rows.append(r | {"session_id": s["session_id"], "seq": seqs[-1]})
            batch_table = _to_arrow(rows)  # noqa: F841  (read by the SQL below)
            cols = ", ".join(CALL_COLUMNS)
            con.execute(f"INSERT INTO calls ({cols}) SELECT {cols} FROM batch_table")
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
        self._seq.update(last)  # only once committed, so a failed batch leaves no gaps
        if pending:
            spool.unlink(missing_ok=True)
        self.batches += 1
        return seqs[len(pending):]

    def _spool(self, items: list[tuple[dict, dict]]) -> None:
        with open(spool_path(self.db_path), "ab") as f:
            for s, r in items:
                f.write(orjson.dumps({"session": s, "record": _jsonable(r)}) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self.spooled += len(items)


def _read_spool(path: Path) -> list[tuple[dict, dict]]:
    if not path.exists():
        return []
    items = []
    for line in path.read_bytes().splitlines():
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn last line from a crash mid-append was never acknowledged
        items.append((entry["session"], entry["record"]))
    return items


def _jsonable(record: dict) -> dict:
    out = dict(record)
    if isinstance(out.get("started_at"), datetime):
        out["started_at"] = out["started_at"].timestamp()
    return out


def _to_arrow(rows: list[dict]) -> pa.Table:
    arrays = {}
    for col in CALL_COLUMNS:
        values = [r.get(col) for r in rows]
        if col in JSON_COLUMNS:
            # Python values, encoded here: a raw (non-JSON) body is stored as a JSON string.
            values = [None if v is None else orjson.dumps(v).decode() for v in values]
        elif col == "started_at":
            values = [datetime.fromtimestamp(v, timezone.utc) if isinstance(v, (int, float)) else v
                      for v in values]
        arrays[col] = pa.array(values, type=_ARROW_TYPES.get(col, pa.string()))
    return pa.table(arrays)
