"""Trajectory builders, with no model: exactness of the trie, Polar's prefix merging as
specified, and the forward-token bounds between the three."""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm.grpo.calls import drift_events, lcp
from polar_mitm.grpo.packing import merge, plan_rows, row_context
from polar_mitm.grpo.synthetic import EOT, Shape, group
from polar_mitm.grpo.trajectories import build
from polar_mitm.trainer_input import Call

shapes = st.builds(
    Shape, sessions=st.integers(1, 4), turns=st.integers(1, 6), shared=st.integers(1, 40),
    tool=st.just((1, 6)), response=st.just((1, 6)), drifts=st.integers(0, 2), side_calls=st.integers(0, 2),
    retries=st.integers(0, 2), subagents=st.integers(0, 1), compactions=st.integers(0, 1),
    vocab=st.sampled_from([6, 12, 200]))   # tiny vocabularies make accidental shared prefixes


def calls_for(shape: Shape, seed: int, tasks: int = 2) -> list[Call]:
    rng = random.Random(seed)
    return [c for t in range(tasks) for c in group(f"task{t}", shape, rng)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, seed=st.integers(0, 10**6))
def test_trie_trains_every_sampled_token_in_its_sampling_context(shape, seed):
    calls = calls_for(shape, seed)
    built = build(calls, "trie")
    seen = set()
    for s in built.samples:
        for node, k, j, lp in zip(s.target_node, s.target_call, s.target_index, s.target_logprob):
            c = calls[k]
            assert s.group == c.group
            assert s.tokens[node] == c.tokens[j] and lp == c.logprobs[j]
            assert s.context(node) == list(c.prompt) + list(c.tokens[:j])
            assert s.depth[node] == len(c.prompt) + j
            seen.add((k, j))
    # exactly all calls' sampled tokens, each once
    assert seen == {(k, j) for k, c in enumerate(calls) for j in range(len(c.tokens))}
    assert built.stats.trained_tokens == sum(len(c.tokens) for c in calls)

    per_request = build(calls, "per_request").stats
    merged = build(calls, "prefix_merging")
    assert built.stats.forward_tokens <= per_request.forward_tokens
    # Polar drops the calls after a chain break (a retry's empty tail); those calls' tokens
    # are outside its count, so they are added back for the comparison.
    dropped = _dropped_tokens(calls, merged)
    assert built.stats.forward_tokens <= merged.stats.forward_tokens + merged.stats.drift_tokens + dropped
    if merged.stats.dropped_calls == 0:
        assert built.stats.forward_tokens <= merged.stats.forward_tokens + merged.stats.drift_tokens


def _dropped_tokens(calls, merged) -> int:
    kept = {k for s in merged.samples for k in s.target_call}
    return sum(len(c.prompt) + len(c.tokens) for k, c in enumerate(calls) if k not in kept)


@settings(max_examples=150, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10**6), budget=st.integers(1, 40), pack=st.integers(1, 40),
       chains=st.booleans())
def test_rows_cover_every_node_once_and_see_exactly_its_ancestors(shape, seed, budget, pack, chains):
    built = build(calls_for(shape, seed, tasks=1), "trie")
    f = merge(built.samples)
    rows = plan_rows(f, budget, pack_limit=pack, chains=chains)
    covered = sorted(v for r in rows for v in r.nodes)
    assert covered == list(range(len(f.tokens)))
    row_of = {v: i for i, r in enumerate(rows) for v in r.nodes}
    for i, r in enumerate(rows):
        assert len(r) <= budget
        ctx = row_context(f, r)
        for v in r.nodes:  # what a position attends to = context + in-row ancestors = its ancestors
            seen = ctx + [k for k in r.nodes if k <= v < f.subtree_end[k]]
            anc, p = [v], f.parent[v]
            while p >= 0:
                anc.append(p)
                p = f.parent[p]
            assert sorted(seen) == sorted(anc)
        if r.parent_row >= 0:
            assert row_of[r.attach] == r.parent_row and i in rows[r.parent_row].children
            assert r.parent_row < i


def test_no_drift_makes_one_chain_per_session_and_trie_shares_the_group_prefix():
    shape = Shape(sessions=4, turns=5, shared=50, tool=(3, 8), response=(2, 6), drifts=0, side_calls=0)
    calls = calls_for(shape, 1, tasks=1)
    pm = build(calls, "prefix_merging")
    assert pm.stats.sequences == 4 and pm.stats.dropped_calls == 0 and pm.stats.drift_events == 0
    trie = build(calls, "trie")
    assert trie.stats.sequences == 1
    # the shared prompt is computed once instead of once per session
    assert pm.stats.forward_tokens - trie.stats.forward_tokens >= 3 * 50
    # with no drift, each merged chain is exactly the last call's P + R
    for s in pm.samples:
        last = calls[s.target_call[-1]]
        assert s.tokens == list(last.prompt) + list(last.tokens)


def _call(sid, seq, prompt, tokens, finish="stop"):
    return Call(session_id=sid, group="g", seq=seq, prompt=prompt, tokens=tokens,
                logprobs=[-0.1] * len(tokens), finish_reason=finish, reward=1.0)


def test_prefix_merging_is_polars_algorithm():
    # turn 1: P1 R1; turn 2 re-renders R1 = [7, 8, EOT] as [78, EOT] (drift) then adds [9, 9]
    p1, r1 = [1, 5, 6], [7, 8, EOT]
    p2 = p1 + [78, EOT] + [9, 9]
    r2 = [10, EOT]
    p3 = p2 + r2 + [11]            # clean continuation
    r3 = [12, 13]                  # cut by length: no end of turn sampled
    p4 = p3 + r3 + [EOT, 14]       # the template closes the turn
    r4 = [15, EOT]
    side = _call("s", 5, [99, 98], [97, EOT])
    calls = [_call("s", 1, p1, r1), _call("s", 2, p2, r2), _call("s", 3, p3, r3, "length"),
             _call("s", 4, p4, r4), side]
    pm = build(calls, "prefix_merging")
    assert pm.stats.sequences == 2 and pm.stats.dropped_calls == 0
    chain = pm.samples[0]
    # P1 R1(raw) | [9, 9] after the first EOT | R2 | [11] | R3 | [EOT, 14] (EOT kept: R3 was cut) | R4
    assert chain.tokens == p1 + r1 + [9, 9] + r2 + [11] + r3 + [EOT, 14] + r4
    trained = [chain.tokens[n] for n in chain.target_node]
    assert trained == r1 + r2 + r3 + r4
    # the drift is reported, and the trie keeps the raw R1 as its own branch
    (d,) = drift_events(calls)
    assert (d.call, d.later, d.at) == (0, 1, 0)
    trie = build(calls, "trie")
    assert trie.stats.drift_events == 1 and trie.stats.branches == 3   # R1 raw, main line, side call


def test_prefix_merging_truncates_a_chain_at_a_retry_as_polar_does():
    p1 = [1, 2]
    calls = [_call("s", 1, p1, [3, EOT]), _call("s", 2, p1, [4, EOT]),   # retry: same prompt
             _call("s", 3, p1 + [4, EOT, 6], [7, EOT])]
    pm = build(calls, "prefix_merging")
    assert pm.stats.dropped_calls == 2       # the retry and everything after it
    trie = build(calls, "trie")
    assert trie.stats.trained_tokens == 6    # the trie keeps all three


def test_lcp():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 300))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 50))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert lcp(a, b) == n
