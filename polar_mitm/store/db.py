"""All SQL lives in this package. DuckDB lets one process hold a read-write lock that
blocks every other process, readers included. The proxy's writer holds the file only
while calls keep coming, and readers announce themselves with a request file in
`<db>.readers/`: the writer sees it before its next batch and lets go until they are done.
Both sides retry while the other holds the lock."""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import duckdb
import orjson

from ..session_ids import task_of
from .calllog_owner import DB_ID_KEY
from .connection import StoreBusy, _is_lock_error, _sql_path, connect  # noqa: F401 - re-exported
from .schema import MIGRATIONS


READ_REQUEST_STALE_S = 60.0  # a crashed reader's request file stops counting after this


def readers_dir(path: str | os.PathLike) -> Path:
    return Path(f"{path}.readers")


def readers_waiting(path: str | os.PathLike) -> bool:
    """Whether a reader (of any process) has asked for the file. A request whose process
    is gone (killed readers never clean up) is removed at once."""
    try:
        entries = list(os.scandir(readers_dir(path)))
    except FileNotFoundError:
        return False
    now = time.time()
    waiting = False
    for entry in entries:
        if not _is_request(entry.name):
            if entry.name.endswith(READY_SUFFIX) and not os.path.exists(entry.path[:-len(READY_SUFFIX)]):
                try:
                    os.unlink(entry.path)   # its reader is gone
                except FileNotFoundError:
                    pass
            continue
        try:
            if _pid_alive(entry.name) and now - entry.stat().st_mtime < READ_REQUEST_STALE_S:
                waiting = True
            else:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass
    return waiting


def _pid_alive(request_name: str) -> bool:
    pid = request_name.partition("-")[0]
    if not pid.isdigit():
        return True          # not ours to judge: the age limit still applies
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


LOADER_FILE = ".loader"      # in <db>.readers/: the pid of a proxy loading its call log
READY_SUFFIX = ".ready"      # the loader's answer: everything acknowledged is in the file


@contextmanager
def _announced(path: str | os.PathLike, wait: float) -> Iterator[None]:
    """Ask a running proxy's loader to load what it has acknowledged and then leave the
    file alone while we use it. A live loader is waited for up to `wait` seconds (the
    caller's timeout: a busy machine's first load can take seconds, and a reader that went
    on without it would miss acknowledged calls); a dead one not at all."""
    request = readers_dir(path) / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    request.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    request.touch()
    ready = request.with_name(request.name + READY_SUFFIX)
    try:
        if loader_running(path):
            deadline = time.monotonic() + wait
            while not ready.exists() and time.monotonic() < deadline and loader_running(path):
                time.sleep(0.005)
        yield
    finally:
        request.unlink(missing_ok=True)
        ready.unlink(missing_ok=True)


def _catch_up_if_orphaned(path: str | os.PathLike, timeout: float) -> None:
    """Calls a killed proxy acknowledged are in its log: load them before reading."""
    from .calllog import log_dir
    if loader_running(path) or not log_dir(path).exists():
        return
    from .loader import catch_up
    try:
        catch_up(path, timeout)
    except duckdb.Error:
        pass   # read-only file or the like: read what is there


def loader_running(path: str | os.PathLike) -> bool:
    try:
        pid = (readers_dir(path) / LOADER_FILE).read_text().strip()
    except (FileNotFoundError, OSError):
        return False
    return pid.isdigit() and _pid_alive(f"{pid}-")


def pending_requests(path: str | os.PathLike) -> list[Path]:
    """Live read requests (stale ones are removed)."""
    readers_waiting(path)
    try:
        return [Path(e.path) for e in os.scandir(readers_dir(path)) if _is_request(e.name)]
    except FileNotFoundError:
        return []


