"""vLLM's logprobs of a fixed prompt's greedy continuation against a model directory's own:
how a test tells which weights a running vLLM serves."""

from __future__ import annotations

import httpx

from polar_mitm.models import DEFAULT_MODEL_NAME

PROMPT = "The capital of France is"


def vllm_logprobs(backend: str) -> tuple[list[int], list[int], list[float]]:
    """Greedy tokens after PROMPT, with vLLM's logprobs of them."""
    r = httpx.post(backend + "/v1/completions", timeout=120, trust_env=False, json={
        "model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0,
        "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return r.json()["choices"][0].get("prompt_token_ids") or r.json()["prompt_token_ids"], \
        choice["token_ids"], choice["logprobs"]["token_logprobs"]


def hf_logprobs(model_dir: str, prompt: list[int], tokens: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = lm(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def mean_abs(a, b) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def reload(backend: str, model_dir: str) -> None:
    httpx.post(backend + "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": model_dir}},
               timeout=300, trust_env=False).raise_for_status()
    httpx.post(backend + "/reset_prefix_cache", timeout=60, trust_env=False).raise_for_status()
