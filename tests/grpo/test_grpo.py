"""The loss and its pieces on a tiny random Llama in float64 on CPU: the three builders
optimize one objective, row splitting with reused keys/values changes nothing, and the
loss terms do what they say."""

import math
import random

import pytest
import torch

from polar_mitm.grpo.advantages import AdvantageConfig, group_advantages, token_weights
from polar_mitm.grpo.loss import LossConfig, LossInputs, grpo_loss
from polar_mitm.grpo.packing import merge
from polar_mitm.grpo.policy import ForestRunner
from support.grpo_step import make_calls, rel, step_loss_and_grads, tiny_lm


@pytest.mark.parametrize("extra", [{}, {"retries": 1, "subagents": 1, "compactions": 1}])
def test_trie_and_per_request_give_the_same_loss_and_gradients(extra):
    lm = tiny_lm()
    calls = make_calls(drifts=1, **extra)
    loss_r, g_r, _ = step_loss_and_grads(lm, calls, "per_request")
    loss_t, g_t, step = step_loss_and_grads(lm, calls, "trie")
    assert step.stats.forward_tokens < sum(len(c.prompt) + len(c.tokens) for c in calls)
    assert loss_r != 0 and abs(loss_t - loss_r) <= 1e-6 * abs(loss_r)
    assert rel(g_t, g_r) <= 1e-6


@pytest.mark.parametrize("budget", [7, 23, 64])
def test_rows_that_reuse_keys_and_values_change_nothing(budget):
    lm = tiny_lm()
    calls = make_calls(drifts=1, retries=1)
    loss_a, g_a, whole = step_loss_and_grads(lm, calls, "trie", budget=100000)
    loss_b, g_b, split = step_loss_and_grads(lm, calls, "trie", budget=budget)
    assert len(whole.runner.rows) == 1 and len(split.runner.rows) > 3
    assert any(r.parent_row >= 0 for r in split.runner.rows)
    assert abs(loss_a - loss_b) <= 1e-9 * abs(loss_a) and rel(g_b, g_a) <= 1e-9


def test_attention_implementations_and_row_checkpointing_agree():
    """Chain rows with merged context/causal attention (polar_sdpa), dense boolean masks
    (sdpa), additive float masks (eager), and recomputed rows all give one gradient."""
    calls = make_calls(drifts=1, retries=1)
    loss_s, g_s, dense = step_loss_and_grads(tiny_lm("sdpa"), calls, "trie", budget=40)
    loss_p, g_p, chains = step_loss_and_grads(tiny_lm("polar_sdpa"), calls, "trie", budget=40)
    loss_e, g_e, _ = step_loss_and_grads(tiny_lm("eager"), calls, "trie", budget=40)
    loss_c, g_c, _ = step_loss_and_grads(tiny_lm("polar_sdpa"), calls, "trie", budget=40, checkpoint=True)
    runner = chains.runner
    assert any(runner.batch(i, 1).chain_after_ctx for i, r in enumerate(runner.rows) if r.attach >= 0)
    assert abs(loss_p - loss_s) <= 1e-12 * abs(loss_s) and rel(g_p, g_s) <= 1e-12
    # eager attention takes its softmax in float32 whatever the model's dtype
    assert abs(loss_e - loss_s) <= 1e-6 * abs(loss_s) and rel(g_e, g_s) <= 1e-6
    assert abs(loss_c - loss_p) <= 1e-12 * abs(loss_p) and rel(g_c, g_p) <= 1e-12


def test_a_row_of_several_subtrees_attends_one_subtree_at_a_time():
    """polar_sdpa runs a packed row's own attention per subtree (causal for a chain, its own
    tree mask otherwise): the same loss and gradients as one dense mask over the row."""
    calls = make_calls(drifts=1, retries=1)
    kinds = set()
    for budget in (40, 100, 300):
        loss_s, g_s, _ = step_loss_and_grads(tiny_lm("sdpa"), calls, "trie", budget=budget)
        loss_p, g_p, step = step_loss_and_grads(tiny_lm("polar_sdpa"), calls, "trie", budget=budget)
        runner = step.runner
        for i, row in enumerate(runner.rows):
            p = runner.batch(i, runner.context_len(i)).segments
            if p:   # the pieces cover the row, in order
                assert p[0][0] == 0 and p[-1][1] == len(row) and all(a[1] == b[0] for a, b in zip(p, p[1:]))
                if len(p) > 1:
                    kinds |= {("chain" if chain else "tree", runner.context_len(i) > 0) for _, _, chain in p}
        assert abs(loss_p - loss_s) <= 1e-12 * abs(loss_s) and rel(g_p, g_s) <= 1e-12
    # pieces of both kinds, under a context and not
    assert {("chain", True), ("tree", True), ("tree", False)} <= kinds


