"""The trainer's reader and per-token versions: token_versions comes through as stored (a
NULL entry: UNKNOWN_VERSION; the column NULL: None, every token policy_version's), a call
is left out only when none of its tokens is of a known version, and a file from before the
column reads as before."""

from __future__ import annotations

import duckdb

from support.grpo_data import synthetic_calls, write_calls
from polar_mitm.store.schema import MIGRATIONS
from polar_mitm.store.training import UNKNOWN_VERSION_REASON, set_rewards, training_calls
from polar_mitm.trainer_input import UNKNOWN_VERSION


def _write(db, versions: dict[str, tuple[int | None, list[int | None] | None]]):
    """One single-call session per entry: session -> (policy_version, token_versions), its call
    of as many tokens as token_versions has entries (all of a synthetic call's when None); every
    session rewarded."""
    calls = synthetic_calls(tasks=1, sessions=len(versions), turns=1, response=(4, 4))
    extra = []
    for c, (sid, (policy, per_token)) in zip(calls, versions.items()):
        tokens = list(c.tokens)[:len(per_token)] if per_token is not None else list(c.tokens)
        extra.append(({"session_id": sid, "task_id": "t"},
                      {"status_code": 200, "prompt_token_ids": list(c.prompt), "token_ids": tokens,
                       "logprobs": list(c.logprobs)[:len(tokens)], "policy_version": policy,
                       "token_versions": per_token}))
    write_calls(db, [], extra)
    set_rewards(db, [{"session_id": sid, "reward": float(i)} for i, sid in enumerate(versions)])


def test_the_reader_gives_each_tokens_version_and_none_for_a_null_column(tmp_path):
    db = tmp_path / "a.duckdb"
    _write(db, {"t~straddles": (3, [3, 3, 4, 4]), "t~chat": (5, None),
                "t~restarted": (4, [4, None, None, None]),
                "t~late": (None, [None, None, 6, 6]), "t~lost": (2, [None, None, None, None]),
                "t~unknown": (None, None)})
    data = training_calls([db])
    got = {c.session_id: c for c in data.calls}
    assert got["t~straddles"].token_versions == [3, 3, 4, 4] and got["t~straddles"].policy_version == 3
    chat = got["t~chat"]
    assert chat.token_versions is None and list(chat.versions()) == [5] * len(chat.tokens)
    assert got["t~restarted"].token_versions == [4, UNKNOWN_VERSION, UNKNOWN_VERSION, UNKNOWN_VERSION]
    assert list(got["t~restarted"].trained()) == [0]          # the rest: context only
    # the gateway could not vouch for the start, the engine labelled the last two tokens
    assert got["t~late"].policy_version == UNKNOWN_VERSION and list(got["t~late"].trained()) == [2, 3]
    # no token of a known version (or versions that are not one per token): left out, counted
    assert set(got) == {"t~straddles", "t~chat", "t~restarted", "t~late"}
    assert data.skipped[UNKNOWN_VERSION_REASON] == 2 and "t~lost" in data.rewards


def test_versions_not_one_per_token_say_nothing_and_the_call_is_left_out(tmp_path):
    db = tmp_path / "a.duckdb"
    _write(db, {"t~ok": (1, [1, 1, 1, 1]), "t~short": (1, [1, 1, 1])})
    con = duckdb.connect(str(db))
    con.execute("UPDATE call_records_main SET token_versions = [1, 1] WHERE session_id = 't~short'")
    con.execute("UPDATE call_records_tail SET token_versions = [1, 1] WHERE session_id = 't~short'")
    con.close()
    data = training_calls([db])
    assert [c.session_id for c in data.calls] == ["t~ok"] and data.skipped == {UNKNOWN_VERSION_REASON: 1}


def test_a_file_from_before_the_column_reads_every_token_as_its_calls(tmp_path):
    db = tmp_path / "a.duckdb"
    _write(db, {"t~0": (2, None), "t~1": (3, None)})
    con = duckdb.connect(str(db))
    # as the file was before migration 13 (which added the column)
    con.execute("CREATE OR REPLACE VIEW call_records AS "
                "SELECT * EXCLUDE (token_versions) FROM call_records_main "
                "UNION ALL SELECT * EXCLUDE (token_versions) FROM call_records_tail")
    con.close()
    assert len(MIGRATIONS) >= 13
    data = training_calls([db])
    assert {c.session_id: (c.policy_version, c.token_versions) for c in data.calls} == \
        {"t~0": (2, None), "t~1": (3, None)}
