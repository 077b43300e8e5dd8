"""Per-token versions on the trainer's side: a call a sync split between two versions is
staled token by token (--max-staleness), a token of an unknown version is never trained, and
a masked token stays in the sequence as context only, in all three builders: no target, no
loss, no share of the normalization; every trained token keeps its own vLLM logprob."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from polar_mitm.grpo.advantages import group_advantages, token_weights
from polar_mitm.grpo.calls import at_most_stale
from polar_mitm.grpo.config import BUILDERS
from polar_mitm.grpo.trajectories import build
from polar_mitm.trainer_input import UNKNOWN_VERSION, Call
from support.grpo_step import make_calls, step_loss_and_grads, tiny_lm

U = UNKNOWN_VERSION


def _straddling(v: int = 3) -> Call:
    """A call a sync switched from v to v + 1 after its third sampled token."""
    return Call("s~0", "g", 1, prompt=[5, 6, 7], tokens=[10, 11, 12, 13, 14, 15, 16],
                logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7], policy_version=v,
                token_versions=[v, v, v, v + 1, v + 1, v + 1, v + 1], reward=1.0)


def _targets(calls, builder):
    """Each builder's targets as {(call, j): (logprob, context, token)}."""
    out = {}
    for s in build(calls, builder).samples:
        for node, k, j, lp in zip(s.target_node, s.target_call, s.target_index, s.target_logprob):
            assert (k, j) not in out
            out[(k, j)] = (lp, s.context(node), s.tokens[node])
    return out


def test_a_call_straddling_a_sync_trains_only_the_new_versions_tokens_at_k0():
    call = _straddling(3)
    fresh = at_most_stale([call], version=4, max_staleness=0)
    assert (fresh.tokens, fresh.trained_tokens, fresh.stale_tokens, fresh.unknown_tokens) == (7, 4, 3, 0)
    assert fresh.stale_calls == 0 and fresh.stale_fraction == pytest.approx(3 / 7)
    [kept] = fresh.calls
    assert list(kept.trained()) == [3, 4, 5, 6]
    for builder in BUILDERS:
        got = _targets([kept], builder)
        assert sorted(got) == [(0, 3), (0, 4), (0, 5), (0, 6)], builder
        for (_, j), (lp, context, token) in got.items():
            # each token's own behaviour logprob; the v tokens before it are its context
            assert lp == call.logprobs[j] and token == call.tokens[j], builder
            assert context == [5, 6, 7, *call.tokens[:j]], builder
        stats = build([kept], builder).stats
        assert (stats.forward_tokens, stats.trained_tokens) == (10, 4), builder
    # K=1 trains every token; training v + 2 at K=0 trains none: the call is left out
    assert list(at_most_stale([call], 4, 1).calls[0].trained()) == list(range(7))
    gone = at_most_stale([call], 5, 0)
    assert gone.calls == [] and gone.stale_calls == 1 and gone.stale_tokens == 7


def test_whole_calls_of_one_version_are_staled_as_before():
    calls = [replace(_straddling(), seq=i, token_versions=None, policy_version=v)
             for i, v in enumerate([2, 3, 4])]
    fresh = at_most_stale(calls, version=4, max_staleness=1)
    assert [c.policy_version for c in fresh.calls] == [3, 4]
    assert (fresh.stale_calls, fresh.stale_tokens, fresh.trained_tokens) == (1, 7, 14)


def test_tokens_of_an_unknown_version_are_never_trained_wherever_they_are():
    # a restarted vLLM tags its tokens "default" (unknown) until the next sync: at either end,
    # or in between when the versions are not in order
    call = replace(_straddling(), token_versions=[U, U, 4, 4, U, 5, 5])
    assert list(call.trained()) == [2, 3, 5, 6]
    fresh = at_most_stale([call], version=5, max_staleness=3)
    assert (fresh.trained_tokens, fresh.stale_tokens, fresh.unknown_tokens) == (4, 0, 3)
    fresh = at_most_stale([call], version=5, max_staleness=0)
    assert list(fresh.calls[0].trained()) == [5, 6]
    assert (fresh.trained_tokens, fresh.stale_tokens, fresh.unknown_tokens) == (2, 2, 3)
    for builder in BUILDERS:
        assert sorted(_targets(fresh.calls, builder)) == [(0, 5), (0, 6)], builder
    all_unknown = replace(call, token_versions=[U] * 7)
    assert list(all_unknown.trained()) == [] and at_most_stale([all_unknown], 5, 9).calls == []


