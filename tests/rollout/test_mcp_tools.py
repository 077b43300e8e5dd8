"""A task's MCP servers and skills reach the model through each CLI's own configuration.

The sessions: each CLI with MCP (Claude Code, Codex, Gemini CLI, Qwen Code) runs through the
real gateway, in its sandbox, with a stdio MCP server on the official SDK
(tests/support/mcp_echo_server.py) and a skill. The proof is what the proxy recorded: the CLI's
request offers the server's tool (each CLI names it its own way: mcp__probe__polar_probe_tool,
mcp_probe_polar_probe_tool, ... so the suffix is checked) and the skill's description; the
scripted backend then calls the tool, and the next request carries the server's answer.
Qwen Code defers MCP tools behind its tool_search (named in the system prompt, their schemas
fetched on demand): the backend searches first, as a model would. Pi has no MCP (its README:
"No MCP."), so only its skill is checked.

Then unit tests of the task's JSON (parse_mcp_servers, parse_skills) and of the config files
written for each CLI."""

from __future__ import annotations

import dataclasses
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from polar_mitm.rollout import harnesses, mcp
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.store import query
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts, installed, session_logs
from support.mcp_echo_server import PROBE_MARKER, TOOL
from support.procs import until
from support import SUPPORT

SERVER = SUPPORT / "mcp_echo_server.py"
SKILL_DESCRIPTION = "polar-skill-probe, how to greet a polar bear"
WORD = "aurora"
SLOW_START = 6      # seconds before the MCP server answers
MCP_CLIS = list(mcp.MCP_FILES)


