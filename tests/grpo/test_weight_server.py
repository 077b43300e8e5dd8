"""The trainer's weight server: one safetensors blob at a secret path, its digest, the
checkpoint's names (tied weights once, as save_pretrained writes them), 404 elsewhere."""

from __future__ import annotations

import hashlib

import httpx
import torch
from safetensors.torch import load, load_file

from polar_mitm.grpo.weight_server import WeightServer, frame, unique_tensors


def get(url: str) -> httpx.Response:
    return httpx.get(url, trust_env=False, timeout=30)


def test_it_serves_the_state_dict_at_its_secret_path_with_its_digest():
    state = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2).half()}
    with WeightServer() as server:
        published = server.publish(state)
        r = get(published.url)
        assert r.status_code == 200 and len(r.content) == published.bytes
        assert hashlib.sha256(r.content).hexdigest() == published.sha256
        got = load(r.content)
        assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
        root = published.url.rsplit("/", 1)[0]
        for wrong in ("/", "/weights", published.url.rsplit("/", 1)[1][:-1]):
            assert get(root + "/" + wrong.lstrip("/")).status_code == 404, wrong
        assert httpx.post(published.url, trust_env=False).status_code in (404, 501)


def test_a_new_publish_retires_the_old_path():
    with WeightServer() as server:
        first = server.publish({"w": torch.zeros(3)})
        second = server.publish({"w": torch.ones(3)})
        assert first.url != second.url and first.sha256 != second.sha256
        assert get(first.url).status_code == 404
        assert torch.equal(load(get(second.url).content)["w"], torch.ones(3))


def test_the_served_snapshot_does_not_follow_the_trainer():
    """publish copies: the optimizer may step while vLLM is still pulling."""
    w = torch.zeros(4)
    with WeightServer() as server:
        published = server.publish({"w": w})
        w.add_(1.0)
        assert torch.equal(load(get(published.url).content)["w"], torch.zeros(4))


def test_names_are_the_checkpoints_and_tied_weights_go_once(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True))   # as SmolLM2
    state = lm.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    saved_dir = tmp_path / "saved"
    lm.save_pretrained(saved_dir)
    saved = load_file(saved_dir / "model.safetensors")
    served = load(bytes(frame(state)))
    assert served.keys() == saved.keys() == unique_tensors(state).keys()
    assert all(torch.equal(served[k], saved[k]) for k in saved)
    with WeightServer() as server:   # the checkpoint's own tensors, cast on the way
        published = server.publish_checkpoint(saved_dir, dtype=torch.bfloat16)
        got = load(get(published.url).content)
    assert got.keys() == saved.keys() and {t.dtype for t in got.values()} == {torch.bfloat16}
