"""Model FLOPs of a training pass over built samples, for tokens/s against work/s: a token
costs its share of the weights' matmuls plus attention to every token before it, so two
builders' tokens/s compare only with their FLOPs beside them. No torch here."""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from .trajectories import Sample


class ModelShape(Protocol):
    """What is read of a Hugging Face config (head_dim may be absent or None)."""
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int


def model_flops(c: ModelShape, samples: Sequence[Sample]) -> float:
    """FLOPs of one fwd+bwd (3x forward) of config c over a builder's samples: per forward
    token the weights' matmuls, per (query, key) pair attention's two products, per trained
    token the lm_head (run twice: its chunks are recomputed in backward)."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    per_token = c.num_hidden_layers * (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size)
    per_pair = c.num_hidden_layers * 2 * c.num_attention_heads * head_dim
    tokens = sum(len(s) for s in samples)
    pairs = sum(d + 1 for s in samples for d in s.depth)   # a node attends to its depth + 1 ancestors
    trained = sum(len(s.target_node) for s in samples)
    macs = tokens * per_token + pairs * per_pair + trained * c.hidden_size * c.vocab_size * 4 / 3
    return 2 * 3 * macs


def token_cost(flops: Mapping[str, float], tokens: Mapping[str, int], builder: str, baseline: str) -> float:
    """What a forward token of `builder` costs in FLOPs relative to one of `baseline`, from
    each builder's model_flops and forward tokens: at equal FLOP/s, builder's tokens/s is
    1/this of baseline's."""
    return (flops[builder] / max(tokens[builder], 1)) / (flops[baseline] / max(tokens[baseline], 1))
