"""The call log's line format: one JSON object per call, `{"v":4,"s":{session},"r":{record}}`
with the key of every column (the loader reads lines strictly). Older versions (3: no
token_versions; 2: keys of null columns left out; 1: whole requests) are upgraded as they
are loaded. Pure functions, no I/O."""

from __future__ import annotations

import logging
from datetime import datetime

import orjson

from .delta import DeltaCache, count_ids, fingerprint
from .schema import JSON_COLUMNS, RECORD_COLUMNS

log = logging.getLogger("polar")

SESSION_COLUMNS = ("session_id", "task_id", "source", "client", "user_agent")
LINE_COLUMNS = [c for c in RECORD_COLUMNS if c != "session_id"]   # a line's "r"
LINE_MARK = b'{"v":4,'      # log lines of this format: every column's key, null or not
LINE_V3 = b'{"v":3,'        # the same before token_versions (migration 13)
LINE_V2 = b'{"v":2,'        # the same without the keys of null columns; older ones carry
                            # whole requests


def dumps(session: dict, rec: dict) -> bytes:
    """The log line of a call (LINE_MARK first), with the key of every column (the loader
    reads the lines strictly: a value of the wrong type fails, a key missing too). A JSON
    column nested too deeply to write is marked in it rather than fail the call: orjson
    writes at most 254 levels (it reads 1024), and the gateway keeps such a request as its
    raw text anyway."""
    session, rec = dict.fromkeys(SESSION_COLUMNS) | session, dict.fromkeys(LINE_COLUMNS) | rec
    try:
        return orjson.dumps({"v": 4, "s": session, "r": rec}) + b"\n"
    except orjson.JSONEncodeError:
        pass
    rec = dict(rec)
    for col in JSON_COLUMNS:
        value = rec.get(col)
        if value is None:
            continue
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError:
            rec[col] = {"polar_unstored": "nested too deeply to store"}
    return orjson.dumps({"v": 4, "s": session, "r": rec}) + b"\n"


def loads(line: bytes) -> dict | None:
    try:
        entry = orjson.loads(line)
    except orjson.JSONDecodeError:
        log.error("polar: skipping an unreadable call log line (%d bytes)", len(line))
        return None
    return entry if isinstance(entry, dict) and "s" in entry and "r" in entry else None


def jsonable(record: dict) -> dict:
    out = dict(record)
    for col in ("started_at", "created_at"):
        if isinstance(out.get(col), datetime):
            out[col] = out[col].timestamp()
    return out


def stored_row(sid: str, rec: dict, deltas: DeltaCache) -> tuple[dict, tuple]:
    """The call as stored, its request text and prompt ids a delta against a call of its
    session in `deltas`; and (text, prompt ids, token ids, fingerprints) to remember it by."""
    text = rec.pop("request_text", None)
    if isinstance(text, bytes):   # the harness's bytes as sent, decoded here off the event loop
        text = text.decode("utf-8", errors="replace")
    text = text if isinstance(text, str) else ""
    prompt = rec.pop("prompt_token_ids", None)
    fp = fingerprint(text, prompt if isinstance(prompt, (list, bytes)) else None)
    prompt = fp.prompt
    d = deltas.delta(sid, text, prompt, fp)
    suffix = d.prompt_suffix
    if prompt is None:
        prompt_len = None
    elif d.base_call is not None and suffix is not None:   # a delta: counted on the few new ids
        prompt_len = d.prompt_shared + count_ids(suffix)
    else:
        prompt_len = count_ids(prompt)
    row = rec | {"base_call": d.base_call, "request_prefix": d.request_prefix,
                 "request_suffix": d.request_suffix, "request_middle": d.request_middle,
                 "request_chars": len(text), "prompt_shared": d.prompt_shared,
                 "prompt_suffix": suffix.decode() if suffix is not None else None,
                 "prompt_len": prompt_len}
    return row, (text, prompt, rec.get("token_ids"), fp)


def upgrade(line: bytes) -> bytes | None:
    """A line of an older version in this format."""
    entry = loads(line)
    if not entry:
        return None
    if line.startswith((LINE_V3, LINE_V2)):
        return dumps(entry["s"], entry["r"])
    row = stored_row(entry["s"].get("session_id"), dict(entry["r"]), DeltaCache(budget=0))[0]
    return dumps(entry["s"], row)


def session_id(line: bytes) -> str | None:
    """The session_id of a log line of this format (the first key of its "s")."""
    head = LINE_MARK + b'"s":{"session_id":"'
    if line.startswith(head):
        raw = line[len(head):line.find(b'"', len(head))]
        if b"\\" not in raw:   # no escapes: the id as it is
            return raw.decode()
    entry = loads(line)
    return entry["s"].get("session_id") if entry else None


def call_id(line: bytes) -> str | None:
    """The call_id of a log line of this format."""
    at = line.find(b'"call_id":"')
    if at < 0:
        return None
    start = at + len(b'"call_id":"')
    return line[start:line.find(b'"', start)].decode()
