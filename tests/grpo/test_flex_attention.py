"""The GPU attention path, checked on CPU: flex attention (block masks, rows packed to the
budget) gives the trie the same logprobs as the SDPA path the CPU uses. flex_attention runs
eagerly here (GPUs compile it) and has no backward on CPU (torch raises NotImplementedError
for it), so its gradients are compared with the CPU's by scripts/gpu_check.sh on CUDA."""

from __future__ import annotations

import pytest
import torch

from support.grpo_data import synthetic_calls, tiny_model_dir
from polar_mitm.grpo.packing import merge
from polar_mitm.grpo.policy import ForestRunner, TokenLogprobs
from polar_mitm.grpo.train import load_model
from polar_mitm.grpo.trajectories import build

pytest.importorskip("torch.nn.attention.flex_attention")


def logprobs(model, forest, attention: str | None) -> torch.Tensor:
    """attention None: what the trainer uses on CPU (load_model's choice)."""
    from transformers import AutoModelForCausalLM
    if attention is None:
        lm = load_model(model, torch.device("cpu"))
    else:
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation=attention)
    lm.eval()
    runner = ForestRunner(forest, 96, torch.device("cpu"), lm.config._attn_implementation, lm.dtype)
    with torch.no_grad():
        return runner.run(TokenLogprobs(lm), None)


def test_flex_attention_gives_the_trie_the_logprobs_of_sdpa(tmp_path):
    model = tiny_model_dir(tmp_path / "m")
    # sessions sharing a prefix longer than a row: context rows and packed rows both occur
    calls = synthetic_calls(tasks=2, seed=5, shared=150)
    forest = merge(build(calls, "trie").samples)
    sdpa = logprobs(model, forest, None)
    flex = logprobs(model, forest, "flex_attention")
    assert sdpa.shape == flex.shape and sdpa.numel() == len(forest.target_call) > 0
    assert torch.allclose(sdpa, flex, atol=1e-5), (sdpa - flex).abs().max()
