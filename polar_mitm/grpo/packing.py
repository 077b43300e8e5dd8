"""Packing samples into rows of at most `budget` tokens. No torch here: plain lists.

All samples of a step go into one forest (depth-first, node ids offset). A row is a set of
whole subtrees, or the stem of a subtree too big for one row, all hanging under one
attachment node: the row attends to the path from the root to that node (its context,
computed by earlier rows and reused as their keys/values) and, inside itself, to each
position's ancestors. One vector gives that tree attention: with the forest laid out
depth-first, key k is visible to query q iff k <= q < subtree_end[k]. Position ids are
depths. A row with no context and a single chain is plain causal attention; several
chains restart their position ids (linear packing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .trajectories import Sample


@dataclass
class Forest:
    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    subtree_end: list[int] = field(default_factory=list)
    target_node: list[int] = field(default_factory=list)
    target_call: list[int] = field(default_factory=list)
    target_index: list[int] = field(default_factory=list)
    target_logprob: list[float] = field(default_factory=list)


def merge(samples: Sequence[Sample]) -> Forest:
    f = Forest()
    for s in samples:
        off = len(f.tokens)
        f.tokens += s.tokens
        f.parent += [p + off if p >= 0 else -1 for p in s.parent]
        f.depth += s.depth
        f.target_node += [n + off for n in s.target_node]
        f.target_call += s.target_call
        f.target_index += s.target_index
        f.target_logprob += s.target_logprob
    f.subtree_end = subtree_end(f.parent)
    return f


def children(end: Sequence[int], node: int, n: int = 0) -> list[int]:
    """The children of `node` (-1: the roots of a forest of n nodes) in a depth-first
    layout: the first is the next node, each next one starts where its sibling's subtree ends."""
    c, stop = node + 1, end[node] if node >= 0 else n
    out = []
    while c < stop:
        out.append(c)
        c = end[c]
    return out


def subtree_end(parent: Sequence[int]) -> list[int]:
    """Exclusive end of each node's subtree, for a depth-first layout (parent[i] < i)."""
    n = len(parent)
    end = list(range(1, n + 1))
    for i in range(n - 1, -1, -1):
        p = parent[i]
        if p >= 0 and end[i] > end[p]:
            end[p] = end[i]
    return end


@dataclass
class Row:
    nodes: list[int]            # forest node ids, ascending (so depth-first within the row)
    attach: int                 # the node the row hangs under (-1: none)
    parent_row: int             # the row holding `attach` (-1: none)
    children: list[int] = field(default_factory=list)   # rows hanging under this one's nodes

    def __len__(self) -> int:
        return len(self.nodes)


def plan_rows(f: Forest, budget: int, pack_limit: int | None = None, chains: bool = False) -> list[Row]:
    """Rows of at most `budget` tokens covering every node once. Rows are listed parents
    first; `children` links each row to the rows that reuse its keys/values.

    Subtrees share a row only while it stays within `pack_limit` tokens (default: the
    budget). A dense mask costs rows x (context + rows) whatever it hides, so on CPU
    only small pieces are packed; block-sparse attention (flex, GPU) packs to the budget.
    With `chains`, a big subtree is cut along its heaviest path into chain rows, which
    attend causally to themselves and fully to their context (policy.py runs them
    without a mask); the side branches become rows of their own."""
    if budget < 1:
        raise ValueError("token budget must be positive")
    pack = min(pack_limit or budget, budget)
    end = f.subtree_end
    # Children are read off the depth-first layout (children(), below) rather than stored:
    # a list per node costs more in allocation and garbage collection than the plan itself.
    roots = children(end, -1, len(f.tokens))
    rows: list[Row] = []
    row_of = [-1] * len(f.tokens)

    def emit(nodes: list[int], attach: int) -> None:
        parent_row = row_of[attach] if attach >= 0 else -1
        rid = len(rows)
        rows.append(Row(nodes=sorted(nodes), attach=attach, parent_row=parent_row))
        if parent_row >= 0:
            rows[parent_row].children.append(rid)
        for v in nodes:
            row_of[v] = rid

    # An explicit stack instead of recursion: chains can be far deeper than Python's limit.
    work: list[tuple[list[int], int]] = [(roots, -1)]
    while work:
        subtree_roots, attach = work.pop()
        pending: list[int] = []
        size = 0
        big = []
        for r in subtree_roots:
            m = end[r] - r
            if m > budget or (chains and m > pack):
                big.append(r)
                continue
            if pending and size + m > pack:
                emit(pending, attach)
                pending, size = [], 0
            pending.extend(range(r, end[r]))
            size += m
        if pending:
            emit(pending, attach)
        for r in big:
            # The stem: single-child links from r (or, with chains, the heaviest child at
            # each step, its siblings becoming rows of their own under it).
            stem, node = [r], r
            while len(stem) < budget and node + 1 < end[node]:
                if end[node + 1] == end[node]:   # one child: the next node
                    node += 1
                    stem.append(node)
                    continue
                if not chains:
                    break
                kids = children(end, node)
                heavy = max(kids, key=lambda c: end[c] - c)
                light = [c for c in kids if c != heavy]
                work.append((light, node))
                node = heavy
                stem.append(node)
            room = pack - len(stem)
            rest = []
            for c in children(end, node):
                m = end[c] - c
                if m <= room and not chains:
                    stem.extend(range(c, end[c]))
                    room -= m
                else:
                    rest.append(c)
            emit(stem, attach)
            if rest:
                work.append((rest, node))
    return rows


def row_context(f: Forest, row: Row) -> list[int]:
    """The nodes a row attends to outside itself: root ... attach."""
    out, v = [], row.attach
    while v >= 0:
        out.append(v)
        v = f.parent[v]
    return out[::-1]
