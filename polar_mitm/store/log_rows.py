"""Log lines as call_records rows, read by DuckDB itself: no Python work per call.

The lines of a load are written to a scratch file that DuckDB reads as one-column CSV and
types strictly as call_records' columns. A line it refuses for its data is stored as a
failed call that says why (storable_line), rather than hold up every later one."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import orjson

from .lines import LINE_COLUMNS, SESSION_COLUMNS, dumps, loads
from .schema import RECORD_COLUMNS

MAIN, TAIL = "call_records_main", "call_records_tail"   # the tables behind call_records
CSV_BUFFER = 4 << 20   # the CSV reader's buffer, at least
# What a line may be refused for: its data. Anything else (out of memory, I/O) fails the
# whole load, which is retried later with every line intact.
DATA_ERRORS = (duckdb.ConversionException, duckdb.InvalidInputException,
               duckdb.TypeMismatchException, duckdb.BinderException)

_TYPES: dict[str, str] = {}


def csv_buffer(longest: int, floor: int = CSV_BUFFER) -> int:
    return max(floor, 2 * (longest + 1024))


def read_log_sql(con, scratch: Path, longest: int) -> str:
    """The scratch file's lines as `s` and `r` structs typed as call_records' columns. It
    is read as one-column CSV (its separator, 0x01, is escaped in any JSON) through a
    buffer sized to the longest line, where read_json reserves 32 MiB at least: measured,
    a 2048-line load peaks ~25 MB lower. json_transform_strict fails a value of the wrong
    type as read_json does."""
    if not _TYPES:
        for name, kind in con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                      f"WHERE table_name = '{MAIN}'").fetchall():
            _TYPES[name] = "DOUBLE" if kind.startswith("TIMESTAMP") else kind
        # Read as text, made an integer by _selected: lines written before migration 10 carry
        # it as text ("3"), and a value that is no integer is an unknown version (NULL).
        _TYPES["policy_version"] = "VARCHAR"
    structure = orjson.dumps({"s": dict.fromkeys(SESSION_COLUMNS, "VARCHAR"),
                              "r": {c: _TYPES[c] for c in LINE_COLUMNS}}).decode()
    path = str(scratch).replace("'", "''")
    line_size = longest + 1024
    return (f"(SELECT j.s AS s, j.r AS r FROM (SELECT json_transform_strict(line, '{structure}') AS j "
            f"FROM read_csv('{path}', columns = {{'line': 'VARCHAR'}}, delim = '{chr(1)}', quote = '', "
            f"escape = '', header = false, auto_detect = false, max_line_size = {line_size}, "
            f"buffer_size = {csv_buffer(longest)})))")


def _selected(column: str) -> str:
    """A call_records column as read from a log line (r: the record, s: the session)."""
    return {"session_id": "s.session_id", "total_ms": "coalesce(a.ms, r.total_ms)",
            "created_at": "coalesce(to_timestamp(r.created_at), now())",
            "started_at": "to_timestamp(r.started_at)",
            "policy_version": "TRY_CAST(r.policy_version AS INTEGER)"}.get(column, f"r.{column}")


# call_records' columns from the lines (r, s) and the acknowledgement times (a: call_id, ms)
SELECT_ROWS = ", ".join(map(_selected, RECORD_COLUMNS))


def acked_sql(acks: dict[str, float]) -> tuple[str, list]:
    """The acknowledgement times as a relation (call_id, ms), and its parameters."""
    if not acks:
        return "SELECT NULL::VARCHAR AS call_id, NULL::DOUBLE AS ms WHERE false", []
    values = ", ".join(["(?, ?)"] * len(acks))
    return f"SELECT * FROM (VALUES {values}) t(call_id, ms)", [v for kv in acks.items() for v in kv]


def write_scratch(path: Path, lines: list[bytes]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.writelines(line if line.endswith(b"\n") else line + b"\n" for line in lines)


def storable_line(con, line: bytes, scratch: Path) -> bytes:
    """The line, if DuckDB reads it alone; else a failed call in its place, saying why."""
    write_scratch(scratch, [line])
    try:
        con.execute(f"SELECT {SELECT_ROWS} FROM "
                    f"{read_log_sql(con, scratch, len(line))} "
                    f"LEFT JOIN ({acked_sql({})[0]}) a ON a.call_id = r.call_id").fetchall()
        return line
    except DATA_ERRORS as e:
        entry = loads(line) or {"s": {}, "r": {}}
        r = entry["r"]
        keep = {k: r.get(k) for k in ("call_id", "seq", "style", "method", "path", "started_at",
                                      "created_at") if isinstance(r.get(k), (str, int, float))}
        keep.update(status_code=r.get("status_code") if isinstance(r.get("status_code"), int) else None,
                    error=f"polar: this call could not be stored: {e}"[:2000], error_kind="unstored")
        return dumps({k: v for k, v in entry["s"].items() if isinstance(v, str)}, keep)
