"""CPU attention for a row that continues cached keys/values as one chain (a session's
turns under the group's shared prompt). A dense mask would cost rows x (context + rows)
at the masked kernel's rate; instead the context part runs unmasked and the row's own
part causally, both in the fused CPU kernel, merged by their log-sum-exps. Backward
calls each part's fused backward with the merged output and log-sum-exp, which gives
exact gradients (the ring-attention identity). Anything else goes to plain SDPA."""

from __future__ import annotations

import torch

NAME = "polar_sdpa"
_OPS = torch.ops.aten


class ContextThenCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_own, v_own, scale):
        o1, l1 = _OPS._scaled_dot_product_flash_attention_for_cpu(q, k_ctx, v_ctx, 0.0, False, scale=scale)
        o2, l2 = _OPS._scaled_dot_product_flash_attention_for_cpu(q, k_own, v_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = torch.exp(l1 - lse).unsqueeze(-1).to(o1.dtype) * o1 + torch.exp(l2 - lse).unsqueeze(-1).to(o2.dtype) * o2
        ctx.save_for_backward(q, k_ctx, v_ctx, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_ctx, v_ctx, k_own, v_own, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq1, dk1, dv1 = _OPS._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k_ctx, v_ctx, out, lse, 0.0, False, scale=ctx.scale)
        dq2, dk2, dv2 = _OPS._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, dk1, dv1, dk2, dv2, None


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
              is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    ctx_len = kwargs.pop("polar_ctx_len", 0)
    if not ctx_len or query.device.type != "cpu" or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    c = lambda t: t.contiguous()  # noqa: E731
    out = ContextThenCausal.apply(c(query), c(key[:, :, :ctx_len]), c(value[:, :, :ctx_len]),
                                  c(key[:, :, ctx_len:]), c(value[:, :, ctx_len:]), scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
