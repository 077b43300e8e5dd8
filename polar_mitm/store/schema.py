"""Versioned schema. Each migration runs once, in order, inside one transaction; the
applied version is kept in schema_version. Add migrations at the end, never edit one."""

# Every call rebuilt whole from its deltas (the calls view), or those of one session (the
# session_calls macro): bases are always earlier calls of the same session.
_WHOLE_CALLS = """
        WITH RECURSIVE whole(call_id, request_text, prompt_token_ids, token_ids) AS (
            SELECT call_id, request_middle, prompt_suffix::INTEGER[], token_ids
            FROM call_records WHERE base_call IS NULL AND {where}
            UNION ALL
            SELECT c.call_id,
                   left(w.request_text, c.request_prefix) || c.request_middle
                       || right(w.request_text, c.request_suffix),
                   CASE WHEN c.prompt_suffix IS NOT NULL THEN
                       list_concat(coalesce(w.prompt_token_ids, []), coalesce(w.token_ids, []))[1:c.prompt_shared]
                       || c.prompt_suffix::INTEGER[] END,
                   c.token_ids
            FROM call_records c JOIN whole w ON c.base_call = w.call_id
            WHERE {where_c}
        )
        SELECT c.call_id, c.session_id, c.seq, c.style, c.method, c.path, c.stream,
               c.requested_model, c.served_model, c.status_code,
               w.request_text,
               CASE WHEN json_valid(w.request_text) THEN w.request_text::JSON END AS request_json,
               c.backend_params, c.response_json, w.prompt_token_ids, c.token_ids, c.logprobs,
               c.finish_reason, c.prompt_tokens, c.completion_tokens, c.usage_json, c.queue_ms,
               c.backend_ms, c.total_ms, c.error, c.error_kind, c.policy_version, c.dropped,
               c.started_at, c.created_at{extra}
        FROM call_records c JOIN whole w USING (call_id)
        WHERE {where_c}"""


# call_records as migration 2 made it (with a primary key), as migration 5 remakes it
# (without one), and migration 6's tail; formatted, each migration's SQL is what it was.
# (Migration 10 makes policy_version INTEGER.)
_CALL_RECORDS = """CREATE TABLE {name} (
        call_id              VARCHAR {key},
        session_id           VARCHAR NOT NULL,
        seq                  INTEGER NOT NULL,
        style                VARCHAR,
        method               VARCHAR,
        path                 VARCHAR,
        stream               BOOLEAN,
        requested_model      VARCHAR,
        served_model         VARCHAR,
        status_code          INTEGER,
        base_call            VARCHAR,      -- the call both deltas below are against (NULL: whole)
        request_prefix       INTEGER,      -- characters kept from the start of the base's text
        request_suffix       INTEGER,      -- characters kept from its end
        request_middle       VARCHAR,      -- what is new in between
        request_chars        INTEGER,      -- length of the whole request text
        backend_params       JSON,         -- what vLLM got, but messages and tools
        response_json        JSON,
        prompt_shared        INTEGER,      -- ids kept from the base's prompt + token ids
        prompt_suffix        VARCHAR,      -- ids after them, as JSON text (NULL: no prompt ids):
                                           -- DuckDB's WAL for a list grows with its row group
        prompt_len           INTEGER,
        token_ids            INTEGER[],
        logprobs             FLOAT[],
        finish_reason        VARCHAR,
        prompt_tokens        INTEGER,
        completion_tokens    INTEGER,
        usage_json           JSON,
        queue_ms             DOUBLE,
        backend_ms           DOUBLE,
        total_ms             DOUBLE,
        error                VARCHAR,
        error_kind           VARCHAR,
        policy_version       VARCHAR,
        dropped              VARCHAR[],
        started_at           TIMESTAMPTZ,
        created_at           TIMESTAMPTZ DEFAULT now()
    );"""


def _whole_calls(where: str = "TRUE", where_c: str = "TRUE", extra: str = "") -> str:
    """extra: the columns later migrations add, after created_at (the earlier migrations'
    SQL stays what it was)."""
    return _WHOLE_CALLS.format(where=where, where_c=where_c, extra=extra)