class ProbeBackend(FakeVLLM):
    """The scripted backend, with the MCP tool first: it calls the probe tool when offered,
    searches for it through tool_search where the CLI defers it, and answers text once the
    probe's result is back."""

    def answer(self, body: dict) -> dict:
        messages = body.get("messages") or []
        tools = {t["function"]["name"]: t["function"] for t in body.get("tools") or []}
        probe = next((n for n in tools if n.endswith(TOOL)), None)
        called = {c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}
        if (body.get("response_format") or {}).get("type") == "json_schema":
            return super().answer({**body, "tools": []})      # schema-shaped JSON
        if probe and probe not in called:
            return self._call(body, probe, {"word": WORD})
        if not probe and "tool_search" in tools and "tool_search" not in called:
            return self._call(body, "tool_search", {"query": f"select:mcp__probe__{TOOL}"})
        return super().answer({**body, "tools": []})        # text: done

    def _call(self, body: dict, name: str, args: dict) -> dict:
        out = super().answer({**body, "tools": [], "response_format": None})
        out["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{len(self.bodies)}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}]}
        out["choices"][0]["finish_reason"] = "tool_calls"
        return out


@pytest.fixture(scope="module")
def backend():
    with ProbeBackend("scripted") as b:
        yield b


@pytest.fixture(scope="module")
def skill(tmp_path_factory) -> mcp.Skill:
    d = tmp_path_factory.mktemp("skills") / "polar-greeting"
    d.mkdir()
    (d / "SKILL.md").write_text(f"---\nname: polar-greeting\ndescription: {SKILL_DESCRIPTION}\n---\n\n"
                                "Say hello, then wave.\n")
    return mcp.parse_skills({"polar-greeting": str(d)})[0]


def probe_server() -> mcp.McpServer:
    """The echo server, started by the CLI in the sandbox: the node's Python and its venv are
    in every sandbox (read-only), and tests/ is exposed (conftest). It starts slower than
    Claude Code's own wait (5 s) and Codex's grace for optional servers: the CLI has to wait
    for it (mcp.env, Codex's required servers), or its first turn goes without the tool."""
    return mcp.parse_mcp_servers({"probe": {"command": sys.executable, "args": [str(SERVER)],
                                            "env": {"POLAR_PROBE_DELAY": str(SLOW_START)}}})[0]


def offered(style: str, body: dict) -> list[str]:
    """The tool names a request offers, in its API's shape."""
    tools = body.get("tools") or []
    if style == "google":
        found = [f for t in tools for f in t.get("functionDeclarations") or []]
    elif style == "openai_chat":
        found = [t.get("function") or {} for t in tools]
    else:      # anthropic, openai_responses (whose namespaces hold tools of their own)
        found = tools + [u for t in tools for u in t.get("tools") or []]
    return [t["name"] for t in found if isinstance(t.get("name"), str)]


def recorded(db: Path, sid: str, calls: int) -> list[tuple[str, str]]:
    """The session's requests as the proxy stored them (style, the CLI's body as sent)."""
    sql = "SELECT style, request_text FROM calls WHERE session_id = ? ORDER BY seq"
    assert until(lambda: len(query(db, sql, [sid])[1]) >= calls, 10)
    return query(db, sql, [sid])[1]


def run_session(proxy, tmp_path, task: str, name: str, ctx_extra: dict) -> tuple[Any, str]:
    """One session of `name` through a gateway node, with the task's tools put in its
    RunContext (the launcher's part); the session and the tail of its logs."""
    def launcher(harness: str, ctx: harnesses.RunContext) -> harnesses.Launch:
        return harnesses.launch(harness, dataclasses.replace(ctx, **ctx_extra))

    runtime = LocalRuntime(tmp_path / "sessions", keep=True)
    with Rollouts(proxy, runtime, workers=1, post_workers=1, launcher=launcher) as rollouts:
        groups = rollouts.run([{"task_id": task, "harness": name, "timeout": 150, "evaluator": "true",
                                "instruction": f"Use the probe tool on the word {WORD}, then say what it returned."}],
                              timeout=210)
    return groups[task]["sessions"][0], session_logs(runtime)


@pytest.mark.parametrize("name", MCP_CLIS)
def test_cli_offers_and_calls_the_mcp_tool(name, backend, skill, start_proxy, tmp_path):
    installed(name)
    proxy = start_proxy(backend.url)
    task = f"mcp-{name}"
    s, logs = run_session(proxy, tmp_path, task, name, {"mcp_servers": (probe_server(),), "skills": (skill,)})
    assert s["state"] == "done", f"{s}\n{logs}"
    calls = recorded(proxy.db, f"{task}~0", 2)
    # the agent's turns: Gemini's router call first offers no tools
    turns = [(text, offered(style, json.loads(text))) for style, text in calls if json.loads(text).get("tools")]
    first, offers = turns[0]
    if name == "qwen":    # deferred: named in the system prompt, its schema once tool_search ran
        assert TOOL in first and "tool_search" in offers and not any(n.endswith(TOOL) for n in offers), offers
        offers = turns[1][1]
    # in the first turn: the CLI waited for the (slow) server
    assert any(n.endswith(TOOL) for n in offers), f"{TOOL} not offered: {offers}\n{logs}"
    assert SKILL_DESCRIPTION in first, "the skill is not in the first turn"
    assert any(f"{PROBE_MARKER}:{WORD}" in text for text, _ in turns[1:]), \
        f"the MCP server's answer never reached the model\n{logs}"


def test_pi_offers_the_skill(backend, skill, start_proxy, tmp_path):
    """Pi has skills and no MCP: its skill is in the system prompt."""
    installed("pi")
    proxy = start_proxy(backend.url)
    s, logs = run_session(proxy, tmp_path, "skill-pi", "pi", {"skills": (skill,)})
    assert s["state"] == "done", f"{s}\n{logs}"
    calls = recorded(proxy.db, "skill-pi~0", 1)
    assert SKILL_DESCRIPTION in calls[0][1]


# ---- the task's JSON -------------------------------------------------------------------------

def test_parse_mcp_servers_reads_the_common_shape():
    servers = mcp.parse_mcp_servers({
        "files": {"command": "npx", "args": ["-y", "server-files", "/w"], "env": {"LOG": "1"}},
        "web": {"url": "https://example.com/mcp", "type": "http"}})
    assert servers == (mcp.McpServer("files", "npx", ("-y", "server-files", "/w"), (("LOG", "1"),)),
                       mcp.McpServer("web", url="https://example.com/mcp"))
    assert mcp.parse_mcp_servers(mcp.servers_json(servers)) == servers     # round trip
    assert mcp.parse_mcp_servers(None) == () == mcp.parse_mcp_servers({})
    assert hash(servers)       # frozen all the way down


@pytest.mark.parametrize("data, field", [
    ([], "mcp_servers must be an object"),
    ({"bad name": {"command": "x"}}, "mcp_servers: a name"),
    ({"x" * 65: {"command": "x"}}, "mcp_servers: a name"),
    ({"s": "npx"}, "mcp_servers.s must be an object"),
    ({"s": {}}, "mcp_servers.s: give either command (stdio) or url (HTTP), not neither"),
    ({"s": {"command": "x", "url": "http://h"}}, "not both"),
    ({"s": {"command": ""}}, "mcp_servers.s.command"),
    ({"s": {"command": "x", "args": "-y"}}, "mcp_servers.s.args"),
    ({"s": {"command": "x", "args": [1]}}, "mcp_servers.s.args"),
    ({"s": {"command": "x", "env": {"A": 1}}}, "mcp_servers.s.env"),
    ({"s": {"command": "x", "env": {"A=B": "1"}}}, "mcp_servers.s.env"),
    ({"s": {"command": "x", "cwd": "/"}}, "mcp_servers.s.cwd: unknown field"),
    ({"s": {"command": "x", "type": "http"}}, "mcp_servers.s.type"),
    ({"s": {"url": "ftp://h"}}, "mcp_servers.s.url"),
    ({"s": {"url": "http://h", "args": []}}, "mcp_servers.s.args: only a stdio server"),
])
def test_parse_mcp_servers_names_the_bad_field(data, field):
    with pytest.raises(ValueError) as e:
        mcp.parse_mcp_servers(data)
    assert field in str(e.value)


def test_parse_skills(skill, tmp_path):
    assert skill.name == "polar-greeting" and Path(skill.path, "SKILL.md").is_file()
    assert mcp.parse_skills(mcp.skills_json([skill])) == (skill,)
    empty = tmp_path / "empty"
    empty.mkdir()
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "SKILL.md").write_text("---\nname: bare\n---\nno description\n")
    for data, field in [("x", "skills must be an object"), ({"a b": str(empty)}, "skills: a name"),
                        ({"s": "rel/dir"}, "skills.s must be an absolute path"),
                        ({"s": str(tmp_path / "gone")}, "skills.s: "), ({"s": str(empty)}, "holding SKILL.md"),
                        ({"s": str(bare)}, "no 'description'")]:
        with pytest.raises(ValueError, match=field.replace("(", r"\(")):
            mcp.parse_skills(data)


