"""The loop's figures: which iterations run the held-out tasks (--eval-every), the standard
errors the plot draws, and the held-out rise the loop prints at its end."""

from __future__ import annotations

import math
from pathlib import Path

from polar_mitm.loop.run import held_out_rise, plot_loop, standard_error
from polar_mitm.loop.options import LoopOptions


def test_eval_every_runs_the_held_out_tasks_at_the_first_every_kth_and_the_last_iteration():
    opts = LoopOptions(tasks_file="t.jsonl", iterations=10, out=Path("x"), eval_every=4)
    assert [it for it in range(10) if opts.evaluates(it)] == [0, 4, 8, 9]
    every = LoopOptions(tasks_file="t.jsonl", iterations=3, out=Path("x"))
    assert [it for it in range(3) if every.evaluates(it)] == [0, 1, 2]


def _row(it, mean, std, n, held=None):
    r = {"iteration": it, "reward_mean": mean, "reward_std": std, "reward_n": n, "loss": 0.1,
         "eval_reward_mean": None, "eval_reward_std": None, "eval_reward_n": None}
    if held is not None:
        r.update(eval_reward_mean=held[0], eval_reward_std=held[1], eval_reward_n=held[2])
    return r


def test_the_rise_is_measured_from_the_first_to_the_last_evaluated_iteration(tmp_path):
    assert standard_error(0.3, 10) == 0.3 / 3.0
    assert standard_error(0.3, 1) is None and standard_error(None, 10) is None
    rows = [_row(0, 0.1, 0.2, 32, (0.10, 0.2, 65)), _row(1, 0.2, 0.2, 32), _row(2, 0.3, 0.2, 32),
            _row(3, 0.3, 0.2, 32, (0.25, 0.3, 65))]
    rise = held_out_rise(rows)
    assert rise is not None and (rise.first, rise.last) == (1, 4)
    assert math.isclose(rise.rise, 0.15)
    assert math.isclose(rise.se, math.sqrt((0.2 / 8) ** 2 + (0.3 / 8) ** 2))
    assert math.isclose(rise.errors, 0.15 / rise.se)
    assert "+0.150" in rise.line() and "standard errors" in rise.line()
    assert held_out_rise(rows[:2]) is None          # one held-out figure: no rise
    plot_loop(rows, tmp_path / "loop.png")          # iterations without held-out figures are left out
    assert (tmp_path / "loop.png").stat().st_size > 0


def test_the_iteration_line_says_the_share_of_tokens_left_stale():
    from polar_mitm.grpo.calls import at_most_stale
    from polar_mitm.loop.figures import iteration_line
    from polar_mitm.trainer_input import UNKNOWN_VERSION as U, Call

    # --max-staleness 0 at v2: a call sampled across the sync (3 tokens v1, 2 v2), one of v2
    # with an unknown token, one wholly of v1
    calls = [Call("s~0", "g", 1, [1], [2, 3, 4, 5, 6], [-1.0] * 5, policy_version=1,
                  token_versions=[1, 1, 1, 2, 2]),
             Call("s~0", "g", 2, [1], [7, 8], [-1.0] * 2, policy_version=2, token_versions=[2, U]),
             Call("s~1", "g", 1, [1], [9, 9, 9], [-1.0] * 3, policy_version=1)]
    fresh = at_most_stale(calls, version=2, max_staleness=0)
    counts = (fresh.stale_calls, fresh.trained_tokens, fresh.stale_tokens, fresh.unknown_tokens)
    assert len(fresh.calls) == 2 and counts == (1, 3, 6, 1)
    row = {"iteration": 0, "policy_version": 2, "reward_mean": 0.5, "reward_std": 0.1, "eval_reward_mean": None,
           "calls": len(fresh.calls), "tokens": fresh.trained_tokens, "stale_tokens": fresh.stale_tokens,
           "unknown_version_tokens": fresh.unknown_tokens, "loss": 0.1, "rollout_s": 1.0, "train_s": 1.0,
           "sync_s": 0.1}
    line = iteration_line(row)   # type: ignore[arg-type]
    assert "2 calls (3 tokens, 60.0% stale, 1 of an unknown version), loss" in line, line
    row.update(stale_tokens=0, unknown_version_tokens=0)
    assert "2 calls (3 tokens, 0.0% stale), loss" in iteration_line(row)   # type: ignore[arg-type]
    del row["stale_tokens"]   # a row stored before the column: as it was
    assert "; 2 calls, loss" in iteration_line(row)   # type: ignore[arg-type]
