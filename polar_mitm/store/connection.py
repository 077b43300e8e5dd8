"""Opening the DuckDB file: one process may hold it read-write, so opens retry with backoff
while another holds it, and say so plainly when it stays locked (StoreBusy)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import duckdb


class StoreBusy(RuntimeError):
    """The database stayed locked by another process for the whole timeout."""


def _is_lock_error(e: Exception) -> bool:
    text = str(e)
    # The last one: this process already has the file open read-write (the writer), which
    # lets go once it sees the read request.
    return ("Could not set lock" in text or "Conflicting lock" in text
            or "different configuration" in text or "Unique file handle conflict" in text)


def connect(path: str | os.PathLike, *, read_only: bool = False, timeout: float = 30.0,
            row_group_size: int | None = None) -> duckdb.DuckDBPyConnection:
    """Open the file, retrying with jittered backoff while another process holds it.
    row_group_size: rows per row group of what this connection appends (a multiple of 2048)."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        try:
            if row_group_size:
                # An in-memory connection spills to .tmp in the working directory (the
                # harness's, for a proxy): DuckDB's own place for a file's spills instead.
                con = duckdb.connect(config={"temp_directory": f"{path}.tmp"})
                try:
                    con.execute(f"ATTACH '{_sql_path(Path(path))}' AS store (ROW_GROUP_SIZE {int(row_group_size)})")
                    con.execute("USE store")
                except BaseException:
                    con.close()
                    raise
                return con
            return duckdb.connect(str(path), read_only=read_only)
        except duckdb.Error as e:
            if not _is_lock_error(e) or time.monotonic() >= deadline:
                if _is_lock_error(e):
                    raise StoreBusy(f"{path} stayed locked for {timeout:.0f}s: {e}") from e
                raise
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.1)


def _sql_path(p: Path) -> str:
    return str(p).replace("'", "''")
