"""CPU attention for one row of the trainer: its context (keys/values the rows above it
computed, read in place from the path cache, policy.py) runs unmasked and the row's own
tokens causally (a chain) or under the row's tree mask, each in the fused CPU kernel,
merged by their log-sum-exps. A row packed from several subtrees runs its own part a
subtree at a time (causally where the subtree is a chain): a dense mask over the whole row
would compute every (query, key) pair across subtrees only to hide it. Backward calls each
part's fused backward with the merged output and log-sum-exp, which gives exact gradients
(the ring-attention identity); the context's gradients are added into the path cache's
gradient buffer, not returned, so no row ever holds a copy of its context. The kernel takes
grouped-query heads as they are: nothing is expanded. Calls without a row (or off CPU) go to plain SDPA."""

from __future__ import annotations

import torch

NAME = "polar_sdpa"
_OPS = torch.ops.aten


class RowAttention:
    """What the attention layers of one row need beyond q/k/v; passed as a model kwarg.
    A plain class, not a dataclass: FSDP rebuilds dataclass arguments, and `own` must be
    the one object every layer writes into."""

    def __init__(self, context: list | None = None, grads: list | None = None,
                 tree_mask: torch.Tensor | None = None, segments: list[tuple[int, int, bool]] | None = None):
        self.context = context        # per layer (keys, values) [1, kv_heads, ctx, dim], or None
        self.grads = grads            # per layer (dkeys, dvalues) to add the context's gradients into
        self.tree_mask = tree_mask    # [rows, rows] bool; None: the row is one chain
        # (start, stop, is a chain) of each subtree packed in the row, which sees nothing of the
        # others; None: the row's own part is one piece under tree_mask
        self.segments = segments
        self.own: dict = {}           # layer -> this row's own (keys, values), for the rows below
        self._parts: dict = {}

    def parts(self, dtype: torch.dtype) -> list[tuple[int, int, torch.Tensor | None]] | None:
        """The row's own part as pieces that see only themselves: (start, stop, additive
        mask of the query's dtype, or None where the piece is causal). None: one chain."""
        if self.tree_mask is None:
            return None
        if dtype not in self._parts:
            pieces = self.segments or [(0, self.tree_mask.shape[0], False)]
            self._parts[dtype] = [(a, b, None if chain else _additive(self.tree_mask[a:b, a:b], dtype))
                                  for a, b, chain in pieces]
        return self._parts[dtype]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fused kernel takes an additive mask of the query's dtype."""
    m = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return m.masked_fill_(~mask, torch.finfo(dtype).min)[None, None]


def _own_forward(q, k, v, parts, scale):
    if parts is None:
        return _OPS._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    if len(parts) == 1:
        return _OPS._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, parts[0][2] is None,
                                                                  attn_mask=parts[0][2], scale=scale)
    outs, lses = [], []
    for a, b, m in parts:
        o, lse = _OPS._scaled_dot_product_flash_attention_for_cpu(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], 0.0,
                                                                  m is None, attn_mask=m, scale=scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _own_backward(grad, q, k, v, out, lse, parts, scale):
    if parts is None or len(parts) == 1:
        m = parts[0][2] if parts else None
        return _OPS._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, m is None, attn_mask=m, scale=scale)
    pieces = [_OPS._scaled_dot_product_flash_attention_for_cpu_backward(
        grad[:, :, a:b].contiguous(), q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], out[:, :, a:b].contiguous(),
        lse[:, :, a:b].contiguous(), 0.0, m is None, attn_mask=m, scale=scale) for a, b, m in parts]
    return tuple(torch.cat([p[i] for p in pieces], 2) for i in range(3))


class ContextThenOwn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_ctx, v_ctx, parts, grads, scale):
        out, lse = _own_forward(q, k, v, parts, scale)
        if k_ctx is not None:
            o1, l1 = _OPS._scaled_dot_product_flash_attention_for_cpu(q, k_ctx, v_ctx, 0.0, False, scale=scale)
            merged = torch.logaddexp(l1, lse)
            out = (torch.exp(l1 - merged).unsqueeze(-1).to(o1.dtype) * o1
                   + torch.exp(lse - merged).unsqueeze(-1).to(out.dtype) * out)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        # The context is a view of the path cache: kept by reference (saving it would
        # trip autograd's version check when the cache is rewritten for a sibling).
        ctx.context, ctx.parts, ctx.grads, ctx.scale = (k_ctx, v_ctx), parts, grads, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = _own_backward(grad, q, k, v, out, lse, ctx.parts, ctx.scale)
        k_ctx, v_ctx = ctx.context
        if k_ctx is not None:
            dq1, dk1, dv1 = _OPS._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, k_ctx, v_ctx, out, lse, 0.0, False, scale=ctx.scale)
            dq = dq + dq1
            if ctx.grads is not None:
                ctx.grads[0].add_(dk1)
                ctx.grads[1].add_(dv1)
        return dq, dk, dv, None, None, None, None, None


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
              is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    row: RowAttention | None = kwargs.pop("polar_row", None)
    if row is None or query.device.type != "cpu" or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    layer = module.layer_idx
    row.own[layer] = (key, value)
    k_ctx = v_ctx = grads = None
    if row.context is not None:
        k_ctx, v_ctx = row.context[layer]
        grads = row.grads[layer] if row.grads is not None else None
    # Under bf16 autocast the projections come out bf16 while the path cache keeps the
    # model's dtype: the fused kernel wants one dtype (a bf16 context is a copy per row,
    # so bf16 on CPU gives up the no-copy bound; the GPU runs flex attention instead).
    dt = query.dtype
    key, value = key.to(dt), value.to(dt)
    if k_ctx is not None and v_ctx is not None:   # (rotary leaves keys float32 while values are bf16)
        k_ctx, v_ctx = k_ctx.to(dt), v_ctx.to(dt)
    out = ContextThenOwn.apply(query, key, value, k_ctx, v_ctx, row.parts(dt), grads, scaling)
    return out.transpose(1, 2), None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
