"""A weight sync's stall and total time, from the disk and without it, side by side in one run,
on a real vLLM serving the 135M default model (issue 42, "weights without the disk").

    .venv/bin/python scripts/bench_sync.py [--rounds 4] [--backend http://127.0.0.1:PORT] [--out FILE.json]

Without --backend it starts its own vLLM (stack/launch.start_vllm: the worker extension and
dev mode, as `polar-mitm up` starts it) on a free port and stops it at the end; a --backend
must be one of yours (it is paused and reloaded), started the same way.

The trainer's new weights are the default model's, perturbed (fp32, as the trainer holds
them), the same for every sync. Each sync starts from the base weights (reloaded unmeasured),
and the paths take turns, disk, pull, prefetch, disk, pull, prefetch...:
  disk  save_pretrained to a folder (polar-train's checkpoint), then
        /pause?mode=keep&clear_cache=true -> /collective_rpc reload_weights(weights_path)
        -> /update_weight_version -> /resume
  pull  the weight server's publish (frame the state dict as one safetensors blob + SHA-256),
        then /pause -> /collective_rpc polar_pull_weights(url, sha256) -> tag -> /resume
  prefetch  as pull, but vLLM's workers fetch and check the blob before the pause
        (polar_prefetch_weights, polled until "ready"): the pause holds the load alone
stall: from /pause sent to /resume answered (the engine generates nothing meanwhile);
total: the stall plus the save or the publish (and the prefetch). After each sync the prompt
logprobs of a fixed prompt must equal those after the first disk sync exactly (and differ from
the base's)."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from polar_mitm.grpo.weight_server import WeightServer
from polar_mitm.models import ensure_default_model
from polar_mitm.stack import launch

PROMPT = list(range(1000, 1064))   # 64 token ids, scored with prompt_logprobs
PATHS = ("disk", "pull", "prefetch")


class Backend:
    def __init__(self, url: str):
        self.url = url

    def post(self, path: str, **kwargs) -> httpx.Response:
        # a fresh connection each time: vLLM closes one after a 500
        r = httpx.post(self.url + path, timeout=600, trust_env=False, **kwargs)
        r.raise_for_status()
        return r

    def score(self) -> list[float]:
        r = self.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 1,
                                               "temperature": 0, "prompt_logprobs": 0})
        return [next(iter(d.values()))["logprob"] for d in r.json()["choices"][0]["prompt_logprobs"][1:]]

    def prefetch(self, pull: dict) -> None:
        """The workers fetch and check the blob now, outside any pause (polled until ready)."""
        while True:
            state = self.post("/collective_rpc", json={"method": "polar_prefetch_weights",
                                                       "kwargs": pull}).json()["results"][0]
            if state["state"] != "fetching":
                break
            time.sleep(0.05)
        if state["state"] != "ready":
            raise RuntimeError(f"the prefetch failed: {state}")

    def sync(self, rpc: dict, version: int) -> tuple[float, dict | None]:
        """pause -> rpc -> tag -> resume; the seconds from pause sent to resume answered, and
        the rpc's result."""
        began = time.perf_counter()
        self.post("/pause", params={"mode": "keep", "clear_cache": "true"})
        try:
            result = self.post("/collective_rpc", json=rpc).json()["results"][0]
            self.post("/update_weight_version", json={"new_version": f"polar-v{version}"})
        finally:
            self.post("/resume")
        return time.perf_counter() - began, result


