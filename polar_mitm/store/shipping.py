"""Shipping a node's call log to another machine's database, exactly once, with no shared disk.

On a cluster each gateway node records into its own database and call log, on its own disk;
the driver's database must get every call of every node once. The driver pulls: it asks a
node for the lines after the position it has stored for that node's log (read_chunk), loads
them in one transaction that compares and sets that position (load_chunk: the local loader's
own LoadBatch, so the rows are the same as on one machine), then tells the node how far it
has them (mark_shipped). Exactly once holds by the compare-and-set alone: a chunk sent twice,
a driver killed between its load and its ack, a node restarted on the same disk, none of them
can store a line twice or skip one. The node's files (identity, the shipped mark, what the
local loader may drop) are shipping_log.py's.

The driver's meta table holds each shipped log's position (`shipped_log:<identity>`),
committed with its rows."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .calllog import Position
from .db import writing
from .load_batch import ROW_GROUP_ROWS, LoadBatch, PositionMoved, stored_position
from .log_rows import MAIN, TAIL
from .shipping_log import (LOG_ID, Chunk, enable_shipping, gc_floor, log_identity, mark_shipped, read_chunk,
                           shipped_mark, shipping_enabled, unshipped)

__all__ = ["Chunk", "Loaded", "PositionMoved", "enable_shipping", "gc_floor", "load_chunk", "log_identity",
           "mark_shipped", "position_key", "read_chunk", "shipped_mark", "shipped_position", "shipping_enabled",
           "unshipped"]

POSITION_PREFIX = "shipped_log:"    # in the driver's meta, + the log's identity


@dataclass(frozen=True)
class Loaded:
    """What one load_chunk stored: the log's position went from start to end."""
    log_id: str
    start: Position
    end: Position
    lines: int       # log lines of the chunk
    stored: int      # rows inserted (an unreadable old line is counted above, not stored)
    bytes: int
    seconds: float


def position_key(log_id: str) -> str:
    """The driver's meta key of a node log's position."""
    if not LOG_ID.fullmatch(log_id or ""):
        raise ValueError(f"not a call log identity: {log_id!r}")
    return POSITION_PREFIX + log_id


def shipped_position(db: str | os.PathLike, log_id: str, timeout: float = 30.0) -> Position:
    """How far this database holds the node log `log_id` (0:0 before its first chunk)."""
    key = position_key(log_id)
    if not Path(db).exists():
        raise FileNotFoundError(f"no database at {db}")
    with writing(db, timeout) as con:
        return stored_position(con, key)


def _check(chunk: Chunk) -> None:
    position_key(chunk.log_id)
    if chunk.end < chunk.start:
        raise ValueError(f"a chunk that ends ({chunk.end.encode()}) before it starts ({chunk.start.encode()})")
    if chunk.lines.count(b"\n") != chunk.count or (chunk.lines and not chunk.lines.endswith(b"\n")):
        raise ValueError(f"a chunk of {chunk.count} lines whose bytes hold another number of lines")


def load_chunk(db: str | os.PathLike, chunk: Chunk, timeout: float = 30.0) -> Loaded:
    """Store a chunk's calls as the local loader would, in one transaction that checks the
    database holds the log exactly up to chunk.start (else PositionMoved, carrying the stored
    position as .stored, and nothing stored) and stores chunk.end. A chunk with no lines that
    moves the position (past a torn line) stores only that; one that moves nothing is not a
    transaction. Raises StoreBusy when the file stays locked for `timeout`."""
    _check(chunk)
    t0 = time.perf_counter()
    start, end = Position(*chunk.start), Position(*chunk.end)
    if end == start:
        return Loaded(chunk.log_id, start, end, 0, 0, 0, 0.0)
    if not Path(db).exists():
        raise FileNotFoundError(f"no database at {db}")
    scratch_dir = Path(f"{db}.ship")
    scratch_dir.mkdir(mode=0o700, exist_ok=True)
    scratch = scratch_dir / f"{os.getpid()}-{uuid.uuid4().hex[:12]}.jsonl"
    batch = LoadBatch(scratch)
    try:
        try:
            batch.add(chunk.split())   # upgrades lines of older versions, as loads do
        finally:
            batch.close()
        # A whole row group goes straight to the file, anything less to the tail (loader.py).
        table = MAIN if batch.whole else TAIL
        with writing(db, timeout, row_group_size=ROW_GROUP_ROWS) as con:
            batch.insert(con, start, end, None, table, position_key=position_key(chunk.log_id))
    finally:
        for path in (scratch, scratch.with_name(scratch.name + ".one")):
            path.unlink(missing_ok=True)
    return Loaded(chunk.log_id, start, end, batch.lines, batch.stored, len(chunk.lines),
                  time.perf_counter() - t0)