def _is_request(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(READY_SUFFIX)


@contextmanager
def _interrupts_kept() -> Iterator[None]:
    """A signal handler that raises during a query (Ctrl-C's KeyboardInterrupt) has its
    exception dropped by DuckDB for RuntimeError('Query interrupted'): raise it as the
    KeyboardInterrupt it was, so the caller stops as interrupted instead of failing."""
    try:
        yield
    except RuntimeError as e:
        if str(e) != "Query interrupted":
            raise
        raise KeyboardInterrupt("a query was interrupted by a signal") from e


@contextmanager
def reading(path: str | os.PathLike, timeout: float = 30.0) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection, closed on exit so the proxy can write again."""
    if not Path(path).exists():
        raise FileNotFoundError(f"no database at {path}")
    with _announced(path, timeout):
        # After the wait: the proxy may have died meanwhile, leaving calls in its log.
        _catch_up_if_orphaned(path, timeout)
        con = connect(path, read_only=True, timeout=timeout)
        try:
            with _interrupts_kept():
                yield con
        finally:
            con.close()


@contextmanager
def writing(path: str | os.PathLike, timeout: float = 30.0,
            row_group_size: int | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """A short read-write connection for another process (rewards, migrations, calls shipped
    from another machine: row_group_size as the loader's, see connection.connect)."""
    with _announced(path, timeout):
        con = connect(path, timeout=timeout, row_group_size=row_group_size)
        try:
            with _interrupts_kept():
                yield con
        finally:
            con.close()


def schema_version(con: duckdb.DuckDBPyConnection) -> int:
    exists = con.execute("SELECT count(*) FROM information_schema.tables "
                         "WHERE table_name = 'schema_version'").fetchall()[0][0]
    if not exists:
        return 0
    return con.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchall()[0][0]


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
    fresh = not Path(path).exists()
    with writing(path, timeout) as con:
        migrate(con)
        row = con.execute("SELECT value FROM meta WHERE key = 'key_salt'").fetchone()
        if row:
            return row[0]
        salt = os.urandom(16).hex()
        con.execute("INSERT INTO meta VALUES ('key_salt', ?)", [salt])
        if fresh:   # which call log is this database's (see calllog_owner.owns_log)
            con.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT DO NOTHING", [DB_ID_KEY, os.urandom(16).hex()])
    if fresh:
        os.chmod(path, 0o600)   # prompts and answers are nobody else's business
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


@dataclass(frozen=True)
class Reward:
    """A session's reward to store (sessions.reward and reward_info)."""
    session_id: str
    reward: float
    info: Any = None
    task_id: str | None = None   # a session not stored yet: its task (default: TASK of TASK~SAMPLE)


# A stored session keeps its task_id: it is its GRPO group, set from its id when its calls
# were recorded, and a reward never moves a session to another group. A session not seen
# yet (its calls not loaded yet, or none) is created with the reward's task.
_UPSERT_REWARD = (
    "INSERT INTO sessions (session_id, task_id, source, reward, reward_info) "
    "VALUES (?, ?, 'rollout', ?, ?) ON CONFLICT (session_id) DO UPDATE SET "
    "reward = excluded.reward, reward_info = excluded.reward_info, "
    "task_id = coalesce(sessions.task_id, excluded.task_id)")


# Reward writes of this process, one file at a time: two of them (the loop's and its node's
# reward thread) storing the same new session at once made DuckDB fail one ("Duplicate key
# ... violates primary key constraint", or a failed commit); an ON CONFLICT clause only sees
# rows already committed.
_REWARD_LOCKS: dict[str, threading.Lock] = {}
_REWARD_LOCKS_GUARD = threading.Lock()
REWARD_TRIES = 8


def _reward_lock(path: str | os.PathLike) -> threading.Lock:
    with _REWARD_LOCKS_GUARD:
        return _REWARD_LOCKS.setdefault(os.path.realpath(path), threading.Lock())


def write_race(e: BaseException) -> bool:
    """Whether DuckDB failed a write because another transaction wrote the same row at the
    same moment (in this process: other processes wait for the file instead)."""
    text = str(e)
    if isinstance(e, duckdb.ConstraintException):
        return "Duplicate key" in text
    return isinstance(e, duckdb.TransactionException) and ("Conflict" in text or "constraint" in text.lower())


def store_rewards(path: str | os.PathLike, rewards: Iterable[Reward], timeout: float = 30.0) -> int:
    """Set sessions.reward (and reward_info) of each session, in one transaction; returns how
    many. The one reward write: set_reward and store.training.set_rewards both come here.
    Race-free: the reward writes of this process take turns, and a write that another writer
    of the same row beat anyway (the upsert is idempotent) is tried again, a bounded number
    of times."""
    rewards = list(rewards)
    bad = next((r for r in rewards if not math.isfinite(r.reward)), None)
    if bad is not None:
        raise ValueError(f"{bad.session_id}: reward must be a finite number, not {bad.reward!r}")
    rows = [[r.session_id, r.task_id or task_of(r.session_id), float(r.reward),
             orjson.dumps(r.info).decode() if r.info is not None else None] for r in rewards]
    if not Path(path).exists():
        raise FileNotFoundError(f"no database at {path}")
    if not rows:
        return 0
    with _reward_lock(path):
        for attempt in range(REWARD_TRIES):
            try:
                with writing(path, timeout) as con:
                    con.execute("BEGIN")
                    try:
                        con.executemany(_UPSERT_REWARD, rows)
                        con.execute("COMMIT")
                    except BaseException:
                        try:
                            con.execute("ROLLBACK")
                        except duckdb.Error:
                            pass   # a failed COMMIT leaves no transaction
                        raise
                return len(rows)
            except duckdb.Error as e:
                if not write_race(e) or attempt == REWARD_TRIES - 1:
                    raise
                time.sleep(min(0.01 * 2 ** attempt, 0.5))
    return len(rows)


def set_reward(path: str | os.PathLike, session_id: str, reward: float,
               info: Any = None, task_id: str | None = None, timeout: float = 30.0) -> None:
    store_rewards(path, [Reward(session_id, reward, info, task_id)], timeout)
