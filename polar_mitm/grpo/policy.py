"""The policy's logprobs at trained positions, row by row over a packed forest.

A row runs the decoder once; its keys/values are then handed to the rows that hang under
it (`past_key_values`), so a prefix that many branches share is computed once whatever
the budget: run the row, detach its keys/values as leaves, run and backpropagate each
child row (which accumulates gradients into those leaves and the weights), then
backpropagate the row itself together with its keys/values' gradients. Logits exist only
at trained positions, a chunk at a time, each chunk recomputed in backward: never a full
[tokens x vocab] tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import NAME
from .packing import Forest, Row, plan_rows

KV = list[tuple[torch.Tensor, torch.Tensor]]


class TokenLogprobs(nn.Module):
    """Wraps a Hugging Face causal LM: hidden states of a row, then logprobs of the
    chosen tokens at chosen positions. FSDP wraps this module as its root."""

    def __init__(self, lm: nn.Module, *, chunk: int = 1024, temperature: float = 1.0,
                 checkpoint_rows: bool = False):
        super().__init__()
        self.lm = lm
        self.chunk = chunk
        self.temperature = temperature
        self.checkpoint_rows = checkpoint_rows

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, ctx: KV | None, pred: torch.Tensor,
                target_ids: torch.Tensor, keep_kv: bool, chain_after_ctx: bool = False,
                ) -> tuple[torch.Tensor, KV | None]:
        """chain_after_ctx: the row is one chain under its whole context, which the
        polar_sdpa attention runs without a mask (see attention.py)."""
        flat = [t for kv in (ctx or []) for t in kv]
        if self.checkpoint_rows and torch.is_grad_enabled():
            out = checkpoint(self._decode, input_ids, position_ids, attention_mask, keep_kv, chain_after_ctx,
                             *flat, use_reentrant=False)
        else:
            out = self._decode(input_ids, position_ids, attention_mask, keep_kv, chain_after_ctx, *flat)
        hidden, own = out[0], out[1:]
        kv = [(own[i], own[i + 1]) for i in range(0, len(own), 2)] if own else None
        return self._logprobs(hidden[0, pred], target_ids), kv

    def _decode(self, input_ids, position_ids, attention_mask, keep_kv, chain_after_ctx, *flat):
        from transformers import DynamicCache

        decoder = self.lm.get_decoder()
        cache = None
        ctx_len = 0
        if flat or keep_kv:
            cache = DynamicCache(config=self.lm.config)
            for i in range(0, len(flat), 2):
                cache.update(flat[i], flat[i + 1], i // 2)
            ctx_len = flat[0].shape[-2] if flat else 0
        extra = {"polar_ctx_len": ctx_len} if chain_after_ctx and ctx_len else {}
        out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                      past_key_values=cache, use_cache=cache is not None, **extra)
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
                parts.append(checkpoint(self._chunk_logprobs, head, hc, tc, use_reentrant=False))
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
    chain_after_ctx: bool       # one chain right under its context (attention.py runs it maskless)


class ForestRunner:
    """Plans rows over a forest and runs them (with or without gradients)."""

    DENSE_PACK_LIMIT = 1024   # tokens: past this a dense mask wastes more than packing saves

    def __init__(self, forest: Forest, budget: int, device: torch.device, attention: str = "sdpa",
                 dtype: torch.dtype = torch.float32):
        """attention: the model's implementation. flex_attention gets block masks and rows
        packed to the budget; polar_sdpa gets chain rows (attention.py); eager adds a
        float mask of `dtype`; anything else a dense boolean mask."""
        self.f = forest
        flex = attention == "flex_attention"
        self.rows: list[Row] = plan_rows(forest, budget, pack_limit=budget if flex else self.DENSE_PACK_LIMIT,
                                         chains=attention == NAME)
        self.device = device
        self.mask_kind = "flex" if flex else "dense"
        self.chain_attention = attention == NAME
        self.float_mask_dtype = dtype if attention == "eager" else None  # eager adds the mask
        self.row_of = {}
        for rid, row in enumerate(self.rows):
            for i, v in enumerate(row.nodes):
                self.row_of[v] = (rid, i)
        self.targets_of: list[list[int]] = [[] for _ in self.rows]
        for t, node in enumerate(forest.target_node):
            p = forest.parent[node]
            if p < 0:
                raise ValueError("a trained token has no context")
            self.targets_of[self.row_of[p][0]].append(t)

    def row_tokens(self, rid: int) -> int:
        return len(self.rows[rid])

    def batch(self, rid: int, ctx_len: int) -> RowBatch:
        f, row, dev = self.f, self.rows[rid], self.device
        nodes = row.nodes
        ids = torch.tensor([f.tokens[v] for v in nodes], device=dev)[None]
        pos = torch.tensor([f.depth[v] for v in nodes], device=dev)[None]
        mask = None
        chain = _is_chain(f, row)
        if chain and ctx_len and self.chain_attention:
            pass   # attention.py: context unmasked, the row causal
        elif not (chain and not ctx_len):
            g = torch.tensor(nodes, device=dev)
            e = torch.tensor([f.subtree_end[v] for v in nodes], device=dev)
            if self.mask_kind == "flex":
                mask = flex_mask(g, e, ctx_len, dev)
            else:
                mask = dense_mask(g, e, ctx_len)
                if self.float_mask_dtype is not None:
                    mask = torch.zeros(mask.shape, dtype=self.float_mask_dtype, device=dev).masked_fill(
                        ~mask, torch.finfo(self.float_mask_dtype).min)
        ts = self.targets_of[rid]
        pred = [self.row_of[f.parent[f.target_node[t]]][1] for t in ts]
        tids = [f.tokens[f.target_node[t]] for t in ts]
        return RowBatch(ids, pos, mask, torch.tensor(pred, dtype=torch.long, device=dev),
                        torch.tensor(tids, dtype=torch.long, device=dev), torch.tensor(ts, dtype=torch.long),
                        chain and ctx_len > 0 and self.chain_attention)

    def run(self, policy: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
            ) -> torch.Tensor:
        """Logprobs of every target (detached, float32). With loss_fn(logprobs, target
        indices) -> scalar, also backpropagates each row's loss; the caller steps."""
        out = torch.full((len(self.f.target_node),), float("nan"), dtype=torch.float64)
        for rid, row in enumerate(self.rows):
            if row.parent_row < 0:
                self._visit(policy, rid, {}, loss_fn, out)
        return out

    def _context(self, rid: int, leaves: dict[int, KV]) -> KV | None:
        """Keys/values of the path root..attach, gathered afresh from the ancestor rows'
        leaves (a graph of its own, so a child's backward never frees its parent's)."""
        v, by_row = self.rows[rid].attach, {}
        while v >= 0:
            r, i = self.row_of[v]
            by_row.setdefault(r, []).append(i)
            v = self.f.parent[v]
        if not by_row:
            return None
        parts = []
        for r in sorted(by_row):  # ancestors are planned before their descendants
            idx = torch.tensor(by_row[r][::-1], dtype=torch.long, device=self.device)
            parts.append([(k.index_select(2, idx), v.index_select(2, idx)) for k, v in leaves[r]])
        if len(parts) == 1:
            return parts[0]
        return [(torch.cat([p[i][0] for p in parts], 2), torch.cat([p[i][1] for p in parts], 2))
                for i in range(len(parts[0]))]

    def _visit(self, policy, rid, leaves: dict[int, KV], loss_fn, out) -> None:
        row = self.rows[rid]
        ctx = self._context(rid, leaves)
        b = self.batch(rid, ctx[0][0].shape[-2] if ctx else 0)
        keep = bool(row.children)
        lp, kv = policy(b.input_ids, b.position_ids, b.attention_mask, ctx, b.pred, b.target_ids, keep,
                        b.chain_after_ctx)
        out[b.targets] = lp.detach().to(out.dtype).cpu()
        loss = loss_fn(lp, b.targets) if loss_fn is not None else None
        if not keep:
            if loss is not None and loss.requires_grad:
                loss.backward()
            return
        # Children reuse this row's keys/values as detached leaves; their gradients come back
        # through .grad and are pushed into this row's graph in one backward at the end.
        grad = loss is not None and torch.is_grad_enabled()
        own = [(k.detach().requires_grad_(grad), v.detach().requires_grad_(grad)) for k, v in kv]
        leaves[rid] = own
        for c in row.children:
            self._visit(policy, c, leaves, loss_fn, out)
        del leaves[rid]
        if grad:
            tensors, grads = [], []
            for (k, v), (lk, lv) in zip(kv, own):
                for t, leaf in ((k, lk), (v, lv)):
                    if leaf.grad is not None:
                        tensors.append(t)
                        grads.append(leaf.grad)
            if loss is not None and loss.requires_grad:
                tensors.append(loss)
                grads.append(torch.ones_like(loss))
            if tensors:
                torch.autograd.backward(tensors, grads)


def _is_chain(f: Forest, row: Row) -> bool:
    """Each node's parent is the node before it, the first one's the row's attach point."""
    nodes = row.nodes
    return bool(nodes) and f.parent[nodes[0]] == row.attach and all(
        f.parent[b] == a for a, b in zip(nodes, nodes[1:]))


def dense_mask(g: torch.Tensor, e: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """[1, 1, rows, ctx + rows] bool: the whole context, then k <= q < subtree_end[k]
    over the row's depth-first node ids g (e = their subtree ends)."""
    local = (g[None, :] <= g[:, None]) & (g[:, None] < e[None, :])
    return torch.cat([local.new_ones(len(g), ctx_len), local], 1)[None, None]


def flex_mask(g: torch.Tensor, e: torch.Tensor, ctx_len: int, dev):
    """The same visibility as a flex-attention BlockMask: no [T x T] tensor, and blocks
    that see nothing are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = g.shape[0]

    def mask_mod(b, h, q, kv):
        k = (kv - ctx_len).clamp(min=0)
        return (kv < ctx_len) | ((g[k] <= g[q]) & (g[q] < e[k]))

    return create_block_mask(mask_mod, 1, None, n, ctx_len + n, device=dev)
