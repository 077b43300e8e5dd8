"""The vLLM worker extension that pulls weights from the trainer's memory, without vLLM: the
module is imported by its path (as vLLM's Python imports it, without polar_mitm) and mixed
into a stand-in worker whose reload_weights loads a tiny torch model from the iterator."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from polar_mitm.grpo.weight_server import WeightServer, frame

EXTENSION = Path(__file__).resolve().parents[2] / "polar_mitm" / "vllm_ext" / "weight_pull.py"


def load_extension():
    spec = importlib.util.spec_from_file_location("weight_pull", EXTENSION)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["weight_pull"] = module      # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


weight_pull = load_extension()


def tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11))
    model[1].weight = model[0].weight        # tied, as SmolLM2's lm_head
    return model


class StandInWorker:
    """vLLM's worker as the extension sees it: reload_weights(weights_iterator=...)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.reloads = model, 0

    def reload_weights(self, weights_iterator) -> None:
        self.reloads += 1
        given = dict(weights_iterator)
        with torch.no_grad():
            for name, p in self.model.named_parameters():   # tied: one name, as vLLM ties them
                p.copy_(given[name])


class Worker(StandInWorker, weight_pull.WeightPull):
    pass


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_pull_reloads_the_served_tensors_and_reports_json():
    trained, served = tiny(1), tiny(2)
    worker = Worker(served)
    with WeightServer() as server:
        published = server.publish(trained.state_dict())
        report = worker.polar_pull_weights(url=published.url, sha256=published.sha256)
    assert same_weights(served, trained) and worker.reloads == 1
    assert json.loads(json.dumps(report)) == report      # /collective_rpc answers it as JSON
    # the tied weight travels once: embedding, bias (no second copy of the tied matrix)
    assert report["bytes"] == published.bytes and report["tensors"] == published.tensors == 2
    assert report["fetch_s"] >= 0 and report["load_s"] >= 0


def test_a_wrong_digest_loads_nothing():
    trained, served = tiny(1), tiny(2)
    before = {k: v.clone() for k, v in served.state_dict().items()}
    worker = Worker(served)
    with WeightServer() as server:
        published = server.publish(trained.state_dict())
        wrong = hashlib.sha256(b"other weights").hexdigest()
        with pytest.raises(weight_pull.PullError, match="sha256"):
            worker.polar_pull_weights(url=published.url, sha256=wrong)
    assert worker.reloads == 0
    assert all(torch.equal(before[k], v) for k, v in served.state_dict().items())


def test_the_iterator_gives_every_tensor_as_a_view_of_the_blob():
    state = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "i64": torch.arange(4),
             "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "flag": torch.tensor([True, False])}
    blob = frame(state)
    entries = weight_pull.parse_header(blob)
    got = dict(weight_pull.tensors(blob, entries))
    assert got.keys() == state.keys()
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # no copy: writing into the blob shows in the tensor
    f32 = next(e for e in entries if e.name == "f32")
    blob[f32.start:f32.start + 4] = torch.tensor([42.0]).numpy().tobytes()
    assert got["f32"][0, 0].item() == 42.0


@pytest.mark.parametrize("damage", ["truncated", "header_past_end", "bad_dtype", "offsets_past_end",
                                    "shape_mismatch", "not_json"])
def test_a_malformed_blob_is_refused_before_any_tensor(damage):
    blob = frame({"w": torch.randn(4, 4)})
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(bytes(blob[8:8 + size]))
    if damage == "truncated":
        blob = blob[:-1]
    elif damage == "header_past_end":
        blob[:8] = (len(blob)).to_bytes(8, "little")
    elif damage == "not_json":
        blob[8:10] = b"\xff\xfe"
    else:
        entry = header["w"]
        if damage == "bad_dtype":
            entry["dtype"] = "C64"
        elif damage == "offsets_past_end":
            entry["data_offsets"] = [0, 10 ** 9]
        else:
            entry["shape"] = [4, 5]
        text = json.dumps(header).encode()
        text += b" " * (size - len(text))
        blob[8:8 + size] = text
    with pytest.raises(weight_pull.PullError):
        weight_pull.parse_header(blob)


def test_a_transfer_cut_short_is_refused():
    """A server that announces more than it sends (the trainer died mid-transfer)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises((weight_pull.PullError, OSError)):
            weight_pull.fetch_checked(f"http://127.0.0.1:{listener.getsockname()[1]}/w", "0" * 64, timeout=10)
    finally:
        listener.close()


def test_errors_keep_the_secret_path_out():
    with WeightServer() as server:
        published = server.publish({"w": torch.zeros(2)})
        with pytest.raises(weight_pull.PullError) as raised:
            weight_pull.fetch_checked(published.url, "0" * 64)
    secret = published.url.rsplit("/", 1)[1]
    assert secret not in str(raised.value)


def test_the_extension_adds_only_polar_methods_to_the_worker():
    """vLLM refuses an extension with an attribute its worker has already (worker_base.py)."""
    added = [name for name in dir(weight_pull.WeightPull) if not name.startswith("__")]
    assert added == ["polar_prefetch_weights", "polar_pull_weights"]


def test_a_prefetch_stages_the_blob_and_the_pull_only_loads():
    trained, served = tiny(1), tiny(2)
    worker = Worker(served)
    with WeightServer() as server:
        published = server.publish(trained.state_dict())
        kwargs = {"url": published.url, "sha256": published.sha256}
        state = worker.polar_prefetch_weights(**kwargs)
        assert state["state"] in ("fetching", "ready") and worker.reloads == 0
        deadline = time.monotonic() + 30
        while state["state"] == "fetching" and time.monotonic() < deadline:
            time.sleep(0.01)
            state = worker.polar_prefetch_weights(**kwargs)   # the same: only reports
        assert state == {"state": "ready", "bytes": published.bytes, "fetch_s": state["fetch_s"]}
        assert worker.reloads == 0 and not same_weights(served, trained)
        server.publish({"other": torch.zeros(1)})     # the URL is gone: the pull must not fetch
        report = worker.polar_pull_weights(**kwargs)
    assert report["prefetched"] is True and same_weights(served, trained) and worker.reloads == 1


def test_a_failed_prefetch_is_reported_and_its_pull_loads_nothing():
    trained, served = tiny(1), tiny(2)
    worker = Worker(served)
    with WeightServer() as server:
        published = server.publish(trained.state_dict())
        kwargs = {"url": published.url, "sha256": "0" * 64}
        state = worker.polar_prefetch_weights(**kwargs)
        deadline = time.monotonic() + 30
        while state["state"] == "fetching" and time.monotonic() < deadline:
            time.sleep(0.01)
            state = worker.polar_prefetch_weights(**kwargs)
        assert state["state"] == "failed" and "sha256" in state["error"]
        with pytest.raises(weight_pull.PullError, match="sha256"):
            worker.polar_pull_weights(**kwargs)
    assert worker.reloads == 0 and not same_weights(served, trained)


def test_a_pull_of_other_weights_ignores_the_staged_blob():
    first, second, served = tiny(1), tiny(3), tiny(2)
    worker = Worker(served)
    with WeightServer() as server:
        old = server.publish(first.state_dict())
        worker.polar_prefetch_weights(url=old.url, sha256=old.sha256)
        new = server.publish(second.state_dict())
        report = worker.polar_pull_weights(url=new.url, sha256=new.sha256)
    assert report["prefetched"] is False and same_weights(served, second)