# The columns added to call_records after its views were first made (each migration that adds
# one makes the calls view and the session_calls macro again with all of them).
_LATER_CALL_COLUMNS = ", c.token_versions"


# The inspection views, as migration 1 made them over whole calls and migration 2 remakes
# them over call_records; formatted, each migration's SQL is what it was.
_CALL_VIEWS = """
    CREATE VIEW session_turns AS
        SELECT session_id, seq, style, requested_model, served_model, finish_reason,
               {turn_prompt_len}, len(token_ids) AS completion_len,
               status_code, error_kind, total_ms, created_at
        FROM {calls} ORDER BY session_id, seq;
    CREATE VIEW session_summary AS
        SELECT s.session_id, s.task_id, s.source, s.reward, count(c.call_id) AS calls,
               count(c.error) AS failed_calls,
               sum({call_prompt_len}) AS prompt_tokens,
               sum(len(c.token_ids)) AS completion_tokens,
               min(c.created_at) AS first_call, max(c.created_at) AS last_call
        FROM sessions s LEFT JOIN {calls} c USING (session_id)
        GROUP BY ALL ORDER BY s.session_id;
    CREATE VIEW task_groups AS
        SELECT task_id, count(*) AS sessions, count(reward) AS rewarded,
               avg(reward) AS mean_reward, stddev_pop(reward) AS reward_std,
               sum(calls) AS calls
        FROM session_summary WHERE task_id IS NOT NULL
        GROUP BY task_id ORDER BY task_id;
    CREATE VIEW failures AS
        SELECT session_id, seq, style, path, status_code, error_kind, error, total_ms, created_at
        FROM {calls} WHERE error IS NOT NULL ORDER BY created_at;"""


def _call_views(calls: str, turn_prompt_len: str, call_prompt_len: str) -> str:
    """calls: the table of calls; turn_prompt_len: session_turns' prompt_len column;
    call_prompt_len: a call c's prompt length."""
    return _CALL_VIEWS.format(calls=calls, turn_prompt_len=turn_prompt_len, call_prompt_len=call_prompt_len)


