"""Bytes on disk per 20-turn session: the store as it was (schema 1: the conversation three
times per call, full prompt ids per call) against the store now (the harness's text once,
prompt ids as deltas), on the same calls, side by side in one run.

Each call is built as the gateway builds it: the realistic bodies of scripts/workload.py
(42 KB growing to ~200 KB over 20 turns), translated by the real adapters, answered by the
workload's fake vLLM (hash-tokenized prompt ids that extend the previous prompt + answer).
"Before" rows go into a schema-1 table with the old writer's columns, a group commit per
batch; "after" rows go through the real CallWriter (durable log, loader, deltas).

    .venv/bin/python scripts/bench_storage.py [--sessions 48] [--turns 20] [--clients 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import duckdb
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402

from polar_mitm import adapters  # noqa: E402
from polar_mitm.adapters import backend  # noqa: E402
from polar_mitm.store import CallRecord, CallWriter, SessionInfo, query  # noqa: E402
from polar_mitm.store.schema import MIGRATIONS  # noqa: E402

OLD_JSON = ("request_json", "normalized_json", "backend_request_json", "response_json", "usage_json")
OLD_COLUMNS = ["call_id", "session_id", "seq", "style", "method", "path", "stream", "requested_model",
               "served_model", "status_code", *OLD_JSON, "prompt_token_ids", "token_ids", "logprobs",
               "finish_reason", "prompt_tokens", "completion_tokens", "queue_ms", "backend_ms",
               "total_ms", "policy_version", "dropped"]


def calls(n_sessions: int, turns: int, clients: int):
    """Yields (round, session_id, old row, new record) in the order concurrent clients
    would send them: round-robin over `clients` sessions at a time."""
    fake = workload.WorkloadVLLM()
    sessions = workload.make_sessions(n_sessions, prefix="store", turns=turns)
    for start in range(0, n_sessions, clients):
        group = sessions[start:start + clients]
        while not all(s.done for s in group):
            for s in group:
                if s.done:
                    continue
                style = "anthropic" if s.style == "anthropic" else "openai_chat"
                raw = s.body_bytes()
                body = orjson.loads(raw)
                mod = adapters.adapter(style)
                normalized = mod.to_chat(body, s.path)
                backend_body = backend.to_backend(normalized, "m")
                status, out = fake.respond("POST", "/v1/chat/completions", orjson.dumps(backend_body))
                assert status == 200, out
                result, tokens = backend.from_backend(orjson.loads(out), normalized)
                answer = mod.from_chat(result, normalized)
                sid = s.key.removeprefix("polar-")
                common = {"call_id": str(uuid.uuid4()), "style": style, "method": "POST", "path": s.path,
                          "stream": False, "requested_model": body["model"], "served_model": "m",
                          "status_code": 200, "response_json": answer, "token_ids": tokens["token_ids"],
                          "prompt_token_ids": tokens["prompt_token_ids"], "logprobs": tokens["logprobs"],
                          "finish_reason": result["finish_reason"], "usage_json": result["usage"],
                          "prompt_tokens": result["usage"]["prompt_tokens"],
                          "completion_tokens": result["usage"]["completion_tokens"],
                          "queue_ms": 0.1, "backend_ms": 1.0, "total_ms": 3.0, "policy_version": "0",
                          "dropped": normalized["dropped"]}
                old = common | {"request_json": body, "normalized_json": normalized,
                                "backend_request_json": backend_body}
                new = common | {"request_text": raw.decode(), "started_at": time.time(),
                                "backend_params": {k: v for k, v in backend_body.items()
                                                   if k not in ("messages", "tools")}}
                s.advance(answer)
                yield start, sid, old, new


def size_of(db: Path) -> int:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--clients", type=int, default=8, help="sessions interleaved at a time")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="polar-storage-"))
    old_db, new_db = tmp / "before.duckdb", tmp / "after.duckdb"
    con = duckdb.connect(str(old_db))
    con.execute(MIGRATIONS[0])
    placeholders = ", ".join("?" * len(OLD_COLUMNS))
    insert = f"INSERT INTO calls ({', '.join(OLD_COLUMNS)}) VALUES ({placeholders})"
    writer = CallWriter(new_db).start()
    seqs: dict[str, int] = {}
    batch, futures, n, logical = [], [], 0, 0
    t0 = time.perf_counter()
    for _, sid, old, new in calls(args.sessions, args.turns, args.clients):
        seqs[sid] = seqs.get(sid, 0) + 1
        row = old | {"session_id": sid, "seq": seqs[sid]}
        batch.append([orjson.dumps(row[c]).decode() if c in OLD_JSON else row[c] for c in OLD_COLUMNS])
        logical += sum(len(v) for v in batch[-1] if isinstance(v, str)) + 4 * len(old["prompt_token_ids"])
        futures.append(writer.submit(SessionInfo(sid, task_id=sid.split("~")[0]), CallRecord(**new)))
        n += 1
        if len(batch) >= args.clients:     # the old writer's group commit
            con.execute("BEGIN")
            con.executemany(insert, batch)
            con.execute("COMMIT")
            batch = []
        if n % 100 == 0:
            print(f"  {n} calls...", file=sys.stderr, flush=True)
    if batch:
        con.execute("BEGIN")
        con.executemany(insert, batch)
        con.execute("COMMIT")
    con.execute("CHECKPOINT")
    con.close()
    for f in futures:
        f.result(60)
    writer.close()
    query(new_db, "CHECKPOINT")  # a reader: everything acknowledged is loaded
    elapsed = time.perf_counter() - t0

    before, after = size_of(old_db), size_of(new_db)
    check = query(new_db, "SELECT count(*), count(base_call), sum(length(request_middle)), "
                          "sum(len(prompt_suffix::INTEGER[])), sum(prompt_len) FROM call_records")[1][0]
    rows, deltas, middle_chars, suffix_ids, prompt_ids = check
    per = args.sessions
    print(f"storage, {per} sessions x {args.turns} turns = {n} calls "
          f"({args.clients} sessions interleaved), built and stored in {elapsed:.0f} s")
    print(f"  logical data (old columns):  {logical / 1e6:8.1f} MB")
    print(f"  before (schema 1):           {before / 1e6:8.2f} MB   {before / per / 1e6:6.3f} MB per session")
    print(f"  after  (deltas, schema 2):   {after / 1e6:8.2f} MB   {after / per / 1e6:6.3f} MB per session")
    print(f"  ratio before/after:          {before / after:8.1f}x   (target >= 8x)")
    print(f"  rows {rows}, stored as deltas {deltas}; request text kept {middle_chars / 1e6:.1f} M chars; "
          f"prompt ids kept {suffix_ids} of {prompt_ids} ({suffix_ids / max(prompt_ids, 1):.1%})")
    print("PASS" if before / after >= 8 else "FAIL", "storage: after <= 1/8 of before")


if __name__ == "__main__":
    main()