def new_weights(model_dir: Path, seed: int = 1) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return lm


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="syncs per path (taking turns)")
    ap.add_argument("--backend", default="", help="a running vLLM of yours (it is paused and reloaded)")
    ap.add_argument("--out", default="", help="also write the runs as JSON here")
    args = ap.parse_args()

    model_dir = ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    service = None
    try:
        url = args.backend
        if not url:
            port = launch.free_port()
            t0 = time.perf_counter()
            service = launch.start_vllm(model_dir, port=port, served_name="m", log_path=work / "vllm.log")
            url = f"http://127.0.0.1:{port}"
            print(f"vLLM ready on {url} after {time.perf_counter() - t0:.0f}s")
        backend = Backend(url)
        lm = new_weights(model_dir)
        params = sum(p.numel() for p in lm.parameters())
        print(f"model: {model_dir.name}, {params / 1e6:.0f}M parameters, trainer dtype fp32; "
              f"{args.rounds} rounds")

        base = backend.score()
        reference: list[float] | None = None
        runs: list[dict] = []
        with WeightServer() as server:
            for i in range(len(PATHS) * args.rounds):
                path = PATHS[i % len(PATHS)]
                backend.post("/collective_rpc", json={"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(model_dir)}})
                version = i + 1
                if path == "disk":
                    folder = work / f"v{version}"
                    t0 = time.perf_counter()
                    lm.save_pretrained(folder)
                    prepare_s = time.perf_counter() - t0
                    stall_s, result = backend.sync({"method": "reload_weights",
                                                    "kwargs": {"weights_path": str(folder)}}, version)
                    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
                else:
                    t0 = time.perf_counter()
                    published = server.publish(lm.state_dict())
                    pull = {"url": published.url, "sha256": published.sha256}
                    if path == "prefetch":
                        backend.prefetch(pull)
                    prepare_s = time.perf_counter() - t0
                    stall_s, result = backend.sync({"method": "polar_pull_weights", "kwargs": pull}, version)
                    size = published.bytes
                scores = backend.score()
                reference = reference or scores
                run = {"path": path, "version": version, "bytes": size, "prepare_s": prepare_s,
                       "stall_s": stall_s, "total_s": prepare_s + stall_s, "rpc": result,
                       "max_abs_vs_first_disk": max(abs(a - b) for a, b in zip(scores, reference)),
                       "max_abs_vs_base": max(abs(a - b) for a, b in zip(scores, base))}
                runs.append(run)
                extra = (f"  fetch {result['fetch_s']:.3f}s load {result['load_s']:.3f}s"
                         if isinstance(result, dict) else "")
                print(f"  {path:8} v{version}: {'save' if path == 'disk' else 'publish'} {prepare_s:6.3f}s  "
                      f"stall {stall_s:6.3f}s  total {run['total_s']:6.3f}s{extra}  "
                      f"|logprobs - first disk| {run['max_abs_vs_first_disk']:.1e}  "
                      f"(vs base {run['max_abs_vs_base']:.2f})")
                if path == "disk":
                    shutil.rmtree(folder)

        print(f"\n{'path':10}{'bytes':>12}{'prepare s':>11}{'stall s':>10}{'total s':>10}"
              f"   (medians of {args.rounds})")
        medians = {}
        for path in PATHS:
            mine = [r for r in runs if r["path"] == path]
            medians[path] = {k: median([r[k] for r in mine]) for k in ("prepare_s", "stall_s", "total_s")}
            print(f"{path:10}{mine[0]['bytes']:>12}{medians[path]['prepare_s']:>11.3f}"
                  f"{medians[path]['stall_s']:>10.3f}{medians[path]['total_s']:>10.3f}")
        for path in PATHS[1:]:
            print(f"{path} / disk: stall {medians[path]['stall_s'] / medians['disk']['stall_s']:.2f}x, "
                  f"total {medians[path]['total_s'] / medians['disk']['total_s']:.2f}x")
        identical = all(r["max_abs_vs_first_disk"] == 0.0 for r in runs)
        changed = all(r["max_abs_vs_base"] > 0.0 for r in runs)
        print(f"logprobs after every sync identical to the first disk sync's: {identical}; "
              f"every sync changed them from the base: {changed}")
        if args.out:
            Path(args.out).write_text(json.dumps({"runs": runs, "medians": medians}, indent=1))
        if not (identical and changed):
            raise SystemExit(1)
    finally:
        if service is not None:
            service.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
