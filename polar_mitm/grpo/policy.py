"""The policy's logprobs at trained positions, row by row over a packed forest.

A row runs the decoder once; the rows that hang under it reuse its keys/values as their
context, so a prefix that many branches share is computed once whatever the budget. The
rows are walked depth-first with an explicit stack (a long prompt cut into small rows is
thousands of rows deep):

- the path cache holds, per layer, the keys/values of the path from the root to the row
  being run, one slot per depth; a row reads its context there in place (no copy per
  row) and writes its own keys/values there for the rows below it;
- the context's gradients are added into the cache's gradient buffer; when a child's
  subtree is done, its parent takes the part along its own nodes, then backpropagates
  its graph together with those gradients once its whole subtree is done;
- a row with rows under it keeps its graph alive until its subtree is done, but only
  while the rows kept on the path, this one and the biggest row under it fit in two
  budgets; otherwise it runs without a graph and runs again (forward and backward at
  once) when its subtree is done. So live activations stay within two budgets of
  tokens, and a prefix costs only its keys/values and their gradients, whatever its
  length.

Logits exist only at trained positions, a chunk at a time, each chunk recomputed in
backward: never a full [tokens x vocab] tensor."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute_in_backward

from .attention import NAME, RowAttention
from .packing import Forest, Row, plan_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

KV = list[tuple[torch.Tensor, torch.Tensor]]


class Context:
    """A row's context: per layer (keys, values) of the path root..attach, and, when
    training with polar_sdpa, where their gradients go (the attention adds them there).
    A plain class: FSDP rebuilds dataclass arguments, and the gradients must land here."""

    def __init__(self, kv: KV, grads: KV | None = None):
        self.kv, self.grads = kv, grads

    def __len__(self) -> int:
        return self.kv[0][0].shape[-2]


class TokenLogprobs(nn.Module):
    """Wraps a Hugging Face causal LM: hidden states of a row, then logprobs of the
    chosen tokens at chosen positions. FSDP wraps this module as its root."""

    def __init__(self, lm: PreTrainedModel, *, chunk: int = 1024, temperature: float = 1.0,
                 checkpoint_rows: bool = False):
        super().__init__()
        self.lm = lm
        self.chunk = chunk
        self.temperature = temperature
        self.checkpoint_rows = checkpoint_rows

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, ctx: Context | None, pred: torch.Tensor,
                target_ids: torch.Tensor, keep_kv: bool,
                segments: list[tuple[int, int, bool]] | None = None) -> tuple[torch.Tensor, KV | None]:
        """attention_mask: with polar_sdpa the row's own [rows, rows] tree mask (None: one
        chain), and segments the subtrees packed in it (RowAttention); otherwise the full
        [1, 1, rows, ctx + rows] mask."""
        if self.checkpoint_rows and torch.is_grad_enabled():
            out = recompute_in_backward(self._decode, input_ids, position_ids, attention_mask, keep_kv, ctx,
                                        segments, use_reentrant=False)
        else:
            out = self._decode(input_ids, position_ids, attention_mask, keep_kv, ctx, segments)
        hidden, own = out[0], out[1:]
        kv = [(own[i], own[i + 1]) for i in range(0, len(own), 2)] if own else None
        return self._logprobs(hidden[0, pred], target_ids), kv

    def _decode(self, input_ids, position_ids, attention_mask, keep_kv, ctx: Context | None, segments=None):
        decoder = self.lm.get_decoder()
        if self.lm.config._attn_implementation == NAME:
            row = RowAttention(context=ctx.kv if ctx else None, grads=ctx.grads if ctx else None,
                               tree_mask=attention_mask, segments=segments)
            # a 4D mask reaches the attention as is: transformers builds none of its own
            mask = attention_mask[None, None] if attention_mask is not None else None
            out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                          use_cache=False, polar_row=row)
            own = [t for i in range(len(row.own)) for t in row.own[i]] if keep_kv else []
            return (out.last_hidden_state, *own)

        from transformers import DynamicCache

        cache = None
        ctx_len = len(ctx) if ctx else 0
        if ctx or keep_kv:
            cache = DynamicCache(config=self.lm.config)
            for i, (k, v) in enumerate(ctx.kv if ctx else []):
                cache.update(k, v, i)
        out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                      past_key_values=cache, use_cache=cache is not None)
        own = []
        if keep_kv:
            for layer in out.past_key_values.layers:
                own += [layer.keys[:, :, ctx_len:], layer.values[:, :, ctx_len:]]
        return (out.last_hidden_state, *own)

    def _logprobs(self, h: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        head = self.lm.get_output_embeddings()
        parts = []
        for i in range(0, h.shape[0], self.chunk):
            hc, tc = h[i:i + self.chunk], target_ids[i:i + self.chunk]
            if torch.is_grad_enabled():
                parts.append(recompute_in_backward(self._chunk_logprobs, head, hc, tc, use_reentrant=False))
            else:
                parts.append(self._chunk_logprobs(head, hc, tc))
        return torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.promote_types(h.dtype, torch.float32))

    def _chunk_logprobs(self, head, h, t):
        logits = head(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return logits.gather(-1, t[:, None])[:, 0] - torch.logsumexp(logits, -1)


@dataclass
class RowBatch:
    """Tensors for one row."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    pred: torch.Tensor          # row-local positions whose hidden state predicts a target
    target_ids: torch.Tensor    # the trained tokens
    targets: torch.Tensor       # their indices into the forest's target lists
    chain_after_ctx: bool       # one chain right under its context (causal after the context)
    segments: list[tuple[int, int, bool]] | None = None   # polar_sdpa: the subtrees packed in the row