# ---- the config files --------------------------------------------------------------------

def context(tmp_path: Path, **extra) -> harnesses.RunContext:
    return harnesses.RunContext(session_id="t~0", instruction="hi", proxy_port=1, ca_path="/ca.pem",
                                home=tmp_path / "home", workdir=tmp_path / "work", **extra)


STDIO = mcp.McpServer("probe", "python3", ("server.py",), (("K", "v \"q\""),))
HTTP = mcp.McpServer("web", url="http://127.0.0.1:9/mcp")


@pytest.mark.parametrize("name", list(harnesses.HARNESSES))
def test_no_servers_keeps_the_files_as_they_were(name, tmp_path):
    ctx = context(tmp_path)
    assert mcp.config_files(name, (), harnesses.HARNESSES[name].files(ctx)) == harnesses.HARNESSES[name].files(ctx)


def test_the_servers_go_where_each_cli_reads_them(tmp_path):
    ctx = context(tmp_path, mcp_servers=(STDIO, HTTP))
    files = {n: mcp.config_files(n, ctx.mcp_servers, harnesses.HARNESSES[n].files(ctx)) for n in MCP_CLIS}
    claude = json.loads(files["claude"][".claude.json"])["mcpServers"]
    assert claude == {"probe": {"type": "stdio", "command": "python3", "args": ["server.py"], "env": {"K": 'v "q"'}},
                      "web": {"type": "http", "url": "http://127.0.0.1:9/mcp"}}
    codex = tomllib.loads(files["codex"][".codex/config.toml"])
    wait = {"required": True, "startup_timeout_sec": mcp.STARTUP_S}     # the first turn waits for them
    assert codex["mcp_servers"] == {"probe": {"command": "python3", "args": ["server.py"], "env": {"K": 'v "q"'}, **wait},
                                    "web": {"url": "http://127.0.0.1:9/mcp", **wait}}
    assert codex["model_provider"] == "polar" and codex["features"] == {"plugins": False}   # its own kept
    for n in ("gemini", "qwen"):
        settings = json.loads(files[n][f".{n}/settings.json"])
        assert settings["mcpServers"] == {"probe": {"command": "python3", "args": ["server.py"], "env": {"K": 'v "q"'}},
                                          "web": {"httpUrl": "http://127.0.0.1:9/mcp"}}
        assert settings["telemetry"] == {"enabled": False}       # merged, not replaced
    with pytest.raises(ValueError, match="pi harness cannot load MCP"):
        mcp.config_files("pi", ctx.mcp_servers, {})


def test_launch_writes_servers_and_skills_and_allows_them(skill, tmp_path, monkeypatch):
    monkeypatch.setattr(harnesses, "executable", lambda name: Path("/bin/true"))
    ctx = context(tmp_path, mcp_servers=(STDIO,), skills=(skill,))
    launch = harnesses.launch("claude", ctx)
    assert launch.argv[launch.argv.index("--allowedTools") + 1] == "Bash,Read,Edit,Write,Glob,Grep,mcp__probe,Skill"
    assert "probe" in json.loads((ctx.home / ".claude.json").read_text())["mcpServers"]
    assert (ctx.home / ".claude/skills/polar-greeting/SKILL.md").read_text() == Path(skill.path, "SKILL.md").read_text()
    assert launch.env["MCP_CONNECT_TIMEOUT_MS"] == str(mcp.STARTUP_S * 1000)     # -p waits for the server
    for name, where in mcp.SKILL_DIRS.items():
        home = tmp_path / name
        harnesses.launch(name, dataclasses.replace(ctx, home=home, mcp_servers=()))
        assert (home / where / "polar-greeting" / "SKILL.md").is_file()
    plain = harnesses.launch("claude", context(tmp_path / "plain"))      # no tools: as before
    assert plain.argv[-1] == "Bash,Read,Edit,Write,Glob,Grep" and "MCP_CONNECT_TIMEOUT_MS" not in plain.env
    assert not (tmp_path / "plain/home/.claude.json").exists()
    with pytest.raises(ValueError, match="command harness cannot load skills"):
        harnesses.launch("command", dataclasses.replace(ctx, command="true", mcp_servers=()))
