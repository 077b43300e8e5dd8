"""CPU attention for one row of the trainer: its context (keys/values the rows above it
computed, read in place from the path cache, policy.py) runs unmasked and the row's own
tokens causally (a chain) or under the row's tree mask, each in the fused CPU kernel,
merged by their log-sum-exps. Backward calls each part's fused backward with the merged
output and log-sum-exp, which gives exact gradients (the ring-attention identity); the
context's gradients are added into the path cache's gradient buffer, not returned, so
no row ever holds a copy of its context. The kernel takes grouped-query heads as they
are: nothing is expanded. Calls without a row (or off CPU) go to plain SDPA."""

from __future__ import annotations

import torch

NAME = "polar_sdpa"
_OPS = torch.ops.aten


class RowAttention:
    """What the attention layers of one row need beyond q/k/v; passed as a model kwarg.
    A plain class, not a dataclass: FSDP rebuilds dataclass arguments, and `own` must be
    the one object every layer writes into."""

    def __init__(self, context: list | None = None, grads: list | None = None,
                 tree_mask: torch.Tensor | None = None):
        self.context = context        # per layer (keys, values) [1, kv_heads, ctx, dim], or None
        self.grads = grads            # per layer (dkeys, dvalues) to add the context's gradients into
        self.tree_mask = tree_mask    # [rows, rows] bool; None: the row is one chain
        self.own: dict = {}           # layer -> this row's own (keys, values), for the rows below
        self._masks: dict = {}

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The fused kernel takes an additive mask of the query's dtype."""
        if self.tree_mask is None:
            return None
        if dtype not in self._masks:
            m = torch.zeros(self.tree_mask.shape, dtype=dtype, device=self.tree_mask.device)
            self._masks[dtype] = m.masked_fill_(~self.tree_mask, torch.finfo(dtype).min)[None, None]
        return self._masks[dtype]


class ContextThenOwn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_ctx, v_ctx, mask, grads, scale):
        causal = mask is None
        out, lse = _OPS._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scale)
        if k_ctx is not None:
            o1, l1 = _OPS._scaled_dot_product_flash_attention_for_cpu(q, k_ctx, v_ctx, 0.0, False, scale=scale)
            merged = torch.logaddexp(l1, lse)
            out = (torch.exp(l1 - merged).unsqueeze(-1).to(o1.dtype) * o1
                   + torch.exp(lse - merged).unsqueeze(-1).to(out.dtype) * out)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        # The context is a view of the path cache: kept by reference (saving it would
        # trip autograd's version check when the cache is rewritten for a sibling).
        ctx.context, ctx.mask, ctx.grads, ctx.scale = (k_ctx, v_ctx), mask, grads, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = _OPS._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, ctx.mask is None, attn_mask=ctx.mask, scale=ctx.scale)
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
    out = ContextThenOwn.apply(query, key, value, k_ctx, v_ctx, row.mask(dt), grads, scaling)
    return out.transpose(1, 2), None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
