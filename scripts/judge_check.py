"""The judge evaluator on the embedded model: vLLM serving the default SmolLM2 (as `polar-mitm
up` starts it), asked straight (never through the proxy) to grade three small synthetic
transcripts of one task, each alone (mode single) and then all three together (mode group).
Prints per transcript the score, its reasoning and the reward it combines into, or the
JudgeError that failed the evaluation: a 135M model often writes no parsable verdict, which
must come out as a failed evaluation, never as a score.

    .venv/bin/python scripts/judge_check.py                 # starts vLLM (~80 s on CPU)
    .venv/bin/python scripts/judge_check.py --backend URL   # a vLLM already running
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_mitm.rollout.judge import JudgeError, JudgeSpec, combine, judge_group, judge_session  # noqa: E402
from polar_mitm.store.transcripts import Transcript  # noqa: E402

RUBRIC = """5: the agent found the bug in calc.add, fixed it, ran the tests and they pass.
3: it fixed the bug but did not check it.
1: it changed something else, or claims a fix the tests contradict.
0: it gave up or did nothing."""

INSTRUCTION = "The test test_add in test_calc.py fails. Fix the bug in calc.py so that it passes."
FAILING = "FAILED test_calc.py::test_add - assert -1 == 5\n1 failed in 0.02s"


def _transcripts() -> list[Transcript]:
    """A good session, a wrong one that claims success, and one that gave up."""
    def start(sid: str, turns: list[dict], final: str) -> Transcript:
        head = [{"role": "user", "text": INSTRUCTION},
                {"role": "assistant", "text": "Let me run the tests first.",
                 "tool_calls": [{"name": "bash", "arguments": '{"command": "pytest -q"}'}]},
                {"role": "tool", "name": "bash", "text": FAILING, "is_error": True}]
        return Transcript(sid, INSTRUCTION, head + turns + [{"role": "assistant", "text": final, "tool_calls": []}],
                          final)

    good = start("calc~0", [
        {"role": "assistant", "text": "add() subtracts. Fixing it.",
         "tool_calls": [{"name": "edit", "arguments": '{"path": "calc.py", "old": "return a - b", "new": "return a + b"}'}]},
        {"role": "tool", "name": "edit", "text": "edited calc.py", "is_error": False},
        {"role": "assistant", "text": "", "tool_calls": [{"name": "bash", "arguments": '{"command": "pytest -q"}'}]},
        {"role": "tool", "name": "bash", "text": "1 passed in 0.01s", "is_error": False}],
        "Fixed calc.add: it returned a - b instead of a + b. The tests pass now.")
    wrong = start("calc~1", [
        {"role": "assistant", "text": "I'll change the test instead.",
         "tool_calls": [{"name": "edit", "arguments": '{"path": "test_calc.py", "old": "== 5", "new": "== -1"}'}]},
        {"role": "tool", "name": "edit", "text": "edited test_calc.py", "is_error": False}],
        "Done, the bug is fixed.")
    gave_up = start("calc~2", [], "I could not find the problem.")
    return [good, wrong, gave_up]


def _single(spec: JudgeSpec, transcripts: list[Transcript], backend: str, outcome: float | None) -> None:
    print(f"\n== mode single (max_score {spec.max_score:g}, weight {spec.weight:g}, max_tokens {spec.max_tokens})")
    for t in transcripts:
        t0 = time.monotonic()
        try:
            r = judge_session(spec, t, backend)
        except JudgeError as e:
            print(f"{t.session_id}: FAILED evaluation ({time.monotonic() - t0:.1f}s): {e}")
            answer = (e.call or {}).get("answer")
            if answer is not None:
                print(f"    the judge's answer began: {answer[:300]!r}")
            continue
        print(f"{t.session_id}: score {r.score:g}/{spec.max_score:g} -> reward {combine(outcome, r.score, spec):.3f} "
              f"(outcome {outcome}) ({time.monotonic() - t0:.1f}s, model {r.call['model']})\n"
              f"    reasoning: {r.reasoning!r}")


def _group(spec: JudgeSpec, transcripts: list[Transcript], backend: str, outcome: float | None) -> None:
    print(f"\n== mode group ({len(transcripts)} trajectories in one prompt)")
    t0 = time.monotonic()
    try:
        results = judge_group(spec, transcripts, backend)
    except JudgeError as e:
        print(f"group FAILED evaluation ({time.monotonic() - t0:.1f}s), for every session "
              f"({', '.join(t.session_id for t in transcripts)}): {e}")
        answer = (e.call or {}).get("answer")
        if answer is not None:
            print(f"    the judge's answer began: {answer[:300]!r}")
        return
    for sid, r in results.items():
        print(f"{sid} ({r.call['id']}): score {r.score:g}/{spec.max_score:g} -> reward "
              f"{combine(outcome, r.score, spec):.3f}\n    reasoning: {r.reasoning!r}")
    print(f"({time.monotonic() - t0:.1f}s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", help="a running vLLM's URL (default: start the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=512, help="the judge's answer budget")
    ap.add_argument("--outcome", type=float, default=None, help="a test outcome to combine with (default: none)")
    args = ap.parse_args()
    transcripts = _transcripts()
    if args.backend:
        backend, stack = args.backend, None
    else:
        from polar_mitm.stack.local import Stack
        from polar_mitm.stack.vllm import VLLMSettings
        stack = Stack()
        logs = Path(tempfile.mkdtemp(prefix="judge-check-"))
        backend = stack.start_model(logs, VLLMSettings())   # as `polar-mitm up` does
    try:
        single = JudgeSpec(rubric=RUBRIC, max_tokens=args.max_tokens)
        _single(single, transcripts, backend, args.outcome)
        _group(JudgeSpec(rubric=RUBRIC, mode="group", max_tokens=args.max_tokens), transcripts, backend,
               args.outcome)
    finally:
        if stack is not None:
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
