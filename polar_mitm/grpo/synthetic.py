"""Synthetic calls shaped like real harness runs, at the token level: a GRPO group of
sessions sharing a long system + tools + task prompt, tool loops that append tool output
after each response, and the irregular calls real harnesses make (re-tokenization drift,
retries, side calls, sub-agents, compaction). For tests and benchmarks; no model needed."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..trainer_input import Call

EOT = 2                  # end of turn (SmolLM2's <|im_end|>)
START = 1                # <|im_start|>


@dataclass(frozen=True)
class Shape:
    sessions: int = 8
    turns: int = 20
    shared: int = 15000           # system + tools + task prompt, shared by the group
    tool: tuple[int, int] = (100, 1000)
    response: tuple[int, int] = (50, 300)
    drifts: int = 1               # per session: a later prompt re-renders a response differently
    side_calls: int = 1           # per session: e.g. Claude Code's title call, Gemini's router
    retries: int = 0              # per session: a call repeated with the same prompt
    subagents: int = 0            # per session: a separate conversation with its own prompt
    compactions: int = 0          # per session: the history is rewritten (summary + recent turns)
    vocab: int = 49152


def group(task: str, shape: Shape, rng: random.Random, reward=None) -> list[Call]:
    """The calls of one task's sessions (named TASK~i), in each session's call order."""
    def toks(n: int) -> list[int]:
        return [rng.randrange(3, shape.vocab) for _ in range(n)]

    shared = toks(shape.shared)
    title_prompt = toks(max(8, shape.shared // 100)) + shared[-min(50, shape.shared):]
    calls: list[Call] = []
    for s in range(shape.sessions):
        sid = f"{task}~{s}"
        r = reward(s) if reward else float(rng.random() < 0.5)
        seq = 0

        def emit(prompt: list[int], tokens: list[int], finish="stop") -> None:
            nonlocal seq
            seq += 1
            calls.append(Call(session_id=sid, group=task, seq=seq, prompt=list(prompt), tokens=tokens,
                              logprobs=[-rng.random() * 3 for _ in tokens], finish_reason=finish, reward=r))

        def response() -> list[int]:
            return toks(rng.randint(*shape.response)) + [EOT]

        def turn_tail() -> list[int]:  # template glue, tool output, next generation header
            return [START] + toks(rng.randint(*shape.tool)) + [EOT, START, 5]

        drift_at = set(rng.sample(range(shape.turns - 1), min(shape.drifts, shape.turns - 1)))
        side_at = set(rng.sample(range(shape.turns), min(shape.side_calls, shape.turns)))
        retry_at = set(rng.sample(range(shape.turns), min(shape.retries, shape.turns)))
        sub_at = set(rng.sample(range(shape.turns), min(shape.subagents, shape.turns)))
        compact_at = set(rng.sample(range(1, shape.turns), min(shape.compactions, max(shape.turns - 1, 0))))
        prompt = shared + [START, 5]
        for t in range(shape.turns):
            if t in compact_at:     # the harness rewrites history: system + summary + the last turn
                prompt = shared[: shape.shared // 2] + toks(rng.randint(5, 40)) + prompt[-20:]
            if t in side_at:
                emit(title_prompt, toks(rng.randint(2, 12)) + [EOT])
            if t in retry_at:       # a failed attempt, discarded by the harness
                emit(prompt, response()[: rng.randint(1, 6)], finish="length")
            if t in sub_at:         # a sub-agent: its own short conversation
                sub = toks(rng.randint(20, 60)) + shared[:10]
                for _ in range(rng.randint(1, 3)):
                    rs = response()
                    emit(sub, rs)
                    sub = sub + rs + turn_tail()
            r_k = response()
            finish = "stop"
            if rng.random() < 0.1:  # cut by max_tokens: no end of turn sampled
                r_k, finish = r_k[:-1], "length"
            emit(prompt, r_k, finish)
            canon = r_k if finish == "stop" else r_k + [EOT]
            if t in drift_at and len(r_k) > 2:   # one token re-tokenized as two
                i = rng.randrange(0, len(r_k) - 1)
                canon = r_k[:i] + toks(2) + r_k[i + 1:] + ([] if finish == "stop" else [EOT])
            prompt = prompt + canon + turn_tail()
    return calls
