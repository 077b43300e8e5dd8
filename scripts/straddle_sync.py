"""One streamed call through the proxy straddling a `polar-mitm sync`, on a real vLLM (issue
42, "Must show"): its token_versions, every token's logprob against a re-score under that
token's own version, and its wall time against the same call with no sync.

    .venv/bin/python scripts/straddle_sync.py [--max-tokens 200] [--keep DIR] [--out FILE.json]

It starts its own stack, `polar-mitm up --model <the default model>` on free ports with its own
--confdir, --db and cache folder (its logs; VLLM_CPU_KVCACHE_SPACE 1 GiB unless set), and stops
it at the end. The gateway's sampling is
the policy's (temperature 1.0), plus ignore_eos (polar_sampling, from CONFDIR/config.yaml,
which mitmdump reads) so that every call generates exactly --max-tokens tokens.

1. v1 = the default model with every weight perturbed (bench_sync.new_weights), saved.
2. A streamed call (OpenAI SDK, session "straddle~0" through the reverse listener): its wall
   time. Then the same call again, with `polar-mitm sync v1` started a third of that time in.
3. The straddling call's row from the database: token_versions as spans (two values, one
   boundary expected), its logprobs.
4. Re-score: vLLM's own prompt_logprobs for prompt + sampled tokens under v1 (it serves v1
   now), then `polar-mitm sync <default model>` (v2 = the base weights) and again under base.
   Each token must match its own version's score within 1e-3, and not the other's."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync import new_weights  # noqa: E402

from polar_mitm.models import ensure_default_model  # noqa: E402
from polar_mitm.stack import launch  # noqa: E402
from polar_mitm.store import query  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLAR_MITM = ROOT / ".venv" / "bin" / "polar-mitm"
SESSION_KEY = "polar-straddle~0"     # session "straddle~0"
PROMPT = "Write a long story about a lighthouse keeper and a storm."
TOLERANCE = 1e-3


class Up:
    """`polar-mitm up` as a subprocess; its output is read by a thread (the ports it printed)."""

    def __init__(self, work: Path, env: dict[str, str], model_dir: Path):
        self.port, self.reverse_port = launch.free_port(), launch.free_port()
        self.confdir, self.db = work / "confdir", work / "straddle.duckdb"
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            [str(POLAR_MITM), "up", "--port", str(self.port), "--reverse-port", str(self.reverse_port),
             "--confdir", str(self.confdir), "--db", str(self.db), "--model", str(model_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            print(f"  [up] {line.rstrip()}", flush=True)
            if line.startswith("or point a base URL"):
                self.ready.set()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(f"`polar-mitm up` exited {self.proc.returncode}: " + " | ".join(self.lines[-5:]))
            if time.monotonic() > deadline:
                raise RuntimeError("`polar-mitm up` not ready in time")

    @property
    def backend(self) -> str:
        for line in self.lines:
            if m := re.match(r"proxy ready: backend (\S+),", line):
                return m.group(1)
        raise RuntimeError("`up` printed no backend")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def streamed_call(reverse_port: int, max_tokens: int, on_start=None) -> dict:
    """One streamed chat call through the proxy's reverse listener; its wall time and chunks."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{reverse_port}/v1", api_key=SESSION_KEY,
                    http_client=httpx.Client(trust_env=False, timeout=600))
    began = time.perf_counter()
    if on_start:
        on_start(began)
    stream = client.chat.completions.create(model="policy", stream=True, max_tokens=max_tokens,
                                            messages=[{"role": "user", "content": PROMPT}])
    chunks, first, text = 0, None, []
    finish = None
    for chunk in stream:
        if first is None:
            first = time.perf_counter() - began
        chunks += 1
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return {"wall_s": time.perf_counter() - began, "first_chunk_s": first, "chunks": chunks,
            "finish_reason": finish, "text": "".join(text)}


def run_sync(up: Up, checkpoint: Path, env: dict[str, str]) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([str(POLAR_MITM), "sync", str(checkpoint), "--confdir", str(up.confdir),
                           "--port", str(up.port)], capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"polar-mitm sync failed ({done.returncode}): {done.stdout} {done.stderr}")
    out = {"wall_s": wall, "output": done.stdout.strip()}
    if m := re.search(r"stall ([\d.]+) s, total ([\d.]+) s", done.stdout):
        out["stall_s"], out["total_s"] = float(m.group(1)), float(m.group(2))
    if m := re.search(r"policy version (\d+)", done.stdout):
        out["version"] = int(m.group(1))
    return out


