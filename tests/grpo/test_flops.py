"""polar_mitm.grpo.flops: the FLOP count that bench_trainer and gpu_check put beside tokens/s."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from polar_mitm.grpo.flops import model_flops, token_cost
from polar_mitm.grpo.synthetic import Shape, group
from polar_mitm.grpo.trajectories import Sample, build

TINY = SimpleNamespace(num_hidden_layers=1, hidden_size=2, intermediate_size=3, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=2, vocab_size=5)


def test_one_chain_by_hand():
    s = Sample(group="g")
    s.add_chain([7, 8, 9])
    s.add_target(2, 0, 0, -1.0)
    # per token: q,o 2x2 each, k,v 2x2 each -> 2*(2+2)*2 = 16, MLP 3*2*3 = 18; per pair:
    # QK and PV at head dim 2 -> 4; pairs 1+2+3; lm_head 2x5, twice forward + backward's 2
    macs = 3 * 34 + 6 * 4 + 2 * 5 * 4 / 3
    assert model_flops(TINY, [s]) == pytest.approx(6 * macs)


def test_head_dim_defaults_to_hidden_over_heads():
    s = Sample(group="g")
    s.add_chain([1, 2])
    no_head_dim = SimpleNamespace(**{k: v for k, v in vars(TINY).items() if k != "head_dim"})
    assert model_flops(no_head_dim, [s]) == model_flops(TINY, [s])


def test_a_trie_token_costs_more_than_a_merged_one_under_a_long_shared_prompt():
    """The trie drops the copies of the shared prompt, the tokens with the shortest
    contexts: what it keeps attends further back on average."""
    calls = group("t", Shape(sessions=4, turns=3, shared=400, tool=(5, 20), response=(3, 12), vocab=64),
                  random.Random(0), reward=lambda i: float(i % 2))
    samples = {b: build(calls, b).samples for b in ("trie", "prefix_merging")}
    flops = {b: model_flops(TINY, s) for b, s in samples.items()}
    tokens = {b: sum(len(x) for x in s) for b, s in samples.items()}
    assert token_cost(flops, tokens, "prefix_merging", "prefix_merging") == pytest.approx(1.0)
    assert token_cost(flops, tokens, "trie", "prefix_merging") > 1.0
    assert flops["trie"] < flops["prefix_merging"]
