"""Pure pieces of the capture path: the body depth check, and how the loader treats log
lines DuckDB refuses or that an older version wrote."""

import random

import orjson

from polar_mitm.addons.bodies import depth_ok
from polar_mitm.store import query
from polar_mitm.store.calllog import LogAppender, Position, log_dir, read_lines
from polar_mitm.store.db import init_db
from polar_mitm.store.lines import dumps as _dumps
from polar_mitm.store.calllog_owner import claim_log
from polar_mitm.store.loader import catch_up


def _walk_ok(value, limit):
    """The reference: no list or object more than `limit` levels deep (the value is level 1)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return False
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


def test_depth_check_in_c_matches_a_walk():
    rng = random.Random(0)
    for _ in range(2000):
        v = rng.choice([1, "x", None, {}, []])
        for _ in range(rng.randint(0, 215)):
            k = rng.randrange(3)
            v = [v] if k == 0 else {"k": v} if k == 1 else [1, v, "y"]
        for limit in (200, 50, 5):
            assert depth_ok(v, limit) == _walk_ok(v, limit)


def _own_log(db) -> LogAppender:
    """A new database and its call log, owned by it as a proxy's is."""
    init_db(db)
    log_dir(db).mkdir(mode=0o700)
    claim_log(log_dir(db), query(db, "SELECT value FROM meta WHERE key = 'db_id'")[1][0][0])
    return LogAppender(log_dir(db))


def _line(sid, call_id, seq, **extra):
    return _dumps({"session_id": sid, "task_id": None}, {
        "call_id": call_id, "seq": seq, "status_code": 200, "base_call": None, "request_prefix": 0,
        "request_suffix": 0, "request_middle": "{}", "request_chars": 2, "prompt_shared": 0,
        "prompt_suffix": "[1,2]", "prompt_len": 2, "token_ids": [3], "logprobs": [-0.5],
        "started_at": 1.7e9, "created_at": 1.7e9, **extra})


def test_a_line_duckdb_refuses_becomes_a_failed_call_and_the_rest_load(tmp_path):
    db = tmp_path / "a.duckdb"
    log = _own_log(db)
    log.append(_line("s~1", "a", 1) + _line("s~1", "b", 2, token_ids="not a list")
               + _line("s~2", "c", 1))
    log.close()
    assert catch_up(db) == 3
    rows = query(db, "SELECT call_id, session_id, seq, status_code, error_kind, token_ids "
                     "FROM call_records ORDER BY call_id")[1]
    assert [r[:3] for r in rows] == [("a", "s~1", 1), ("b", "s~1", 2), ("c", "s~2", 1)]
    assert rows[0][4:] == (None, [3]) and rows[2][4:] == (None, [3])
    assert rows[1][4] == "unstored" and rows[1][5] is None          # kept, saying why
    err = query(db, "SELECT error FROM call_records WHERE call_id = 'b'")[1][0][0]
    assert err.startswith("polar: this call could not be stored")
    assert query(db, "SELECT count(*) FROM sessions")[1] == [(2,)]


def test_log_lines_of_the_older_format_are_loaded_whole(tmp_path):
    db = tmp_path / "a.duckdb"
    old = {"s": {"session_id": "t~0", "task_id": "t"},
           "r": {"call_id": "x", "seq": 1, "status_code": 200, "request_text": '{"messages": []}',
                 "prompt_token_ids": [5, 6, 7], "token_ids": [8], "logprobs": [-0.1],
                 "started_at": 1.7e9, "created_at": 1.7e9}}
    log = _own_log(db)
    log.append(orjson.dumps(old) + b"\n")
    log.close()
    assert catch_up(db) == 1
    assert query(db, "SELECT request_text, prompt_token_ids, token_ids FROM calls")[1] == \
        [('{"messages": []}', [5, 6, 7], [8])]


def test_async_submits_settle_together_and_a_cancelled_waiter_harms_nothing(tmp_path):
    import asyncio

    from polar_mitm.store import CallRecord, CallWriter, SessionInfo

    async def main():
        w = CallWriter(tmp_path / "a.duckdb").start()
        try:
            futs = [w.submit_async(SessionInfo("s~1"), CallRecord(f"c{i}", request_text="x", status_code=200,
                                                                      started_at=1.7e9))
                    for i in range(50)]
            futs[3].cancel()                       # its caller went away
            done = await asyncio.gather(*futs[4:])
            later = await w.submit_async(SessionInfo("s~1"), CallRecord("last", status_code=200))
            return done, later
        finally:
            w.close()
    done, later = asyncio.run(main())
    assert done == sorted(done) and len(set(done)) == 46 and later > max(done)
    rows = query(tmp_path / "a.duckdb", "SELECT count(*), max(seq) FROM call_records")[1]
    assert rows[0][1] == later and rows[0][0] >= 47


def test_read_lines_takes_at_most_max_lines_and_a_long_line_whole(tmp_path):
    app = LogAppender(tmp_path)
    lines = [b"a" * 10, b"b" * (3 << 20), b"c" * 5, b"d" * 7]
    app.append(b"".join(line + b"\n" for line in lines))
    got, pos = read_lines(tmp_path, Position(app.seg, 0), max_lines=1)
    assert got == lines[:1] and pos == Position(app.seg, 11)
    got, pos = read_lines(tmp_path, pos, max_bytes=1 << 20)   # longer than max_bytes: whole
    assert got == lines[1:2]
    got, end = read_lines(tmp_path, pos, max_lines=5)
    assert got == lines[2:] and end == Position(app.seg, sum(len(x) + 1 for x in lines))


def test_a_log_line_of_the_previous_format_still_loads(tmp_path):
    """Lines of format 2 leave out the keys of null columns; they are upgraded as read."""
    db = tmp_path / "a.duckdb"
    log = _own_log(db)
    log.append(orjson.dumps({"v": 2, "s": {"session_id": "s~1", "task_id": "s"}, "r": {
        "call_id": "a", "seq": 1, "status_code": 200, "request_prefix": 0, "request_suffix": 0,
        "request_middle": "{}", "request_chars": 2, "prompt_shared": 0, "prompt_suffix": "[1,2]",
        "prompt_len": 2, "token_ids": [3], "started_at": 1.7e9}}) + b"\n" + _line("s~1", "b", 2))
    log.close()
    assert catch_up(db) == 2
    assert query(db, "SELECT call_id, request_text, prompt_token_ids, token_ids FROM calls ORDER BY seq")[1] \
        == [("a", "{}", [1, 2], [3]), ("b", "{}", [1, 2], [3])]


def test_header_dict_is_mitmproxys_dict_with_lowercased_names():
    from mitmproxy.test import tutils
    from polar_mitm.addons.bodies import header_dict
    req = tutils.treq()
    req.headers["X-Api-Key"] = "k"
    req.headers["User-Agent"] = "claude-cli/2.1 (external, cli)"
    req.headers.add("Accept", "application/json")
    req.headers.add("accept", "text/event-stream")
    req.headers["x-odd"] = b"\xff caf\xc3\xa9".decode("utf-8", "surrogateescape")
    assert header_dict(req) == {k.lower(): v for k, v in dict(req.headers).items()}
    assert header_dict(req)["accept"] == "application/json, text/event-stream"
