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