def test_prefix_merging_matches_without_drift_and_the_difference_with_drift_is_measured(capsys):
    lm = tiny_lm()
    clean = make_calls(drifts=0, side_calls=1)
    loss_r, g_r, _ = step_loss_and_grads(lm, clean, "per_request")
    loss_m, g_m, step = step_loss_and_grads(lm, clean, "prefix_merging")
    assert step.stats.dropped_calls == 0 and step.stats.drift_events == 0
    assert abs(loss_m - loss_r) <= 1e-6 * abs(loss_r) and rel(g_m, g_r) <= 1e-6

    drifted = make_calls(drifts=2)
    loss_r, g_r, _ = step_loss_and_grads(lm, drifted, "per_request")
    loss_m, g_m, step = step_loss_and_grads(lm, drifted, "prefix_merging")
    assert step.stats.drift_events > 0
    diff_loss, diff_grad = abs(loss_m - loss_r) / abs(loss_r), rel(g_m, g_r)
    with capsys.disabled():
        print(f"\nprefix_merging vs exact contexts with {step.stats.drift_events} drift events: "
              f"loss differs by {diff_loss:.2e} relative, gradients by {diff_grad:.2e}")
    assert diff_grad > 1e-6   # training on contexts vLLM never saw is measurably different


def test_flex_block_mask_matches_the_dense_mask():
    """The GPU path's BlockMask gives the attention of the CPU path's dense mask, row by row,
    context rows included (flex attention run eagerly here; GPUs compile it)."""
    from torch.nn.attention.flex_attention import flex_attention

    from polar_mitm.grpo.packing import row_context
    from polar_mitm.grpo.policy import dense_mask, flex_mask
    from polar_mitm.grpo.trajectories import build

    forest = merge(build(make_calls(drifts=1, retries=1), "trie").samples)
    runner = ForestRunner(forest, 40, torch.device("cpu"), "sdpa")
    torch.manual_seed(0)
    checked = 0
    for row in runner.rows:
        g = torch.tensor(row.nodes)
        e = torch.tensor([forest.subtree_end[v] for v in row.nodes])
        ctx = len(row_context(forest, row))
        q = torch.randn(1, 2, len(g), 8)
        k, v = torch.randn(1, 2, ctx + len(g), 8), torch.randn(1, 2, ctx + len(g), 8)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(g, e, ctx))
        got = flex_attention(q, k, v, block_mask=flex_mask(g, e, ctx, "cpu"))
        assert torch.allclose(got, want, atol=1e-5)
        checked += ctx > 0
    assert checked > 0


