"""Versioned schema. Each migration runs once, in order, inside one transaction; the
applied version is kept in schema_version. Add migrations at the end, never edit one."""

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
    );
    CREATE VIEW session_turns AS
        SELECT session_id, seq, style, requested_model, served_model, finish_reason,
               len(prompt_token_ids) AS prompt_len, len(token_ids) AS completion_len,
               status_code, error_kind, total_ms, created_at
        FROM calls ORDER BY session_id, seq;
    CREATE VIEW session_summary AS
        SELECT s.session_id, s.task_id, s.source, s.reward, count(c.call_id) AS calls,
               count(c.error) AS failed_calls,
               sum(len(c.prompt_token_ids)) AS prompt_tokens,
               sum(len(c.token_ids)) AS completion_tokens,
               min(c.created_at) AS first_call, max(c.created_at) AS last_call
        FROM sessions s LEFT JOIN calls c USING (session_id)
        GROUP BY ALL ORDER BY s.session_id;
    CREATE VIEW task_groups AS
        SELECT task_id, count(*) AS sessions, count(reward) AS rewarded,
               avg(reward) AS mean_reward, stddev_pop(reward) AS reward_std,
               sum(calls) AS calls
        FROM session_summary WHERE task_id IS NOT NULL
        GROUP BY task_id ORDER BY task_id;
    CREATE VIEW failures AS
        SELECT session_id, seq, style, path, status_code, error_kind, error, total_ms, created_at
        FROM calls WHERE error IS NOT NULL ORDER BY created_at;
    """,
]

CALL_COLUMNS = [
    "call_id", "session_id", "seq", "style", "method", "path", "stream", "requested_model",
    "served_model", "status_code", "request_json", "normalized_json", "backend_request_json",
    "response_json", "prompt_token_ids", "token_ids", "logprobs", "finish_reason",
    "prompt_tokens", "completion_tokens", "usage_json", "queue_ms", "backend_ms", "total_ms",
    "error", "error_kind", "policy_version", "dropped", "started_at",
]
JSON_COLUMNS = {"request_json", "normalized_json", "backend_request_json", "response_json",
                "usage_json"}