class PathCache:
    """Per layer, keys/values (and, when training, their gradients) of the path from the
    root to the current row, one slot per depth. Allocated at the first write, from the
    shapes of the keys/values written."""

    def __init__(self, capacity: int, grad: bool):
        self.capacity, self.grad = capacity, grad
        self.kv: KV = []
        self.dkv: KV = []

    def write(self, start: int, own: KV, index: slice | torch.Tensor) -> None:
        if not self.kv:
            for k, v in own:
                shape = (*k.shape[:2], self.capacity, k.shape[-1])
                self.kv.append((k.new_empty(shape), v.new_empty(shape)))
                if self.grad:   # low-precision keys still sum their gradients in float32
                    dt = torch.promote_types(k.dtype, torch.float32)
                    self.dkv.append((k.new_zeros(shape, dtype=dt), v.new_zeros(shape, dtype=dt)))
        with torch.no_grad():
            for (bk, bv), (k, v) in zip(self.kv, own):
                k, v = k[:, :, index], v[:, :, index]
                bk[:, :, start:start + k.shape[-2]] = k
                bv[:, :, start:start + v.shape[-2]] = v

    def context(self, n: int) -> KV:
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv]

    def grads(self, n: int) -> KV:
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.dkv]

    def take(self, start: int, stop: int, into: KV, index: slice | torch.Tensor) -> None:
        """Add the gradients of slots start..stop into `into`[..., index, :] and clear them."""
        for (gk, gv), (dk, dv) in zip(into, self.dkv):
            for g, d in ((gk, dk), (gv, dv)):
                part = d[:, :, start:stop]
                if isinstance(index, slice):
                    g[:, :, index] += part
                else:
                    g.index_add_(2, index, part.to(g.dtype))
                part.zero_()


@dataclass
class _Frame:
    """A row whose subtree is being run: it waits for its children's gradients."""
    rid: int
    kv: KV                      # its own keys/values (in its graph unless it runs again)
    loss: torch.Tensor | None
    held: int                   # tokens of the rows kept whole on the path down to here
    again: bool                 # ran without a graph: runs again when its subtree is done
    ctx_len: int
    leaves: KV | None = None    # non-polar attention: the context as leaf tensors
    grads: KV | None = None     # its keys/values' gradients, gathered from the rows below
    next: int = 0               # the next child to run
    path_index: dict = field(default_factory=dict)