def spans(versions: list[int | None] | None) -> str:
    if versions is None:
        return "NULL (every token: policy_version)"
    parts, start = [], 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            parts.append(f"v{versions[start]} {start}-{i}")
            start = i
    return "[" + ", ".join(parts) + "]"


def rescore(backend: str, model: str, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """vLLM's logprob of each sampled token given everything before it (prompt_logprobs=0:
    the prompt's own token at each position; temperature 1, raw logprobs as recorded)."""
    r = httpx.post(backend + "/v1/completions", timeout=600, trust_env=False, json={
        "model": model, "prompt": prompt_ids + token_ids, "max_tokens": 1, "temperature": 1.0,
        "prompt_logprobs": 0})
    r.raise_for_status()
    plp = r.json()["choices"][0]["prompt_logprobs"]
    out = []
    for pos, tok in zip(range(len(prompt_ids), len(prompt_ids) + len(token_ids)), token_ids):
        out.append(plp[pos][str(tok)]["logprob"])
    return out


def compare(recorded: list[float], score: list[float], idx: range) -> tuple[int, float]:
    diffs = [abs(recorded[i] - score[i]) for i in idx]
    return sum(d < TOLERANCE for d in diffs), max(diffs, default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--keep", default="", help="work in this folder (kept) instead of a temporary one")
    ap.add_argument("--out", default="", help="also write the figures as JSON here")
    args = ap.parse_args()

    base_dir = ensure_default_model()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="straddle-"))
    work.mkdir(parents=True, exist_ok=True)
    # a cache folder of its own for up's logs (the model is given by its own path: vLLM's
    # compile cache is keyed by it)
    cache = work / "cache"
    (cache / "models").mkdir(parents=True, exist_ok=True)
    link = cache / "models" / base_dir.name
    if not link.exists():
        link.symlink_to(base_dir)
    # 1 GiB of KV cache is plenty for one 200-token call (the stack's default is 2)
    env = {**os.environ, "POLAR_MITM_CACHE": str(cache),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        env.pop(k, None)

    print(f"work: {work}")
    t0 = time.perf_counter()
    v1_dir = work / "v1"
    if not (v1_dir / "config.json").exists():
        new_weights(base_dir).save_pretrained(v1_dir)
        for f in base_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config",
                                  "chat_template")):
                (v1_dir / f.name).write_bytes(f.read_bytes())
    print(f"v1 (perturbed weights) saved in {time.perf_counter() - t0:.1f}s")

    up = Up(work, env, base_dir)
    (up.confdir).mkdir(mode=0o700, parents=True, exist_ok=True)
    # the policy's sampling stays; every call generates exactly max_tokens tokens
    (up.confdir / "config.yaml").write_text('polar_sampling: "ignore_eos=true"\n')
    results: dict = {}
    try:
        t0 = time.perf_counter()
        up.wait_ready(900)
        print(f"stack up after {time.perf_counter() - t0:.0f}s; backend {up.backend}")
        model = httpx.get(up.backend + "/v1/models", trust_env=False).json()["data"][0]["id"]

        warm = streamed_call(up.reverse_port, 8)
        print(f"warm-up call: {warm['wall_s']:.2f}s")
        plain = streamed_call(up.reverse_port, args.max_tokens)
        print(f"call without a sync: {plain['wall_s']:.2f}s, {plain['chunks']} chunks, "
              f"finish {plain['finish_reason']}")

        sync_result: dict = {}
        delay = plain["wall_s"] / 3

        def sync_later(began: float) -> None:
            def go() -> None:
                time.sleep(max(0.0, began + delay - time.perf_counter()))
                sync_result["started_after_s"] = time.perf_counter() - began
                try:
                    sync_result.update(run_sync(up, v1_dir, env))
                except Exception as e:   # reported below
                    sync_result["error"] = repr(e)
            t = threading.Thread(target=go)
            t.start()
            sync_result["thread"] = t

        straddled = streamed_call(up.reverse_port, args.max_tokens, on_start=sync_later)
        sync_result.pop("thread").join()
        if "error" in sync_result:
            raise RuntimeError(sync_result["error"])
        print(f"call with a sync: {straddled['wall_s']:.2f}s, {straddled['chunks']} chunks, "
              f"finish {straddled['finish_reason']}")
        print(f"sync started {sync_result['started_after_s']:.2f}s into the call; its output:\n  "
              + sync_result["output"].replace("\n", "\n  "))

        # the straddling call: the session's last
        row = None
        for _ in range(60):
            cols, rows = query(up.db, "SELECT call_id, token_ids, logprobs, token_versions, prompt_token_ids, "
                                      "policy_version, backend_params FROM calls WHERE session_id = ? "
                                      "ORDER BY started_at", ["straddle~0"])
            if len(rows) >= 3:
                row = dict(zip(cols, rows[-1]))
                break
            time.sleep(1)
        if row is None:
            raise RuntimeError("the straddling call is not in the database")
        tokens, logprobs, versions = row["token_ids"], row["logprobs"], row["token_versions"]
        prompt_ids = row["prompt_token_ids"]
        print(f"recorded: {len(tokens)} tokens, {len(prompt_ids)} prompt tokens, "
              f"policy_version {row['policy_version']}, backend params {row['backend_params']}")
        print(f"token_versions: {spans(versions)}")
        values = sorted(set(versions or []), key=lambda v: (v is None, v))
        boundaries = sum(versions[i] != versions[i - 1] for i in range(1, len(versions))) if versions else 0
        two_one = values == [0, 1] and boundaries == 1 and versions[0] == 0
        print(f"two values, one boundary: {two_one} (values {values}, boundaries {boundaries})")

        under_v1 = rescore(up.backend, model, prompt_ids, tokens)
        back = run_sync(up, base_dir, env)
        print("sync back to the base weights: " + back["output"].replace("\n", " | "))
        under_base = rescore(up.backend, model, prompt_ids, tokens)

        cut = versions.index(1) if versions and 1 in versions else len(tokens)
        before, after = range(0, cut), range(cut, len(tokens))
        b_base, b_base_max = compare(logprobs, under_base, before)
        b_v1, b_v1_max = compare(logprobs, under_v1, before)
        a_v1, a_v1_max = compare(logprobs, under_v1, after)
        a_base, a_base_max = compare(logprobs, under_base, after)
        lines = [
            f"token_versions: {spans(versions)} (policy_version {row['policy_version']}; "
            f"two values, one boundary: {two_one})",
            f"before the boundary [0,{cut}): |recorded-base|<1e-3 {b_base}/{len(before)} "
            f"(max {b_base_max:.2e}); |recorded-v1|<1e-3 {b_v1}/{len(before)}",
            f"after the boundary [{cut},{len(tokens)}): |recorded-v1|<1e-3 {a_v1}/{len(after)} "
            f"(max {a_v1_max:.2e}); |recorded-base|<1e-3 {a_base}/{len(after)}",
            f"call wall time: {straddled['wall_s']:.2f} s with the sync, {plain['wall_s']:.2f} s without "
            f"({straddled['wall_s'] - plain['wall_s']:+.2f} s)",
            f"polar-mitm sync (started {sync_result['started_after_s']:.2f} s into the call): "
            f"stall {sync_result.get('stall_s')} s, total {sync_result.get('total_s')} s, "
            f"command wall {sync_result['wall_s']:.2f} s",
        ]
        ok = (two_one and b_base == len(before) and a_v1 == len(after) and len(before) > 0 and len(after) > 0
              and b_v1 < len(before) and a_base < len(after))
        lines.append(f"every token matches its own version: {ok}")
        print("\n" + "\n".join(lines))
        results = {"spans": spans(versions), "two_values_one_boundary": two_one, "cut": cut,
                   "n_tokens": len(tokens), "before_match_base": b_base, "before_max_diff_base": b_base_max,
                   "before_match_v1": b_v1, "after_match_v1": a_v1, "after_max_diff_v1": a_v1_max,
                   "after_match_base": a_base, "plain": plain, "straddled": straddled,
                   "sync": sync_result, "sync_back": back, "summary": lines, "ok": ok,
                   "backend_max_diffs": {"before_v1": b_v1_max, "after_base": a_base_max}}
    finally:
        code = up.stop()
        print(f"`polar-mitm up` stopped: exit {code}")
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        print(f"logs: {cache / 'logs'}")
    if not results.get("ok"):
        sys.exit(1)


if __name__ == "__main__":
    main()
