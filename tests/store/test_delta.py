"""The conversation is stored once: deltas against an earlier call, rebuilt whole by the
calls view and by the trainer's reader."""

import random
import time

import duckdb
import orjson

from polar_mitm.store import CallRecord, CallWriter, SessionInfo, query
from polar_mitm.store.db import migrate
from support.delta_oracles import apply_text, common_suffix, text_delta
from polar_mitm.store.delta import DeltaCache, apply_ids, common_prefix
from polar_mitm.store.schema import MIGRATIONS
from polar_mitm.store.training import training_calls


def test_common_prefix_and_suffix_match_a_plain_scan():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.choice([0, 1, 5, 4095, 4096, 4097, 9000])
        a = "".join(rng.choice("ab\u00e9\U0001f600") for _ in range(n))
        b = a[:rng.randint(0, n)] + "".join(rng.choice("abc") for _ in range(rng.randint(0, 50)))
        b = b + a[len(a) - rng.randint(0, n):] if rng.random() < 0.5 else b
        p = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == p
        limit = rng.randint(0, min(len(a), len(b)))
        s = next((i for i in range(limit) if a[-1 - i] != b[-1 - i]), limit)
        assert common_suffix(a, b, limit) == s
        d = text_delta(a, b)
        assert apply_text(a, d.prefix, d.suffix, d.middle) == b
        assert common_prefix(a.encode(), b.encode()) >= 0


def test_apply_ids_reaches_into_the_base_response():
    assert apply_ids([1, 2, 3], [4, 5], 4, [9]) == [1, 2, 3, 4, 9]
    assert apply_ids([1, 2, 3], [4, 5], 2, [7]) == [1, 2, 7]
    assert apply_ids([], [], 0, [1]) == [1]


def test_cache_picks_the_call_the_prompt_extends_past_a_side_call():
    cache = DeltaCache()
    main = [1, 2, 3] * 1000
    cache.add("s", "main1", '{"m":[1]}', main, [4, 5])
    cache.add("s", "title", '{"title":1}', [9, 9, 9], [8])
    d = cache.delta("s", '{"m":[1,2]}', main + [4, 5, 6])
    # shared ids are found a fingerprint block at a time (2048 bytes: 1024 ids of "1,")
    assert d.base_call == "main1" and 3002 - 1024 <= d.prompt_shared <= 3002
    assert apply_ids(main, [4, 5], d.prompt_shared, orjson.loads(d.prompt_suffix)) == main + [4, 5, 6]


def test_cache_stays_within_its_budget():
    """Entries are fingerprints: about 1 KB here for a 20 KB request and 1000 prompt ids."""
    cache = DeltaCache(budget=20_000, per_session=2)
    for i in range(100):
        cache.add(f"s{i}", f"c{i}", "x" * 20_000, list(range(1000)), [1])
    assert cache.size <= 20_000
    assert cache.delta("s0", "x" * 20_000, list(range(1000))).base_call is None   # forgotten
    assert cache.delta("s99", "x" * 20_000, list(range(1000))).base_call == "c99"


def _session_calls(n_turns=12, side_every=5, seed=0):
    """A growing conversation: each prompt extends the previous prompt + response, with a
    re-rendered (drifted) tail now and then and a title side call every few turns."""
    rng = random.Random(seed)
    # harness-sized: a 12 KB system prompt (deltas are found a 1024-character block at a time)
    messages, prompt, calls = [{"role": "system", "content": "sys " * 3000}], list(range(500)), []
    for k in range(n_turns):
        messages.append({"role": "user", "content": f"turn {k} " + "é" * rng.randint(5, 50)})
        prompt = prompt + [rng.randrange(50_000) for _ in range(rng.randint(20, 200))]
        if k % 4 == 3:          # drift: the template re-renders the last few tokens
            prompt[-30:-25] = [7, 7, 7, 7, 7]
        tokens = [rng.randrange(50_000) for _ in range(rng.randint(5, 40))]
        text = orjson.dumps({"model": "m", "messages": messages, "stream": k % 2 == 0}).decode()
        calls.append((text, list(prompt), tokens))
        if k % side_every == side_every - 1:
            calls.append(('{"title": "x"}', [1, 2, 3], [4]))
        messages.append({"role": "assistant", "content": f"answer {k}"})
        prompt = prompt + tokens
    return calls


