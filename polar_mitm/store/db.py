"""All SQL lives in this package. DuckDB lets one process hold a read-write lock that
blocks every other process, readers included. The proxy's writer holds the file only
while calls keep coming, and readers announce themselves with a request file in
`<db>.readers/`: the writer sees it before its next batch and lets go until they are done.
Both sides retry while the other holds the lock."""

from __future__ import annotations

import os
import random
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import duckdb

from .schema import MIGRATIONS


class StoreBusy(RuntimeError):
    """The database stayed locked by another process for the whole timeout."""


READ_REQUEST_STALE_S = 60.0  # a crashed reader's request file stops counting after this


def _is_lock_error(e: Exception) -> bool:
    text = str(e)
    # The last one: this process already has the file open read-write (the writer), which
    # lets go once it sees the read request.
    return ("Could not set lock" in text or "Conflicting lock" in text
            or "different configuration" in text)


def readers_dir(path: str | os.PathLike) -> Path:
    return Path(f"{path}.readers")


def readers_waiting(path: str | os.PathLike) -> bool:
    """Whether a reader (of any process) has asked for the file."""
    try:
        entries = list(os.scandir(readers_dir(path)))
    except FileNotFoundError:
        return False
    now = time.time()
    for entry in entries:
        try:
            if now - entry.stat().st_mtime < READ_REQUEST_STALE_S:
                return True
            os.unlink(entry.path)
        except FileNotFoundError:
            pass
    return False


def connect(path: str | os.PathLike, *, read_only: bool = False,
            timeout: float = 30.0) -> duckdb.DuckDBPyConnection:
    """Open the file, retrying with jittered backoff while another process holds it."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except duckdb.Error as e:
            if not _is_lock_error(e) or time.monotonic() >= deadline:
                if _is_lock_error(e):
                    raise StoreBusy(f"{path} stayed locked for {timeout:.0f}s: {e}") from e
                raise
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.1)


@contextmanager
def _announced(path: str | os.PathLike) -> Iterator[None]:
    """Ask a running proxy's writer to let go of the file while we use it."""
    request = readers_dir(path) / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    request.parent.mkdir(parents=True, exist_ok=True)
    request.touch()
    try:
        yield
    finally:
        request.unlink(missing_ok=True)


@contextmanager
def reading(path: str | os.PathLike, timeout: float = 30.0) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection, closed on exit so the proxy can write again."""
    if not Path(path).exists():
        raise FileNotFoundError(f"no database at {path}")
    with _announced(path):
        con = connect(path, read_only=True, timeout=timeout)
        try:
            yield con
        finally:
            con.close()


@contextmanager
def writing(path: str | os.PathLike, timeout: float = 30.0) -> Iterator[duckdb.DuckDBPyConnection]:
    """A short read-write connection for another process (rewards, migrations)."""
    with _announced(path):
        con = connect(path, timeout=timeout)
        try:
            yield con
        finally:
            con.close()


def schema_version(con: duckdb.DuckDBPyConnection) -> int:
    exists = con.execute("SELECT count(*) FROM information_schema.tables "
                         "WHERE table_name = 'schema_version'").fetchone()[0]
    if not exists:
        return 0
    return con.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0]


def migrate(con: duckdb.DuckDBPyConnection) -> int:
    """Apply pending migrations; returns the schema version now in force."""
    con.execute("CREATE TABLE IF NOT EXISTS schema_version "
                "(version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ DEFAULT now())")
    current = schema_version(con)
    for version, sql in enumerate(MIGRATIONS[current:], start=current + 1):
        con.execute("BEGIN")
        try:
            con.execute(sql)
            con.execute("INSERT INTO schema_version (version) VALUES (?)", [version])
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
    return len(MIGRATIONS)


def init_db(path: str | os.PathLike, timeout: float = 30.0) -> str:
    """Create or migrate the file; returns its key-hash salt (made once per database)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with writing(path, timeout) as con:
        migrate(con)
        row = con.execute("SELECT value FROM meta WHERE key = 'key_salt'").fetchone()
        if row:
            return row[0]
        salt = os.urandom(16).hex()
        con.execute("INSERT INTO meta VALUES ('key_salt', ?)", [salt])
        return salt


def query(path: str | os.PathLike, sql: str, params: list | None = None,
          timeout: float = 30.0) -> tuple[list[str], list[tuple]]:
    """Run one statement read-only; returns (column names, rows)."""
    with reading(path, timeout) as con:
        cur = con.execute(sql, params or [])
        columns = [d[0] for d in cur.description or []]
        return columns, cur.fetchall()


def export_parquet(path: str | os.PathLike, out_dir: str | os.PathLike,
                   tables: tuple[str, ...] = ("sessions", "calls"), timeout: float = 30.0) -> list[Path]:
    """Write each table to OUT_DIR/<table>.parquet (atomically renamed into place)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with reading(path, timeout) as con:
        for table in tables:
            target = out / f"{table}.parquet"
            tmp = out / f".{table}.parquet.tmp"
            con.execute(f"COPY (SELECT * FROM {table}) TO '{_sql_path(tmp)}' (FORMAT parquet)")
            os.replace(tmp, target)
            written.append(target)
    return written


def _sql_path(p: Path) -> str:
    return str(p).replace("'", "''")


def set_reward(path: str | os.PathLike, session_id: str, reward: float,
               info: Any = None, task_id: str | None = None, timeout: float = 30.0) -> None:
    import orjson
    with writing(path, timeout) as con:
        con.execute(
            "INSERT INTO sessions (session_id, task_id, source, reward, reward_info) "
            "VALUES (?, ?, 'rollout', ?, ?) ON CONFLICT (session_id) DO UPDATE SET "
            "reward = excluded.reward, reward_info = excluded.reward_info, "
            "task_id = coalesce(excluded.task_id, sessions.task_id)",
            [session_id, task_id, reward, orjson.dumps(info).decode() if info is not None else None])
