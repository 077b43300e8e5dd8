"""Trajectory builders: recorded calls -> what the trainer runs forward. Plain lists, no torch.

Every builder emits `Sample`s of one shape: a forest laid out depth-first, where each
position has a parent (-1 for a root) and a depth (its position id), and a list of
targets: (node, call, j) says that node's token is call.tokens[j], trained with the
logprob vLLM reported for it, predicted from the node's parent. Only a call's trained
tokens (Call.trained) are targets: one of an unknown or too old a version (--max-staleness)
stays in the sequence as context. A plain sequence is the chain parent = i - 1. The three
builders differ only in which contexts they run:

- per_request: one sequence per call, P_k + R_k.
- prefix_merging: NVIDIA Polar's algorithm, kept faithfully for comparison (see
  prefix_merging below); a later turn is trained after the *raw* sampled tokens of the
  earlier turns, which is not the context vLLM saw when a prompt re-rendered them.
- trie (default): every P_k + R_k of a GRPO group in one token trie, so each sampled
  token is trained in exactly the context it was sampled in, and whatever the calls
  share (system prompt, tools, task, earlier turns) is computed once. Drift, retries,
  side calls, sub-agents and compaction are branches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from ..trainer_input import Call
from .calls import by_key, drift_events, is_prefix, lcp
from .config import BUILDERS, Builder


@dataclass
class Sample:
    group: str
    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    target_node: list[int] = field(default_factory=list)
    target_call: list[int] = field(default_factory=list)
    target_index: list[int] = field(default_factory=list)
    target_logprob: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add_chain(self, tokens: Sequence[int]) -> int:
        """Append a new root chain; returns the position of its first token."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        self.parent.extend([-1] + list(range(start, start + len(tokens) - 1)) if tokens else [])
        self.depth.extend(range(len(tokens)))
        return start

    def add_target(self, node: int, call: int, j: int, logprob: float) -> None:
        self.target_node.append(node)
        self.target_call.append(call)
        self.target_index.append(j)
        self.target_logprob.append(logprob)

    def context(self, node: int) -> list[int]:
        """The tokens a node's token is predicted from: its ancestors, root first."""
        out, p = [], self.parent[node]
        while p >= 0:
            out.append(self.tokens[p])
            p = self.parent[p]
        return out[::-1]


@dataclass
class BuildStats:
    builder: Builder
    calls: int = 0
    sequences: int = 0
    forward_tokens: int = 0
    trained_tokens: int = 0
    branches: int = 0           # leaves: chains for prefix_merging, calls for per_request
    dropped_calls: int = 0      # calls a builder could not place (prefix_merging truncation)
    drift_events: int = 0
    drift_tokens: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Built:
    samples: list[Sample]
    stats: BuildStats


def build(calls: Sequence[Call], builder: Builder = "trie") -> Built:
    if builder not in BUILDERS:
        raise ValueError(f"unknown builder {builder!r}; choose one of {', '.join(BUILDERS)}")
    samples, dropped = _BUILD[builder](calls)
    drifts = drift_events(calls)
    stats = BuildStats(builder=builder, calls=len(calls), sequences=len(samples),
                       forward_tokens=sum(len(s) for s in samples),
                       trained_tokens=sum(len(s.target_node) for s in samples),
                       branches=sum(_leaves(s) for s in samples), dropped_calls=dropped,
                       drift_events=len(drifts), drift_tokens=sum(d.tokens for d in drifts))
    return Built(samples, stats)


def _leaves(s: Sample) -> int:
    has_child = set(s.parent)
    return sum(1 for i in range(len(s)) if i not in has_child)


# ---- per_request ---------------------------------------------------------------------

def per_request(calls: Sequence[Call]) -> tuple[list[Sample], int]:
    samples = []
    for k, c in enumerate(calls):
        s = Sample(group=c.group)
        start = s.add_chain(list(c.prompt) + list(c.tokens)) + len(c.prompt)
        for j in c.trained():
            s.add_target(start + j, k, j, c.logprobs[j])
        samples.append(s)
    return samples, 0


# ---- prefix_merging (NVIDIA Polar, faithfully) -----------------------------------------

