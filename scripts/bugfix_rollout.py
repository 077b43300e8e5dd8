"""The shipped bug-fix tasks (examples/bugfix/tasks.jsonl) through `polar-mitm rollout` with a
real harness, each session in the test image, graded by the tests evaluator. Two backends:

  --backend embedded   the embedded default model (SmolLM2-135M on vLLM): it will mostly fix
                       nothing, and the tests say so (0.0 each).
  --backend stand-in   a stand-in for vLLM that answers the harness's first turn with a call of
                       its shell tool that applies the right patch (examples/bugfix/fixes), then
                       with text: the tests evaluator scores 1.0.

Prints what `polar-mitm rollout` prints, then each session's reward and per-test results
from the database.
    python scripts/bugfix_rollout.py --backend stand-in [--harness pi] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from polar_mitm.store import query  # noqa: E402

BUGFIX = ROOT / "examples" / "bugfix"
POLAR = str(Path(sys.executable).parent / "polar-mitm")


def stand_in():
    """FakeVLLM's scripted mode, whose shell-tool call applies the patch of the task named in
    the conversation."""
    import orjson
    from support.fake_vllm import SHELL_TOOLS, FakeVLLM, _args

    patches = {p.stem: p.read_text() for p in (BUGFIX / "fixes").glob("*.patch")}

    class PatchingVLLM(FakeVLLM):
        def answer(self, body: dict) -> dict:
            out = super().answer(body)
            msg = out["choices"][0]["message"]
            calls = msg.get("tool_calls") or []
            text = orjson.dumps(body.get("messages") or []).decode()
            name = next((n for n in patches if f"{n}()" in text or f"{n}.py" in text), None)
            if calls and name and calls[0]["function"]["name"] in SHELL_TOOLS:
                tools = {t["function"]["name"]: t["function"] for t in body.get("tools") or []}
                args = _args(tools[calls[0]["function"]["name"]].get("parameters") or {})
                key = "cmd" if "cmd" in args else "command"
                args[key] = f"printf %s {shlex.quote(patches[name])} | git apply && git diff --stat"
                calls[0]["function"]["arguments"] = orjson.dumps(args).decode()
            return out

    return PatchingVLLM("scripted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["embedded", "stand-in"], required=True)
    ap.add_argument("--harness", default="pi")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--out", default=None, help="where the database goes (default: a temporary directory)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bugfix-"))
    out.mkdir(parents=True, exist_ok=True)
    db = out / "rollouts.duckdb"
    argv = [POLAR, "rollout", str(BUGFIX / "tasks.jsonl"), "--harness", args.harness,
            "--samples", str(args.samples), "--db", str(db), "--workers", "3"]
    fake = None
    if args.backend == "stand-in":
        fake = stand_in().__enter__()
        argv += ["--backend", fake.url]
    print("$", " ".join(shlex.quote(a) for a in argv), flush=True)
    try:
        code = subprocess.run(argv).returncode
    finally:
        if fake is not None:
            fake.__exit__(None, None, None)
    _, rows = query(db, "SELECT session_id, state, reward, reason, stats FROM rollout_sessions ORDER BY 1")
    print(f"\n{'session':<22} {'state':<8} {'reward':>6}  tests")
    for sid, state, reward, reason, stats in rows:
        st = json.loads(stats) if isinstance(stats, str) else (stats or {})
        tests = ", ".join(f"{t.split('::')[-1]} {s}" for t, s in (st.get("tests") or {}).items())
        print(f"{sid:<22} {state:<8} {'-' if reward is None else f'{reward:g}':>6}  "
              f"{tests or reason or ''}  (init {st.get('init_s')} s, image unpack {st.get('image_unpack_s')} s)")
    sys.exit(code)


if __name__ == "__main__":
    main()