def test_the_calls_view_and_the_trainer_rebuild_every_call_exactly(tmp_path):
    db = tmp_path / "a.duckdb"
    w = CallWriter(db, load_interval=0.0).start()
    expected = {}
    for s in range(3):
        for i, (text, prompt, tokens) in enumerate(_session_calls(seed=s)):
            cid = f"s{s}-{i}"
            failed = i == 4
            w.submit(SessionInfo(f"t~{s}", task_id="t"), CallRecord(
                call_id=cid, request_text=text, status_code=502 if failed else 200,
                prompt_token_ids=None if failed else prompt, token_ids=None if failed else tokens,
                logprobs=None if failed else [-0.1] * len(tokens), error="x" if failed else None,
                started_at=time.time(), policy_version=0)).result(10)
            expected[cid] = (text, None if failed else prompt, None if failed else tokens)
            if i % 5 == 2:
                time.sleep(0.05)   # several loads, so bases come from earlier transactions too
    w.close()
    stored = query(db, "SELECT count(*), count(base_call) FROM call_records")[1][0]
    # whole: each session's first call and its two unrelated title calls
    assert stored[0] == len(expected) and stored[1] == len(expected) - 9
    rows = query(db, "SELECT call_id, request_text, prompt_token_ids, token_ids FROM calls")[1]
    assert {r[0]: (r[1], r[2], r[3]) for r in rows} == expected
    one = query(db, "SELECT * FROM session_calls('t~1') ORDER BY seq")
    assert one == query(db, "SELECT * FROM calls WHERE session_id = 't~1' ORDER BY seq")
    assert len(one[1]) == 14
    from polar_mitm.store import set_reward
    for s in range(3):
        set_reward(db, f"t~{s}", 1.0)
    data = training_calls([db])
    by_id = {(c.session_id, c.seq): c.prompt for c in data.calls}
    seqs = dict(((r[0], r[1]), r[2]) for r in query(db, "SELECT session_id, seq, prompt_token_ids FROM calls")[1])
    assert by_id and all(by_id[k] == seqs[k] for k in by_id)
    assert data.skipped["failed"] == 3 and not data.skipped["missing_base"]
    # what is stored grows with the new text, not with the history re-sent every turn
    whole = sum(len(t) for t, _, _ in expected.values())
    middles = query(db, "SELECT sum(length(request_middle)) FROM call_records")[1][0][0]
    assert middles < whole / 5


def test_old_rows_migrate_whole(tmp_path):
    db = tmp_path / "old.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ DEFAULT now())")
    con.execute(MIGRATIONS[0])
    con.execute("INSERT INTO schema_version (version) VALUES (1)")
    con.execute("INSERT INTO calls (call_id, session_id, seq, request_json, backend_request_json, "
                "prompt_token_ids, token_ids) VALUES ('a', 's', 1, '{\"x\": [1]}', '{\"max_tokens\": 5}', [1, 2], [3]),"
                "('b', 's', 2, '\"not json: raw\"', NULL, NULL, NULL)")
    migrate(con)
    rows = con.execute("SELECT call_id, request_text, request_json, prompt_token_ids, backend_params "
                       "FROM calls ORDER BY call_id").fetchall()
    assert rows[0] == ("a", '{"x": [1]}', '{"x": [1]}', [1, 2], '{"max_tokens": 5}')
    assert rows[1][:4] == ("b", "not json: raw", None, None)
    assert con.execute("SELECT prompt_len FROM session_turns ORDER BY seq").fetchall() == [(2,), (None,)]
    con.close()


