"""Shipping a node's call log into another database (store/shipping.py): every line once, the
rows the same as the node's own loader stores, a chunk sent twice refused, and no segment
dropped before the driver has it."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import orjson
import pytest

from polar_mitm.store import CallRecord, CallWriter, SessionInfo, init_db, log_dir, query
from polar_mitm.store import calllog
from polar_mitm.store.calllog import LogAppender, Position, log_end, segment_ids
from polar_mitm.store.calllog_owner import claim_log, set_aside
from polar_mitm.store.loader import catch_up
from polar_mitm.store.shipping import (Chunk, PositionMoved, enable_shipping, load_chunk, log_identity,
                                       mark_shipped, read_chunk, shipped_mark, shipped_position, unshipped)


def turn(i: int, session: int, history: str) -> CallRecord:
    """A call whose request re-sends its session's history (stored as a delta of the last)."""
    return CallRecord(f"c{i}", style="openai_chat", request_text=orjson.dumps({"messages": history}).decode(),
                      prompt_token_ids=[session] * 40 + [i], token_ids=[i, i + 1], logprobs=[-0.5, -0.25],
                      started_at=1_700_000_000 + i, status_code=200, policy_version=i % 3)


def record_calls(db: Path, n: int, first: int = 0, sessions: int = 7) -> list[str]:
    """n calls through the proxy's writer, one after the other (acknowledged, then loaded
    into the node's db)."""
    w = CallWriter(db, load_interval=0.01).start()
    try:
        for i in range(first, first + n):
            s = i % sessions
            history = f"system prompt {s}. " * 200 + "".join(f"turn {j}. " for j in range(i // sessions + 1))
            w.submit(SessionInfo(f"t{s}~{s}", task_id=f"t{s}"), turn(i, s, history)).result(30)
    finally:
        w.close()
    return [f"c{i}" for i in range(first, first + n)]


def ship_all(node: Path, driver: Path, max_bytes: int = 4096) -> int:
    """Pull the node's log into the driver until it has all of it; returns the chunks."""
    directory = log_dir(node)
    chunks = 0
    while True:
        log_id = log_identity(directory)
        chunk = read_chunk(directory, shipped_position(driver, log_id), max_bytes)
        load_chunk(driver, chunk)
        mark_shipped(directory, chunk.end, chunk.log_id)
        chunks += 1
        if not chunk.more:
            return chunks


CALL_ORDER = "ORDER BY call_id"


def same_calls(node: Path, driver: Path) -> int:
    a = query(node, f"SELECT * FROM calls {CALL_ORDER}")[1]
    b = query(driver, f"SELECT * FROM calls {CALL_ORDER}")[1]
    assert a == b
    sessions = "SELECT session_id, task_id, source, client, user_agent, reward FROM sessions ORDER BY 1"
    assert query(node, sessions)[1] == query(driver, sessions)[1]   # (created_at: when each stored it)
    ids = [r[0] for r in query(driver, "SELECT call_id FROM call_records")[1]]
    assert len(ids) == len(set(ids)), "a call stored twice"
    return len(a)


def test_every_line_ships_once_and_the_driver_reads_the_same_calls(tmp_path):
    node, driver = tmp_path / "node.duckdb", tmp_path / "driver.duckdb"
    enable_shipping(log_dir(node))
    acked = record_calls(node, 120)
    # a line of the first format (a whole request, no version): upgraded as a load does
    log = LogAppender(log_dir(node))
    log.append(orjson.dumps({"s": {"session_id": "old~1", "task_id": "old"},
                             "r": {"call_id": "legacy", "seq": 1, "request_text": '{"a":1}',
                                   "created_at": 1_700_000_000}}) + b"\n")
    log.close()
    catch_up(node)
    init_db(driver)
    assert ship_all(node, driver, max_bytes=8192) > 5   # many chunks
    assert same_calls(node, driver) == len(acked) + 1
    # the conversations are stored as deltas on the driver too, and rebuild the same
    assert query(driver, "SELECT count(*) FROM call_records WHERE base_call IS NOT NULL")[1][0][0] > 90
    assert query(node, "SELECT * FROM session_calls('t3~3')")[1] == query(driver, "SELECT * FROM session_calls('t3~3')")[1]
    # nothing more to ship, and asking again stores nothing
    assert ship_all(node, driver) == 1
    assert same_calls(node, driver) == len(acked) + 1


def test_a_chunk_sent_twice_or_from_elsewhere_is_refused_not_stored(tmp_path):
    node, driver = tmp_path / "node.duckdb", tmp_path / "driver.duckdb"
    record_calls(node, 30)
    init_db(driver)
    directory = log_dir(node)
    first = read_chunk(directory, Position(), 2000)
    assert first.count and first.more
    loaded = load_chunk(driver, first)
    assert (loaded.lines, loaded.stored, loaded.end) == (first.count, first.count, first.end)
    with pytest.raises(PositionMoved) as again:
        load_chunk(driver, first)   # the same chunk re-sent (an ack or an answer lost)
    assert again.value.stored == first.end and again.value.start == first.start
    later = read_chunk(directory, read_chunk(directory, first.end, 2000).end, 2000)
    with pytest.raises(PositionMoved) as skipping:
        load_chunk(driver, later)   # would skip lines
    assert skipping.value.stored == first.end
    assert query(driver, "SELECT count(*) FROM call_records")[1] == [(first.count,)]
    assert shipped_position(driver, first.log_id) == first.end
    # a chunk whose bytes do not hold its count of lines is no chunk
    with pytest.raises(ValueError):
        load_chunk(driver, Chunk(first.log_id, first.end, first.end, b"x\n", 2, first.end, False))


def test_a_driver_killed_between_its_load_and_its_ack_loads_nothing_twice(tmp_path):
    node, driver = tmp_path / "node.duckdb", tmp_path / "driver.duckdb"
    directory = log_dir(node)
    enable_shipping(directory)
    acked = record_calls(node, 50)
    init_db(driver)
    chunk = read_chunk(directory, Position(), 1 << 20)
    load_chunk(driver, chunk)            # ... and the driver dies before its ack
    assert shipped_mark(directory) is None and unshipped(directory, log_end(directory))
    # the driver again: it starts where its database is, not where the node thinks
    start = shipped_position(driver, log_identity(directory))
    assert start == chunk.end
    rest = read_chunk(directory, start, 1 << 20)
    assert rest.count == 0 and load_chunk(driver, rest).stored == 0
    mark_shipped(directory, rest.end, rest.log_id)
    assert not unshipped(directory, log_end(directory))
    assert same_calls(node, driver) == len(acked)


def test_no_segment_is_dropped_before_the_driver_has_it(tmp_path, monkeypatch):
    monkeypatch.setattr(calllog, "SEGMENT_BYTES", 4096)   # a few calls a segment
    unshipped_node, plain_node = tmp_path / "node.duckdb", tmp_path / "plain.duckdb"
    driver = tmp_path / "driver.duckdb"
    directory = log_dir(unshipped_node)
    enable_shipping(directory)
    record_calls(unshipped_node, 120)
    record_calls(plain_node, 120)
    # both loaded every call locally; only the one without shipping dropped segments
    assert query(unshipped_node, "SELECT count(*) FROM call_records")[1] == [(120,)]
    assert query(plain_node, "SELECT count(*) FROM call_records")[1] == [(120,)]
    assert len(segment_ids(log_dir(plain_node))) <= 2
    kept = segment_ids(directory)
    assert len(kept) > 10 and kept == list(range(kept[0], kept[0] + len(kept)))
    # the driver takes half of them: the node then drops only what both have
    init_db(driver)
    log_id = log_identity(directory)
    half = Position(kept[len(kept) // 2], 0)
    pos = Position()
    while pos < half:
        chunk = read_chunk(directory, pos, 1 << 20, end=half)
        load_chunk(driver, chunk)
        pos = chunk.end
    mark_shipped(directory, pos, log_id)
    record_calls(unshipped_node, 5, first=120)   # its local loads garbage-collect
    left = segment_ids(directory)
    assert left[0] == half.seg
    ship_all(unshipped_node, driver)
    assert same_calls(unshipped_node, driver) == 125


def test_a_torn_line_is_never_shipped(tmp_path):
    node, driver = tmp_path / "node.duckdb", tmp_path / "driver.duckdb"
    record_calls(node, 5)
    directory = log_dir(node)
    last = segment_ids(directory)[-1]
    with open(calllog.segment_path(directory, last), "ab") as f:
        f.write(b'{"v":4,"s":{"session_id":"torn~1"')   # the proxy died mid-write
    init_db(driver)
    chunk = read_chunk(directory, Position(), 1 << 20)
    assert chunk.count == 5 and not chunk.more and chunk.end < chunk.tail
    load_chunk(driver, chunk)
    mark_shipped(directory, chunk.end, chunk.log_id)
    assert not unshipped(directory, log_end(directory))   # a torn line is nothing to wait for
    record_calls(node, 3, first=5)   # the next proxy appends to a segment of its own
    ship_all(node, driver)
    assert same_calls(node, driver) == 8


def test_a_logs_identity_is_stable_private_and_new_for_another_database(tmp_path):
    node = tmp_path / "node.duckdb"
    directory = log_dir(node)
    first = enable_shipping(directory)   # before the writer ever ran: no owner yet
    record_calls(node, 4)
    assert log_identity(directory) == first    # the writer claiming the log keeps it
    assert stat.S_IMODE(os.stat(directory / ".ship_id").st_mode) == 0o600
    mark_shipped(directory, log_end(directory), first)
    assert shipped_mark(directory) == log_end(directory)
    with pytest.raises(ValueError):
        mark_shipped(directory, Position(log_end(directory).seg + 1, 0), first)
    assert not mark_shipped(directory, Position(), first)   # never backwards
    assert not mark_shipped(directory, log_end(directory), "f" * 32)   # another log's ack
    # the database made anew under the same name: its log is another log
    set_aside(directory, "test")
    claim_log(directory, "another-database")
    second = log_identity(directory)
    assert second != first and shipped_mark(directory) is None
    assert read_chunk(directory, Position(), 1 << 20).log_id == second


def test_chunks_and_positions_survive_pickling(tmp_path):
    """Ray pickles what crosses: a Position is rebuilt as itself (tuple's own pickling nested it)."""
    node = tmp_path / "node.duckdb"
    record_calls(node, 3)
    chunk = read_chunk(log_dir(node), Position(), 1 << 20)
    again = pickle.loads(pickle.dumps(chunk))
    assert again == chunk and type(again.end) is Position and again.end.seg == chunk.end.seg

