"""Test data for the trainer: synthetic harness-shaped calls written through the proxy's
own writer, and a tiny random Llama saved as a Hugging Face directory."""

import random
import time
from pathlib import Path

from polar_mitm.grpo.synthetic import Shape, group
from polar_mitm.store import CallRecord, CallWriter, SessionInfo

VOCAB = 64


def synthetic_calls(tasks=2, seed=0, prefix="t", **shape):
    rng = random.Random(seed)
    s = Shape(**({"sessions": 3, "turns": 3, "shared": 20, "tool": (2, 5), "response": (2, 5), "vocab": VOCAB}
                 | shape))
    return [c for t in range(tasks) for c in group(f"{prefix}{t}", s, rng, reward=lambda i: [1.0, 0.0, 0.5, 0.25][i % 4])]


def write_calls(db: Path, calls, extra_records=()) -> None:
    """Each call as the proxy records it (seq follows the order given, policy version 0);
    extra_records are (session, record) pairs of plain dicts (SessionInfo's and CallRecord's
    fields, policy_version 0 unless given), written as well."""
    w = CallWriter(db).start()
    futures = []
    for i, c in enumerate(calls):
        futures.append(w.submit(
            SessionInfo(c.session_id, task_id=c.group, source="api_key"),
            CallRecord(f"c{i}", style="openai_chat", status_code=200, started_at=time.time(),
                       prompt_token_ids=list(c.prompt), token_ids=list(c.tokens), logprobs=list(c.logprobs),
                       finish_reason=c.finish_reason, policy_version=0)))
    for j, (session, record) in enumerate(extra_records):
        futures.append(w.submit(SessionInfo(**session),
                                CallRecord(**({"call_id": f"x{j}", "started_at": time.time(), "policy_version": 0} | record))))
    for f in futures:
        f.result(30)
    w.close()


def tiny_model_dir(path: Path, vocab: int = VOCAB, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path