MIGRATIONS: list[str] = [
    # 1: sessions, calls and the inspection views
    """
    CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR);
    CREATE TABLE sessions (
        session_id  VARCHAR PRIMARY KEY,
        task_id     VARCHAR,            -- sessions of one task form a GRPO group
        source      VARCHAR,            -- proxy_user | api_key | key_hash | default
        client      VARCHAR,            -- peer address of the first call
        user_agent  VARCHAR,
        created_at  TIMESTAMPTZ DEFAULT now(),
        reward      DOUBLE,
        reward_info JSON
    );
    CREATE TABLE calls (
        call_id              VARCHAR PRIMARY KEY,
        session_id           VARCHAR NOT NULL,
        seq                  INTEGER NOT NULL,     -- 1, 2, ... within the session
        style                VARCHAR,              -- anthropic | openai_chat | openai_responses | google
        method               VARCHAR,
        path                 VARCHAR,              -- query secrets (key=) removed
        stream               BOOLEAN,
        requested_model      VARCHAR,
        served_model         VARCHAR,
        status_code          INTEGER,              -- what the harness got
        request_json         JSON,                 -- the harness's body, as sent
        normalized_json      JSON,                 -- internal chat shape
        backend_request_json JSON,                 -- what vLLM got
        response_json        JSON,                 -- provider-shaped answer (or error body)
        prompt_token_ids     INTEGER[],
        token_ids            INTEGER[],            -- sampled tokens, EOS included
        logprobs             FLOAT[],              -- aligned with token_ids
        finish_reason        VARCHAR,
        prompt_tokens        INTEGER,
        completion_tokens    INTEGER,
        usage_json           JSON,
        queue_ms             DOUBLE,               -- waiting for a backend slot
        backend_ms           DOUBLE,
        total_ms             DOUBLE,
        error                VARCHAR,
        error_kind           VARCHAR,
        policy_version       VARCHAR,
        dropped              VARCHAR[],            -- provider fields not forwarded
        started_at           TIMESTAMPTZ,
        created_at           TIMESTAMPTZ DEFAULT now()
    );""" + _call_views("calls", "len(prompt_token_ids) AS prompt_len", "len(c.prompt_token_ids)") + """
    """,
    # 2: each conversation stored once. call_records keeps the harness's request text and
    # the prompt token ids as deltas against an earlier call of the session (delta.py);
    # the calls view rebuilds both whole. Old rows are kept whole.
    """
    DROP VIEW failures; DROP VIEW task_groups; DROP VIEW session_summary; DROP VIEW session_turns;
    """ + _CALL_RECORDS.format(name="call_records", key="PRIMARY KEY") + """
    INSERT INTO call_records
        SELECT call_id, session_id, seq, style, method, path, stream, requested_model,
               served_model, status_code, NULL, 0, 0,
               CASE WHEN json_type(request_json) = 'VARCHAR' THEN request_json->>'$'
                    ELSE request_json::VARCHAR END,
               NULL, backend_request_json, response_json, 0, prompt_token_ids::VARCHAR,
               len(prompt_token_ids), token_ids, logprobs, finish_reason, prompt_tokens,
               completion_tokens, usage_json, queue_ms, backend_ms, total_ms, error,
               error_kind, policy_version, dropped, started_at, created_at
        FROM calls;
    UPDATE call_records SET request_chars = length(request_middle);
    DROP TABLE calls;
    CREATE VIEW calls AS""" + _whole_calls() + """;""" + _call_views("call_records", "prompt_len", "c.prompt_len") + """
    """,
    # 3: the calls of one session, rebuilt from their deltas without rebuilding every call in
    # the file (a filter on the calls view does not reach into its recursion)
    "CREATE MACRO session_calls(sid) AS TABLE"
    + _whole_calls("session_id = sid", "c.session_id = sid") + ";",
    # 4: the rollout server's tasks, their sessions and every state change, so a restart
    # resumes work in flight and SQL users see where each session stands
    """
    CREATE TABLE rollout_tasks (
        task_id        VARCHAR PRIMARY KEY,
        spec           JSON NOT NULL,          -- the TaskRequest as submitted
        state          VARCHAR NOT NULL,       -- queued | running | done | cancelled
        priority       INTEGER DEFAULT 0,
        callback_state VARCHAR,                -- pending | sent | failed (no callback_url: NULL)
        callback_tries INTEGER DEFAULT 0,
        submitted_at   TIMESTAMPTZ DEFAULT now(),
        updated_at     TIMESTAMPTZ DEFAULT now()
    );
    CREATE TABLE rollout_sessions (
        session_id  VARCHAR PRIMARY KEY,       -- TASK~i (a retry after a lost node: TASK~i.rN)
        task_id     VARCHAR NOT NULL,
        sample      INTEGER NOT NULL,          -- i
        attempt     INTEGER NOT NULL DEFAULT 1,
        state       VARCHAR NOT NULL,          -- pending | assigned | init | ready | run | post_run
                                               -- | done | timed_out | failed | cancelled | lost
        node_id     VARCHAR,
        reward      DOUBLE,
        reason      VARCHAR,                   -- why it failed, timed out or was cancelled
        stats       JSON,                      -- calls, tokens, durations of each stage
        updated_at  TIMESTAMPTZ DEFAULT now()
    );
    CREATE TABLE rollout_events (
        event_at    TIMESTAMPTZ NOT NULL,
        task_id     VARCHAR NOT NULL,
        session_id  VARCHAR,                   -- NULL: a task-level event
        state       VARCHAR NOT NULL,
        node_id     VARCHAR,
        detail      VARCHAR
    );
    CREATE VIEW rollout_progress AS
        SELECT task_id, state, count(*) AS sessions, avg(reward) AS mean_reward
        FROM rollout_sessions GROUP BY task_id, state ORDER BY task_id, state;
    """,
    # 5: call_records without a primary key. Its ART index has to fit in the loader's
    # memory: DuckDB fails the insert otherwise (measured at 24 MB after 190k calls; so at
    # 128 MB after about a million). Each call is loaded once anyway: the log position
    # commits in the same transaction as its calls.
    "\n    " + _CALL_RECORDS.format(name="call_records_v5", key="NOT NULL") + """
    INSERT INTO call_records_v5 SELECT * FROM call_records;
    DROP TABLE call_records;
    ALTER TABLE call_records_v5 RENAME TO call_records;
    """,
    # 6: call_records becomes a view of two tables. The loader appends to call_records_main
    # only whole row groups of 2048 calls, which DuckDB writes straight to the file and
    # never rewrites; calls a reader asks for before 2048 are there go to call_records_tail.
    # DuckDB rewrites a table's part-filled last row group at every checkpoint, and needs
    # it in memory to append to it: in one table, that was most of the loader's CPU and
    # its memory peaks.
    """
    ALTER TABLE call_records RENAME TO call_records_main;
    """ + _CALL_RECORDS.format(name="call_records_tail", key="NOT NULL") + """
    CREATE VIEW call_records AS
        SELECT * FROM call_records_main UNION ALL SELECT * FROM call_records_tail;
    """,
    # 7: the closed loop (polar-train loop): one row per iteration and per optimizer step,
    # so a run's reward curve is one query; the checkpoint behind each policy version.
    """
    CREATE TABLE loop_iterations (
        run_id          VARCHAR NOT NULL,
        iteration       INTEGER NOT NULL,
        policy_version  INTEGER NOT NULL,   -- the version that sampled this iteration
        checkpoint      VARCHAR,            -- what it trained, served as policy_version + 1
        reward_mean     DOUBLE,
        reward_std      DOUBLE,
        eval_reward_mean DOUBLE,            -- held-out tasks (--eval-tasks), never trained on
        sessions_done   INTEGER,
        sessions_failed INTEGER,
        sessions_timed_out INTEGER,
        calls           INTEGER,
        tokens          BIGINT,             -- sampled tokens trained on
        stale_dropped   INTEGER,            -- calls of another policy version, not trained
        loss            DOUBLE,
        clip_frac       DOUBLE,
        logprob_abs_diff DOUBLE,            -- mean |trainer - vLLM| logprob of the sampled tokens
        rollout_s       DOUBLE,
        train_s         DOUBLE,
        sync_s          DOUBLE,
        sync_drain_s    DOUBLE,             -- of it: letting the calls in flight finish
        sync_reload_s   DOUBLE,             -- and vLLM's reload + prefix cache reset
        per_task        JSON,               -- {task: {mean, std, n}}
        finished_at     TIMESTAMPTZ DEFAULT now(),
        PRIMARY KEY (run_id, iteration)
    );
    CREATE TABLE loop_steps (
        run_id      VARCHAR NOT NULL,
        iteration   INTEGER NOT NULL,
        global_step INTEGER NOT NULL,
        metrics     JSON,
        PRIMARY KEY (run_id, global_step)
    );
    CREATE TABLE policy_versions (
        run_id      VARCHAR NOT NULL,
        version     INTEGER NOT NULL,
        checkpoint  VARCHAR,
        synced_at   TIMESTAMPTZ DEFAULT now(),
        PRIMARY KEY (run_id, version)
    );
    """,
    # 8: the sync's steps apart (sync_reload_s is now the reload alone), and the colocated
    # loop's sleep of vLLM during training.
    """
    ALTER TABLE loop_iterations ADD COLUMN sync_reset_s DOUBLE;
    ALTER TABLE loop_iterations ADD COLUMN sync_wake_s DOUBLE;
    ALTER TABLE loop_iterations ADD COLUMN sleep_s DOUBLE;
    """,
    # 9: the order tasks were submitted in. submitted_at is the time of the batch that first
    # saved a task (now() is per transaction), so tasks submitted together tied and a
    # restarted server took them in task_id order.
    """
    ALTER TABLE rollout_tasks ADD COLUMN submit_order BIGINT;
    """,
    # 10: policy_version is an integer (it was the gateway's integer as text, so ORDER BY put
    # 10 before 2). NULL: not known, a call whose serving weights the gateway could not
    # verify; such a call is never trained. Text that is no integer becomes NULL. The views
    # over it are made again with its new type.
    """
    ALTER TABLE call_records_main ALTER COLUMN policy_version TYPE INTEGER
        USING TRY_CAST(policy_version AS INTEGER);
    ALTER TABLE call_records_tail ALTER COLUMN policy_version TYPE INTEGER
        USING TRY_CAST(policy_version AS INTEGER);
    CREATE OR REPLACE VIEW call_records AS
        SELECT * FROM call_records_main UNION ALL SELECT * FROM call_records_tail;
    CREATE OR REPLACE VIEW calls AS""" + _whole_calls() + """;
    """,
    # 11: each session's output, kept after its sandbox is gone: the tail of its harness's
    # stdout and stderr and of its evaluator's output (credentials redacted); and the loop's
    # released sessions per iteration, by cause (backend unavailable, policy version unknown,
    # node stopped).
    """
    ALTER TABLE rollout_sessions ADD COLUMN harness_output VARCHAR;
    ALTER TABLE rollout_sessions ADD COLUMN eval_output VARCHAR;
    ALTER TABLE loop_iterations ADD COLUMN sessions_released INTEGER;
    ALTER TABLE loop_iterations ADD COLUMN released_why JSON;
    """,
    # 12: the rollout server's journal saves during each iteration (how many, p50 and p99 ms;
    # NULL for a remote server): the bookkeeping on every heartbeat's path, watched over long
    # runs. And the rewards' counts and the held-out std, for standard errors.
    """
    ALTER TABLE loop_iterations ADD COLUMN reward_n INTEGER;
    ALTER TABLE loop_iterations ADD COLUMN eval_reward_std DOUBLE;
    ALTER TABLE loop_iterations ADD COLUMN eval_reward_n INTEGER;
    ALTER TABLE loop_iterations ADD COLUMN journal_saves INTEGER;
    ALTER TABLE loop_iterations ADD COLUMN journal_save_p50_ms DOUBLE;
    ALTER TABLE loop_iterations ADD COLUMN journal_save_p99_ms DOUBLE;
    """,
    # 13: the weight version of every sampled token, as vLLM's engine labelled it
    # (/inference/v1/generate's weight_versions spans, expanded: one entry per token_ids
    # entry; a NULL entry: weights no sync of polar-mitm tagged). A call that straddles an
    # in-flight sync has two. NULL: the backend gave no spans (the /v1/chat/completions
    # fallback): every token was sampled by policy_version, as the gateway vouched.
    """
    ALTER TABLE call_records_main ADD COLUMN token_versions INTEGER[];
    ALTER TABLE call_records_tail ADD COLUMN token_versions INTEGER[];
    CREATE OR REPLACE VIEW call_records AS
        SELECT * FROM call_records_main UNION ALL SELECT * FROM call_records_tail;
    CREATE OR REPLACE VIEW calls AS""" + _whole_calls(extra=_LATER_CALL_COLUMNS) + """;
    DROP MACRO TABLE session_calls;
    CREATE MACRO session_calls(sid) AS TABLE"""
    + _whole_calls("session_id = sid", "c.session_id = sid", _LATER_CALL_COLUMNS) + """;
    """,
    # 14: staleness per token (--max-staleness): the sampled tokens left as context only for
    # being more than K versions behind, and those of an unknown version; with `tokens` (the
    # trained ones) they are every sampled token of the calls read.
    """
    ALTER TABLE loop_iterations ADD COLUMN stale_tokens BIGINT;
    ALTER TABLE loop_iterations ADD COLUMN unknown_version_tokens BIGINT;
    """,
    # 15: how the iteration's sync swapped vLLM's weights (inflight: paused where the calls
    # were; drain: held and drained first), and the seconds vLLM generated nothing for it.
    """
    ALTER TABLE loop_iterations ADD COLUMN sync_mode VARCHAR;
    ALTER TABLE loop_iterations ADD COLUMN sync_stall_s DOUBLE;
    """,
]

# What the loader writes to call_records.
RECORD_COLUMNS = [
    "call_id", "session_id", "seq", "style", "method", "path", "stream", "requested_model",
    "served_model", "status_code", "base_call", "request_prefix", "request_suffix",
    "request_middle", "request_chars", "backend_params", "response_json", "prompt_shared",
    "prompt_suffix", "prompt_len", "token_ids", "logprobs", "finish_reason", "prompt_tokens",
    "completion_tokens", "usage_json", "queue_ms", "backend_ms", "total_ms", "error",
    "error_kind", "policy_version", "dropped", "started_at", "created_at", "token_versions",
]
JSON_COLUMNS = {"backend_params", "response_json", "usage_json"}