class ForestRunner:
    """Plans rows over a forest and runs them (with or without gradients)."""

    DENSE_PACK_LIMIT = 1024   # tokens: past this a dense mask wastes more than packing saves

    def __init__(self, forest: Forest, budget: int, device: torch.device, attention: str = "sdpa",
                 dtype: torch.dtype = torch.float32):
        """attention: the model's implementation. flex_attention gets block masks and rows
        packed to the budget; polar_sdpa gets chain rows and reads contexts in place
        (attention.py); eager adds a float mask of `dtype`; anything else a dense boolean
        mask over context and row."""
        self.f = forest
        self.budget = budget
        flex = attention == "flex_attention"
        self.polar = attention == NAME
        self.rows: list[Row] = plan_rows(forest, budget, pack_limit=budget if flex else self.DENSE_PACK_LIMIT,
                                         chains=self.polar)
        self.device = device
        self.mask_kind = "flex" if flex else "dense"
        self.float_mask_dtype = dtype if attention == "eager" else None  # eager adds the mask
        n = len(forest.tokens)
        self.row_of = [0] * n     # node -> its row
        self.index_in_row = [0] * n
        for rid, row in enumerate(self.rows):
            for i, v in enumerate(row.nodes):
                self.row_of[v] = rid
                self.index_in_row[v] = i
        self.biggest_below = [0] * len(self.rows)   # tokens of the biggest row in each row's subtree
        for rid in range(len(self.rows) - 1, -1, -1):     # rows are listed parents first
            p = self.rows[rid].parent_row
            if p >= 0:
                self.biggest_below[p] = max(self.biggest_below[p], len(self.rows[rid]), self.biggest_below[rid])
        self.targets_of: list[list[int]] = [[] for _ in self.rows]
        for t, node in enumerate(forest.target_node):
            p = forest.parent[node]
            if p < 0:
                raise ValueError("a trained token has no context")
            self.targets_of[self.row_of[p]].append(t)

    def row_tokens(self, rid: int) -> int:
        return len(self.rows[rid])

    def context_len(self, rid: int) -> int:
        a = self.rows[rid].attach
        return self.f.depth[a] + 1 if a >= 0 else 0

    def batch(self, rid: int, ctx_len: int) -> RowBatch:
        f, row, dev = self.f, self.rows[rid], self.device
        nodes = row.nodes
        ids = torch.tensor([f.tokens[v] for v in nodes], device=dev)[None]
        pos = torch.tensor([f.depth[v] for v in nodes], device=dev)[None]
        mask = segments = None
        chain = _is_chain(f, row)
        # polar_sdpa reads a chain's context without a mask; the others mask every row with one
        if not chain or (ctx_len and not self.polar):
            g = torch.tensor(nodes, device=dev)
            e = torch.tensor([f.subtree_end[v] for v in nodes], device=dev)
            if self.polar:
                mask = _tree_mask(g, e)
                segments = self._segments(rid)
            elif self.mask_kind == "flex":
                mask = flex_mask(g, e, ctx_len, dev)
            else:
                mask = dense_mask(g, e, ctx_len)
                if self.float_mask_dtype is not None:
                    mask = torch.zeros(mask.shape, dtype=self.float_mask_dtype, device=dev).masked_fill(
                        ~mask, torch.finfo(self.float_mask_dtype).min)
        ts = self.targets_of[rid]
        pred = [self.index_in_row[f.parent[f.target_node[t]]] for t in ts]
        tids = [f.tokens[f.target_node[t]] for t in ts]
        return RowBatch(ids, pos, mask, torch.tensor(pred, dtype=torch.long, device=dev),
                        torch.tensor(tids, dtype=torch.long, device=dev), torch.tensor(ts, dtype=torch.long),
                        chain and ctx_len > 0 and self.polar, segments)

    def _segments(self, rid: int) -> list[tuple[int, int, bool]] | None:
        """The row's pieces that see nothing of each other, (start, stop, is a chain): a piece
        starts at each node whose parent is outside the row. None where a node's parent is in
        the row but in an earlier piece (rows of whole subtrees never have one)."""
        f, nodes = self.f, self.rows[rid].nodes
        starts, chain = [], []
        for i, v in enumerate(nodes):
            p = f.parent[v]
            if p < 0 or self.row_of[p] != rid:
                starts.append(i)
                chain.append(True)
            elif self.index_in_row[p] < starts[-1]:
                return None
            elif p != nodes[i - 1]:
                chain[-1] = False
        ends = starts[1:] + [len(nodes)]
        return list(zip(starts, ends, chain))

    def run(self, policy: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
            ) -> torch.Tensor:
        """Logprobs of every target (detached, float32). With loss_fn(logprobs, target
        indices) -> scalar, also backpropagates each row's loss; the caller steps."""
        out = torch.full((len(self.f.target_node),), float("nan"), dtype=torch.float64)
        train = loss_fn is not None and torch.is_grad_enabled()
        cache = PathCache(max(self.f.depth, default=0) + 1, train)
        with contextlib.nullcontext() if train else _gathered(policy):
            for rid, row in enumerate(self.rows):
                if row.parent_row < 0:
                    self._run_tree(policy, rid, cache, loss_fn, out, train)
        return out

    def _run_tree(self, policy, root: int, cache: PathCache, loss_fn, out, train: bool) -> None:
        stack: list[_Frame] = []
        frame = self._start(policy, root, cache, loss_fn, out, train, 0)
        if frame is not None:
            stack.append(frame)
        while stack:
            fr = stack[-1]
            kids = self.rows[fr.rid].children
            if fr.next < len(kids):
                c = kids[fr.next]
                fr.next += 1
                self._extend_path(fr, c, cache)
                child = self._start(policy, c, cache, loss_fn, out, train, fr.held)
                if child is not None:
                    stack.append(child)
                elif train:
                    self._gather(fr, c, cache)
                continue
            stack.pop()
            self._finish(policy, fr, cache, loss_fn, train)
            if stack and train:
                self._gather(stack[-1], fr.rid, cache)

    def _start(self, policy, rid: int, cache: PathCache, loss_fn, out, train: bool, held: int) -> _Frame | None:
        """Run a row forward. A row without children is also backpropagated and done
        (None); otherwise its frame waits for its subtree."""
        row = self.rows[rid]
        parent = bool(row.children)
        if parent and train and held + len(row) + self.biggest_below[rid] > 2 * self.budget:
            with torch.no_grad():
                lp, kv, _, _, ctx_len, b = self._forward(policy, rid, cache, False, None)
            out[b.targets] = lp.to(out.dtype).cpu()
            return _Frame(rid, kv, None, held, True, ctx_len)
        lp, kv, loss, leaves, ctx_len, b = self._forward(policy, rid, cache, train, loss_fn)
        out[b.targets] = lp.detach().to(out.dtype).cpu()
        if not parent:
            if train and loss is not None and loss.requires_grad:
                loss.backward()
            self._leaf_grads(leaves, cache)
            return None
        return _Frame(rid, kv, loss, held + len(row), False, ctx_len, leaves)

    def _forward(self, policy, rid: int, cache: PathCache, train: bool, loss_fn):
        ctx_len = self.context_len(rid)
        b = self.batch(rid, ctx_len)
        ctx = leaves = None
        if ctx_len:
            if self.polar:
                ctx = Context(cache.context(ctx_len), cache.grads(ctx_len) if train else None)
            else:   # transformers' attention concatenates them: leaves, whose .grad goes to the cache
                leaves = [(k.detach().requires_grad_(train), v.detach().requires_grad_(train))
                          for k, v in cache.context(ctx_len)]
                ctx = Context(leaves)
        lp, kv = policy(b.input_ids, b.position_ids, b.attention_mask, ctx, b.pred, b.target_ids,
                        bool(self.rows[rid].children), b.segments)
        loss = loss_fn(lp, b.targets) if loss_fn is not None else None
        return lp, kv, loss, leaves, ctx_len, b

    def _path_in_row(self, fr: _Frame, child: int) -> tuple[slice | torch.Tensor, int]:
        """The parent row's nodes on the path to a child's attach point, as an index into
        the row, and how many there are."""
        if child not in fr.path_index:
            f, v, idx = self.f, self.rows[child].attach, []
            while v >= 0 and self.row_of[v] == fr.rid:
                idx.append(self.index_in_row[v])
                v = f.parent[v]
            idx.reverse()
            if idx == list(range(len(idx))):
                fr.path_index[child] = (slice(0, len(idx)), len(idx))
            else:
                fr.path_index[child] = (torch.tensor(idx, dtype=torch.long, device=self.device), len(idx))
        return fr.path_index[child]

    def _extend_path(self, fr: _Frame, child: int, cache: PathCache) -> None:
        """Put the parent's nodes on the path to the child into the cache, after the parent's
        own context (a sibling's subtree may have written over them)."""
        index, _ = self._path_in_row(fr, child)
        cache.write(fr.ctx_len, fr.kv, index)

    def _gather(self, fr: _Frame, child: int, cache: PathCache) -> None:
        """A child's subtree is done: take the gradients it left on the parent's nodes."""
        if not cache.dkv:
            return
        index, n = self._path_in_row(fr, child)
        if fr.grads is None:
            fr.grads = [(k.new_zeros(k.shape, dtype=dk.dtype), v.new_zeros(v.shape, dtype=dv.dtype))
                        for (k, v), (dk, dv) in zip(fr.kv, cache.dkv)]
        cache.take(fr.ctx_len, fr.ctx_len + n, fr.grads, index)

    def _finish(self, policy, fr: _Frame, cache: PathCache, loss_fn, train: bool) -> None:
        """The subtree is done: backpropagate the row with its keys/values' gradients (a row
        that ran without a graph runs again first; its context is still in the cache)."""
        if not train:
            return
        kv, loss, leaves = fr.kv, fr.loss, fr.leaves
        if fr.again:
            _, kv, loss, leaves, _, _ = self._forward(policy, fr.rid, cache, True, loss_fn)
        tensors, grads = [], []
        if fr.grads is not None:
            for (k, v), (gk, gv) in zip(kv, fr.grads):
                if k.requires_grad:
                    tensors += [k, v]
                    grads += [gk.to(k.dtype), gv.to(v.dtype)]
        if loss is not None and loss.requires_grad:
            tensors.append(loss)
            grads.append(torch.ones_like(loss))
        if tensors:
            torch.autograd.backward(tensors, grads)
        self._leaf_grads(leaves, cache)

    @staticmethod
    def _leaf_grads(leaves: KV | None, cache: PathCache) -> None:
        if not leaves or not cache.dkv:
            return
        n = leaves[0][0].shape[-2]
        for (lk, lv), (dk, dv) in zip(leaves, cache.grads(n)):
            if lk.grad is not None:
                dk += lk.grad
            if lv.grad is not None:
                dv += lv.grad