def prefix_merging(calls: Sequence[Call]) -> tuple[list[Sample], int]:
    """Per session, in call order, a call joins the chain whose last prompt (its tip) is
    a token prefix of its prompt, the longest tip winning; otherwise it starts a chain.
    A chain becomes P_1 R_1 T_2 R_2 ...: raw sampled R_i trained, and untrained the
    tokens the next prompt adds after the first end-of-turn token of its new tail (the
    end-of-turn itself too when turn i-1 was cut by length). A tail that does not extend
    the previous prompt, or has no end-of-turn (a retry with the same prompt), truncates
    the chain there: that call and the chain's later calls are dropped. The end-of-turn
    id is the last token of the session's first naturally stopped call; without one,
    nothing merges."""
    samples, dropped = [], 0
    for idx in by_key(calls, lambda c: c.session_id).values():
        eot = next((calls[k].tokens[-1] for k in idx
                    if calls[k].tokens and calls[k].finish_reason not in ("length", None)), None)
        chains: list[list[int]] = []
        for k in idx:
            prompt = calls[k].prompt
            best = max((ch for ch in chains if is_prefix(calls[ch[-1]].prompt, prompt)),
                       key=lambda ch: len(calls[ch[-1]].prompt), default=None)
            if best is None:
                chains.append([k])
            else:
                best.append(k)
        for chain in chains:
            sample, kept = _merge_chain(calls, chain, eot)
            samples.append(sample)
            dropped += len(chain) - kept
    return samples, dropped


def _merge_chain(calls: Sequence[Call], chain: list[int], eot: int | None) -> tuple[Sample, int]:
    first = calls[chain[0]]
    stream = list(first.prompt) + list(first.tokens)
    targets = [(len(first.prompt) + j, chain[0], j, first.logprobs[j]) for j in first.trained()]
    kept = 1
    for prev, k in zip(chain, chain[1:]):
        p_prev, r_prev, p = calls[prev].prompt, calls[prev].tokens, calls[k].prompt
        if eot is None or not is_prefix(p_prev, p):
            break
        tail = p[len(p_prev):]
        try:
            at = tail.index(eot)
        except ValueError:
            break
        stream += tail[at + 1:] if r_prev and r_prev[-1] == eot else tail[at:]
        start = len(stream)
        stream += calls[k].tokens
        targets += [(start + j, k, j, calls[k].logprobs[j]) for j in calls[k].trained()]
        kept += 1
    s = Sample(group=first.group)
    s.add_chain(stream)
    for t in targets:
        s.add_target(*t)
    return s, kept


# ---- trie ------------------------------------------------------------------------------

def trie(calls: Sequence[Call]) -> tuple[list[Sample], int]:
    """One trie per GRPO group over every call's P_k + R_k, laid out depth-first.

    Sorting the sequences lexicographically gives the depth-first order directly: each
    sequence adds the nodes after its common prefix with the one before it (no earlier
    sequence shares more), so the trie is built in O(total tokens) without node objects."""
    samples = []
    for group, idx in by_key(calls, lambda c: c.group).items():
        seqs = sorted(idx, key=lambda k: (list(calls[k].prompt) + list(calls[k].tokens), k))
        s = Sample(group=group)
        path: list[int] = []      # node id at each depth along the previous sequence
        prev: list[int] = []
        for k in seqs:
            c = calls[k]
            seq = list(c.prompt) + list(c.tokens)
            shared = lcp(prev, seq)
            del path[shared:]
            for d in range(shared, len(seq)):
                s.tokens.append(seq[d])
                s.parent.append(path[d - 1] if d else -1)
                s.depth.append(d)
                path.append(len(s.tokens) - 1)
            for j in c.trained():
                s.add_target(path[len(c.prompt) + j], k, j, c.logprobs[j])
            prev = seq
        samples.append(s)
    return samples, 0


# Each builder's function has its name.
_BUILD: dict[Builder, Callable[[Sequence[Call]], tuple[list[Sample], int]]] = {
    "trie": trie, "prefix_merging": prefix_merging, "per_request": per_request}