def _masked(calls: list[Call], seed: int) -> list[Call]:
    """The calls with per-token versions: some sampled across a sync (v0 then v1), some whole at
    v0 or v1, and a few tokens of an unknown version; then --max-staleness 0 at v1."""
    rng = random.Random(seed)
    out = []
    for c in calls:
        n = len(c.tokens)
        cut = rng.choice([0, n, rng.randint(1, max(n - 1, 1))])   # all v1, all v0, or a switch
        versions = [0] * cut + [1] * (n - cut)
        if n > 2 and rng.random() < 0.3:
            versions[rng.randrange(n)] = U
        out.append(replace(c, policy_version=versions[0] if versions[0] != U else 0, token_versions=versions))
    return at_most_stale(out, version=1, max_staleness=0).calls


@pytest.mark.parametrize("builder", BUILDERS)
def test_masked_tokens_are_context_only_in_every_builder(builder):
    calls = _masked(make_calls(drifts=0, side_calls=0), seed=1)
    masked = sum(len(c.tokens) - len(c.trained()) for c in calls)
    assert masked > 0 and all(c.trained() for c in calls)
    whole = [replace(c, token_versions=None, min_version=None) for c in calls]
    got, every = _targets(calls, builder), _targets(whole, builder)
    # the trained tokens, each exactly where it is without the mask, with its own logprob
    assert set(got) == {(k, j) for k, c in enumerate(calls) for j in c.trained()}
    assert all(got[key] == every[key] for key in got)
    # the masked tokens are still run: the same sequences, fewer targets
    stats, whole_stats = build(calls, builder).stats, build(whole, builder).stats
    assert stats.forward_tokens == whole_stats.forward_tokens
    assert stats.trained_tokens == whole_stats.trained_tokens - masked


def test_the_weights_of_masked_tokens_are_zero_and_the_rest_normalize():
    calls = _masked(make_calls(drifts=0), seed=2)
    trained = sum(len(c.trained()) for c in calls)
    for normalization in ("token", "session"):
        weights = token_weights(calls, normalization)
        assert sum(map(sum, weights)) == pytest.approx(1.0), normalization
        for c, ws in zip(calls, weights):
            assert len(ws) == len(c.tokens)
            assert all((w > 0) == (j in set(c.trained())) for j, w in enumerate(ws)), normalization
    assert {w for ws in token_weights(calls, "token") for w in ws} == {0.0, 1.0 / trained}


def _hand_loss(lm, calls: list[Call]) -> float:
    """The step's loss at its first visit (ratio 1), from a plain forward of each call's
    P + R: -sum over the trained tokens of w * advantage * min(exp(trainer - vLLM), cap),
    w = 1 / trained tokens (token normalization)."""
    adv = group_advantages({c.session_id: c.reward for c in calls}, {c.session_id: c.group for c in calls})
    n = sum(len(c.trained()) for c in calls)
    total = 0.0
    with torch.no_grad():
        for c in calls:
            ids = torch.tensor([list(c.prompt) + list(c.tokens)])
            logp = torch.log_softmax(lm(ids).logits[0].double(), -1)
            for j in c.trained():
                at = len(c.prompt) + j
                lp = float(logp[at - 1, c.tokens[j]])
                total -= adv[c.session_id] * min(math.exp(lp - c.logprobs[j]), 2.0) / n
    return total


@pytest.mark.parametrize("builder", BUILDERS)
def test_the_loss_over_masked_calls_is_the_hand_computed_one(builder):
    lm = tiny_lm()
    calls = _masked(make_calls(drifts=0, side_calls=0), seed=3)
    loss, grads, _ = step_loss_and_grads(lm, calls, builder)
    want = _hand_loss(lm, calls)
    assert want != 0 and loss == pytest.approx(want, rel=1e-6)   # as builders agree (test_grpo)
    # and not the loss of the calls unmasked
    whole = [replace(c, token_versions=None, min_version=None) for c in calls]
    assert abs(_hand_loss(lm, whole) - want) > 1e-2 * abs(want)