def test_flex_block_mask_has_the_tiles_create_block_mask_gives():
    """flex_mask counts each tile's visible pairs from intervals instead of evaluating the
    whole rows x (context + rows) grid: the same full, partial and skipped tiles as torch's
    create_block_mask, over row and context lengths on and off the 128 tile, rows that are
    whole forests and rows that are any depth-first subset of one (stems, packed subtrees)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from polar_mitm.grpo.packing import subtree_end
    from polar_mitm.grpo.policy import flex_mask

    rng = random.Random(3)
    fields = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]
    for trial in range(30):
        size = rng.choice([1, 40, 127, 128, 129, 300, 700])
        parent = [-1] + [rng.choice([i - 1, i - 1, rng.randrange(i), -1]) for i in range(1, size)]
        end = subtree_end(parent)
        nodes = range(size) if trial % 2 else sorted(rng.sample(range(size), max(1, size * 2 // 3)))
        g = torch.tensor(list(nodes))
        e = torch.tensor([end[v] for v in nodes])
        ctx = rng.choice([0, 1, 100, 128, 256, 300])

        def mask_mod(b, h, q, kv):
            k = (kv - ctx).clamp(min=0)
            return (kv < ctx) | ((g[k] <= g[q]) & (g[q] < e[k]))

        want = create_block_mask(mask_mod, 1, None, len(g), ctx + len(g), device="cpu")
        got = flex_mask(g, e, ctx, "cpu")
        assert got.seq_lengths == want.seq_lengths
        for name in fields:
            a, b = getattr(got, name), getattr(want, name)
            assert a.shape == b.shape and torch.equal(a.long(), b.long()), (trial, len(g), ctx, name)


# ---- loss terms ------------------------------------------------------------------------------

def inputs(lp, old, roll, adv, w=None, ref=None):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    lp = t(lp).requires_grad_()
    return LossInputs(lp, t(old), t(roll), t(adv), t(w or [1.0] * len(adv)), t(ref) if ref else None)


def test_first_visit_is_a_plain_policy_gradient_weighted_by_truncated_importance():
    x = inputs([-1.0, -2.0], [-1.0, -2.0], [-1.5, -0.5], [1.0, -1.0], [0.5, 0.5])
    out = grpo_loss(x, LossConfig())
    out.loss.backward()
    tis = [min(math.exp(0.5), 2.0), math.exp(-1.5)]
    assert out.loss.item() == pytest.approx(-0.5 * tis[0] + 0.5 * tis[1])
    assert x.logprobs.grad.tolist() == pytest.approx([-0.5 * tis[0], 0.5 * tis[1]])
    assert out.metrics["clipped"] == 0 and out.metrics["tis_capped"] == 0


def test_clip_higher_stops_the_gradient_outside_the_trust_region():
    # ratio 1.3 > 1.28 with A > 0: clipped; ratio 0.7 < 0.8 with A < 0: clipped; inside: not
    lps = [math.log(1.3), math.log(0.7), math.log(1.1)]
    x = inputs(lps, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, -1.0, 1.0])
    out = grpo_loss(x, LossConfig())
    out.loss.backward()
    assert x.logprobs.grad[:2].tolist() == [0.0, 0.0] and x.logprobs.grad[2] < 0
    assert out.metrics["clipped"] == 2
    # the asymmetric bound: 1.25 is still inside for A > 0 (clip_high 0.28), 0.75 is outside for A < 0
    x = inputs([math.log(1.25), math.log(0.75)], [0.0, 0.0], [0.0, 0.0], [1.0, -1.0])
    grpo_loss(x, LossConfig()).loss.backward()
    assert x.logprobs.grad[0] != 0 and x.logprobs.grad[1] == 0


def test_tis_cap_and_k3_kl():
    x = inputs([0.0], [0.0], [-5.0], [1.0])
    out = grpo_loss(x, LossConfig(tis_cap=2.0))
    assert out.loss.item() == pytest.approx(-2.0) and out.metrics["tis_capped"] == 1
    x = inputs([-1.0], [-1.0], [-1.0], [0.0], ref=[-1.0])
    assert grpo_loss(x, LossConfig(kl_coef=0.1)).loss.item() == 0.0
    x = inputs([-1.0], [-1.0], [-1.0], [0.0], ref=[-2.0])
    d = -1.0
    assert grpo_loss(x, LossConfig(kl_coef=0.1)).loss.item() == pytest.approx(0.1 * (math.exp(d) - d - 1))


def test_group_advantages():
    groups = {"a~0": "a", "a~1": "a", "a~2": "a", "b~0": "b", "b~1": "b", "c~0": "c"}
    rewards = {"a~0": 1.0, "a~1": 0.0, "a~2": 0.5, "b~0": 1.0, "b~1": 1.0, "c~0": 1.0}
    plain = group_advantages(rewards, groups, AdvantageConfig(scale_std=False))
    assert plain["a~0"] == pytest.approx(0.5) and plain["a~1"] == pytest.approx(-0.5)
    assert plain["b~0"] == plain["b~1"] == plain["c~0"] == 0.0     # no variance, no signal
    std = math.sqrt(((0.5) ** 2 + 0.5 ** 2 + 0) / 3)
    scaled = group_advantages(rewards, groups)
    assert scaled["a~0"] == pytest.approx(0.5 / (std + 1e-6))
    loo = group_advantages(rewards, groups, AdvantageConfig(scale_std=False, leave_one_out=True))
    assert loo["a~0"] == pytest.approx(1.0 - 0.25) and loo["a~2"] == pytest.approx(0.0)


def test_token_and_session_normalization_weigh_what_they_say():
    calls = make_calls(drifts=0)
    tok = token_weights(calls, "token")
    assert sum(map(sum, tok)) == pytest.approx(1.0) and len({w for ws in tok for w in ws}) == 1
    ses = token_weights(calls, "session")
    per_session = {}
    for c, ws in zip(calls, ses):
        per_session[c.session_id] = per_session.get(c.session_id, 0.0) + sum(ws)
    assert all(v == pytest.approx(1 / len(per_session)) for v in per_session.values())