@contextlib.contextmanager
def _gathered(policy: nn.Module):
    """Under FSDP, a pass without gradients gathers the weights once for all its rows and
    frees them after: ranks run different numbers of rows, so a gather per row would not
    pair up across ranks. (Training steps set this up themselves, see train.py.)"""
    mods = []
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.distributed.fsdp import FSDPModule
        mods = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in mods:
            m.reshard()


def _is_chain(f: Forest, row: Row) -> bool:
    """Each node's parent is the node before it, the first one's the row's attach point."""
    nodes = row.nodes
    return bool(nodes) and f.parent[nodes[0]] == row.attach and all(
        f.parent[b] == a for a, b in zip(nodes, nodes[1:]))


def _tree_mask(g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """[rows, rows] bool over the row's depth-first node ids g (e = their subtree ends):
    key k is visible to query q iff k <= q < subtree_end[k]."""
    return (g[None, :] <= g[:, None]) & (g[:, None] < e[None, :])


def dense_mask(g: torch.Tensor, e: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """[1, 1, rows, ctx + rows] bool: the whole context, then the row's tree mask."""
    local = _tree_mask(g, e)
    return torch.cat([local.new_ones(len(g), ctx_len), local], 1)[None, None]


FLEX_BLOCK = 128   # flex attention's default tile, queries and keys alike


def flex_mask(g: torch.Tensor, e: torch.Tensor, ctx_len: int, dev):
    """The same visibility as a flex-attention BlockMask, built a block at a time: in the
    row's depth-first order own key k sees exactly the queries [k, first q with g[q] >= e[k]),
    and every context key sees every query, so each tile's count of visible pairs comes from
    intervals. create_block_mask would evaluate all rows x (context + rows) pairs, a grid
    that grows with the prefix; this takes [row blocks x (row + one block)] integers. The
    tiles are the ones create_block_mask gives (full, partial or skipped)."""
    from torch.nn.attention.flex_attention import BlockMask

    n, b = g.shape[0], FLEX_BLOCK
    kv_len = ctx_len + n

    def mask_mod(b_, h, q, kv):
        k = (kv - ctx_len).clamp(min=0)
        return (kv < ctx_len) | ((g[k] <= g[q]) & (g[q] < e[k]))

    q0 = torch.arange(0, n, b, device=dev)
    queries = (q0 + b).clamp(max=n) - q0                       # real queries per row block
    hi = torch.searchsorted(g, e)                               # own key k sees queries [k, hi[k])
    k = torch.arange(n, device=dev)
    own = (torch.minimum(hi[None], (q0 + queries)[:, None]) - torch.maximum(k[None], q0[:, None])).clamp(min=0)
    ctx_blocks, tail = divmod(ctx_len, b)                       # whole context blocks, then a mixed one
    per_key = torch.cat([queries[:, None].expand(-1, tail), own], 1)
    kv_blocks = -(-kv_len // b)
    per_key = torch.nn.functional.pad(per_key, (0, (kv_blocks - ctx_blocks) * b - per_key.shape[1]))
    pairs = torch.cat([(queries * b)[:, None].expand(-1, ctx_blocks),
                       per_key.view(len(q0), -1, b).sum(-1)], 1)   # visible pairs per tile
    full = pairs == b * b
    partial = (pairs > 0) & ~full
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=b, mask_mod=mask_mod,
                                    seq_lengths=(n, kv_len))


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[row blocks, key blocks] bool -> per row block, how many tiles and their key blocks
    (ascending, first), as BlockMask stores them for batch 1 and one head."""
    t = tiles.to(torch.int32)[None, None]
    return t.sum(-1, dtype=torch.int32), torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)
