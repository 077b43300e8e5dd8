"""`polar-mitm dashboard`: a local, read-only web app over one or more databases and a loop's
run directory (docs/dashboard.md). FastAPI on uvicorn (app.py), change detection from files
only (live.py), the reads in polar_mitm.store.dashboard, put together across files in data.py,
one page of vanilla JS (static/: no build step, nothing from another host).

Pages (one single-page app, routed on location.pathname): `/` Runs, `/groups`, `/groups/TASK`,
`/sessions/SESSION`, `/compare?a=SESSION&b=SESSION` or `/compare?task=TASK`. Ids are
URL-encoded in links (`@` `~` `.` `:` `/` all pass).

The JSON API. Every answer is an object whose "generation" is the live generation (below) it
was read at or after (also the X-Polar-Generation header); 404 answers
{"generation", "error": {"message"}}. Rows name the database file they come from ("db").

GET /api/runs
    {"generation": N,
     "dbs": [{"db": PATH, "error": null | "why it could not be read", "calls": n, "sessions": n,
              "runs": [{"run_id": RUN,
                        "iterations": [loop_iterations row: every column as stored (run_id, iteration,
                                       policy_version, reward_mean, reward_std, reward_n, eval_reward_mean,
                                       eval_reward_std, eval_reward_n, sessions_done, sessions_failed,
                                       sessions_timed_out, sessions_released, released_why {cause: n},
                                       stale_dropped, calls, tokens, loss, clip_frac, rollout_s, train_s,
                                       sync_s, ..., per_task {TASK: {mean, std, n}}, finished_at ISO),
                                       plus "reward_se" and "eval_reward_se": std / sqrt(n - 1) of the
                                       stored population std (the sample std / sqrt(n), as the loop
                                       prints it), null when unknown; an older loop's row, without
                                       reward_n / eval_reward_std / eval_reward_n, has them filled in
                                       (n from per_task, else sessions_done; the held-out std and n
                                       from the server's sessions of its held-out tasks), and
                                       "reward_n_from" / "eval_reward_n_from" say so],
                        "versions": [policy_versions row: run_id, version, checkpoint, synced_at]}],
              "live": LIVE of this file}],
     "live": LIVE summed over the files (its "iterations" rows with "db"),
     "run": null | {"dir", "loop": loop.json as saved, "error", "iteration_dirs": [...],
                    "checkpoints": ["v2", "v3"], "plot": bool}}
    LIVE = {"tasks_by_state": {state: n}, "sessions_by_state": {state: n} (each sample's current
            attempt), "attempts": n (every session, retries included),
            "iterations": [{"run_id", "iteration", "held_out", "tasks", "tasks_by_state",
                            "sessions_by_state", "rewarded", "reward_mean"}]}: the rollout
            server's tables with its journal log's unfolded lines over them; run_id and
            iteration null for tasks outside a loop.

GET /api/groups
    {"generation", "errors": [{"db", "error"}],
     "groups": [{"task_id", "base_task", "run_id", "iteration", "held_out", "state" (the server's
                 task state; null: sessions named TASK~i by hand), "samples", "sessions" (attempts),
                 "by_state" {state: n}, "rewarded", "reward_mean", "reward_std" (population),
                 "reward_se", "reward_min", "reward_max", "instruction" (300 chars),
                 "order", "calls": CALLS, "db", "dbs"}]}
    CALLS = {"calls", "failed_calls", "prompt_tokens", "completion_tokens", "versions": [policy
             versions that served them], "unknown_version_calls"}: summed over every file.

GET /api/groups/{task_id}
    {"generation", "task_id", "base_task", "run_id", "iteration", "held_out", "state",
     "spec": the task as submitted, "db", "dbs", "events": [the task's own events],
     "reward": {"n", "mean", "std", "se", "min", "max"} of the current attempts,
     "samples": [{"session_id", "sample", "attempt", "current" (its sample's latest attempt: the
                  one trained on), "state", "reward", "reason", "node_id", "exit_code", "stats",
                  "harness_output", "eval_output", "reward_info", "calls": CALLS, "db",
                  "events": [{"at" ISO, "session_id", "state", "node_id", "detail"}]}]}

GET /api/sessions/{session_id}
    {"generation", "session_id", "db", "dbs" (the files that know it), "open_dbs" (how many the
     dashboard reads), "task_id", "base_task", "run_id", "iteration",
     "held_out", "state", "reward", "reason", "attempt", "sample", "node_id", "stats",
     "reward_info", "instruction", "siblings": [session ids of its task],
     "turns": [{"role": "system"|"user"|"assistant"|"tool", "text", "reasoning"?,
                "tool_calls"? [{"id", "name", "arguments"}], "tool_call_id"?, "name"?, "is_error"?,
                "call_seq"? (an assistant turn: the call that sampled it)}]: the conversation of
               its main chain's last call (the model it called most), with that call's answer,
     "tools": [{"name", "description", "parameters"}], "conversation_call": seq,
     "calls": [{"seq", "call_id", "style", "path", "requested_model", "served_model", "stream",
                "status_code", "policy_version" (null: unknown), "finish_reason",
                "latency": {"total_ms", "backend_ms", "queue_ms"}, "prompt_len",
                "completion_tokens", "logprobs_aligned", "error", "error_kind", "started_at",
                "tokens": [[id, text | null (no tokenizer), logprob | null]],
                "drift": [the drift events that name it]}],
     "drift": [{"call_seq": the call whose sampled tokens a later prompt re-renders,
                "later_seq": that later call, "at": token offset in call_seq's tokens where the
                re-rendering starts, "tokens": how many}],
     "harness_output", "eval_output", "tokenizer": the tokenizer's path or null}

GET /api/compare?a=SESSION&b=SESSION
    {"generation", "a": SESSION ANSWER, "b": SESSION ANSWER}   (404 if either is unknown)
GET /api/compare?task=TASK
    {"generation", "task": TASK, "versions": [{"policy_version": v | null,
        "reward": {"n", "mean", "std", "se", "min", "max"},
        "sessions": [{"session_id", "task_id", "run_id", "iteration", "held_out", "state", "reward",
                      "current", "calls": CALLS, "policy_version", "db"}]}]}
    every session of TASK and of the loop's TASK@RUN.I[.eval], by the policy version that
    served its calls (else its iteration's, from loop_iterations).

GET /api/info     {"generation", "dbs": [{"db", "bytes"}], "run_dir", "tokenizer", "poll_s", "min_refresh_s"}
GET /api/stream   text/event-stream: `event: hello` with {"generation": N} at once, then
                  `event: change` with {"generation": N} whenever the watched files change,
                  `: ping` every 15 s when idle.

Live updates. One background task stats files once a second (live.py): each database's
journal log and call log directories (names, sizes), the database file while no proxy loader
holds it, the run directory's loop.json, loop.png, iteration folders and checkpoints. A change
bumps the generation and is pushed on /api/stream; pages then fetch again. Answers are cached
per (endpoint, arguments, generation), and while changes keep coming each is read again at
most once per 5 s (the last answer is served meanwhile with its older generation, and the page
asks again): the database is read only when something changed, once for any number of
browsers, never on a timer, one connection at a time, none held between requests.
"""

from .app import make_app

__all__ = ["make_app"]