def test_id_deltas_on_json_text_are_exact():
    """Prompt ids travel as JSON text (no Python int per id); the shared prefix is counted
    on that text, token boundaries included."""
    from support.delta_oracles import shared_ids
    from polar_mitm.store.delta import DeltaCache as Cache
    rng = random.Random(1)
    for _ in range(3000):
        base = [rng.randrange(0, 200) for _ in range(rng.randint(0, 30))]
        new = base[:rng.randint(0, len(base))] + [rng.randrange(0, 200) for _ in range(rng.randint(0, 10))]
        true = next((i for i, (x, y) in enumerate(zip(base, new)) if x != y), min(len(base), len(new)))
        assert shared_ids(orjson.dumps(base), orjson.dumps(new))[0] == true
        cache = Cache()
        cache.add("s", "b", "t" * 300, base[:len(base) // 2], base[len(base) // 2:])
        d = cache.delta("s", "t" * 300 + "x", orjson.dumps(new))
        assert apply_ids(base[:len(base) // 2], base[len(base) // 2:], d.prompt_shared,
                         orjson.loads(d.prompt_suffix)) == new


def test_vllm_prompt_ids_are_kept_as_text():
    from polar_mitm.adapters.backend import parse_completion
    answer = {"id": "x", "choices": [{"message": {"content": 'a "prompt_token_ids": [9] b'}}],
              "prompt_token_ids": [1, 2, 40000]}
    resp, ids = parse_completion(orjson.dumps(answer))
    assert ids == b"[1,2,40000]" and resp["choices"] == answer["choices"]
    assert parse_completion(b'{"prompt_token_ids": [1, 2,\n 3], "x": 1}') == ({"prompt_token_ids": None, "x": 1}, b"[1,2,3]")
    assert parse_completion(b'{"choices": []}') == ({"choices": []}, None)
    # anything but ids, commas and spaces goes through the full parse
    assert parse_completion(b'{"prompt_token_ids": [1, "2"]}') == ({"prompt_token_ids": [1, "2"]}, b'[1,"2"]')
    # negative ids and tabs stay on the text path, the spaces dropped
    assert parse_completion(b'{"prompt_token_ids": [1,\t-2]}') == ({"prompt_token_ids": None}, b"[1,-2]")


def test_id_counts_carried_from_base_to_base_stay_exact():
    """Across a session of prompts longer than a fingerprint block, the shared ids come
    from the counts each base carries (not from counting the prompt again): every call
    rebuilds exactly, through chains of bases, retries and side calls."""
    from polar_mitm.store.delta import IDS_BLOCK, fingerprint
    rng = random.Random(2)
    exercised = 0
    for trial in range(40):
        cache, stored = DeltaCache(), {}
        history = [rng.randrange(0, 100_000) for _ in range(rng.randint(0, 3000))]
        for turn in range(12):
            kind = rng.random()
            if kind < 0.15:     # a side call: unrelated short prompt
                prompt = [rng.randrange(0, 50) for _ in range(rng.randint(1, 40))]
            elif kind < 0.3:    # re-rendered history: a change somewhere in the middle
                prompt = list(history)
                if prompt:
                    prompt[rng.randrange(len(prompt))] = rng.randrange(0, 10)
            else:
                prompt = history + [rng.randrange(0, 100_000) for _ in range(rng.randint(0, 600))]
            tokens = [rng.randrange(0, 100_000) for _ in range(rng.randint(0, 300))]
            text = "t" * (3000 + turn)
            fp = fingerprint(text, orjson.dumps(prompt))
            d = cache.delta("s", text, fp.prompt, fp)
            if d.base_call is None:
                assert orjson.loads(d.prompt_suffix) == prompt
            else:
                base_prompt, base_tokens = stored[d.base_call]
                assert apply_ids(base_prompt, base_tokens, d.prompt_shared,
                                 orjson.loads(d.prompt_suffix)) == prompt, (trial, turn)
                exercised += d.prompt_shared * 6 > IDS_BLOCK   # counted in a base, not here
            call = f"c{turn}"
            stored[call] = (prompt, tokens)
            cache.add("s", call, text, fp.prompt, tokens, fp)
            if kind >= 0.3:
                history = prompt + tokens
    assert exercised > 200
