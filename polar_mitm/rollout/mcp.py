"""A task's tools for the harness: MCP servers and skills, written into each CLI's own config.

A task may give its harness MCP servers (stdio: a command the CLI starts inside the session's
sandbox; HTTP: a URL) and skills (a directory holding SKILL.md). The CLI loads them as it
would on a user's machine, and offers them to the model: no harness code changes, only files
under the session's HOME (never the workspace, whose diff is graded).

Where each CLI reads them (the pinned versions of harnesses.py):

  CLI     MCP servers                                   skills (NAME/SKILL.md under)
  claude  ~/.claude.json "mcpServers" (user scope)      ~/.claude/skills/
  codex   ~/.codex/config.toml [mcp_servers.NAME]       ~/.agents/skills/
  gemini  ~/.gemini/settings.json "mcpServers"          ~/.gemini/skills/
  qwen    ~/.qwen/settings.json "mcpServers"            ~/.qwen/skills/
  pi      none ("No MCP.", its README)                  ~/.pi/agent/skills/

The task's JSON shape is the one these CLIs share:
  {"NAME": {"command": "...", "args": [...], "env": {...}}}  or  {"NAME": {"url": "http://..."}}
for MCP servers, and {"NAME": "/path/to/dir"} for skills.

How each offers the tools (tests/rollout/test_mcp_tools.py checks it in the recorded requests):
Claude Code as mcp__NAME__TOOL (allowed in -p by --allowedTools mcp__NAME, harnesses.py),
Codex as TOOL in a namespace mcp__NAME, Gemini CLI as mcp_NAME_TOOL, Qwen Code as
mcp__NAME__TOOL but deferred: named in the system prompt, its schema in `tools` once the model
calls tool_search (the CLI's own way, kept). Skills are listed in the system prompt (Claude
Code: the Skill tool's list), their SKILL.md read on demand.

The first turn waits for the servers: Claude Code is given a longer connect wait (env), Codex
marks them required (a server that cannot start fails the run); Gemini CLI and Qwen Code wait
anyway. A stdio server runs inside the session's sandbox, so its command must be there (the
node's Python and whatever POLAR_SANDBOX_EXPOSE shows, bwrap.py). An HTTP server is written
into the config as each CLI reads it, but an isolated sandbox reaches nothing but the proxy,
which relays nothing (and NO_PROXY is empty): as things are, no session reaches one (untested).

Nothing here imports the rest of polar_mitm: the task spec and the harness registry both
read it.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SERVER_KEYS = frozenset({"type", "command", "args", "env", "url"})

# HOME-relative: the file each CLI reads its MCP servers from (a CLI missing here has no MCP),
# and the directory it finds skills in (one NAME/SKILL.md folder per skill).
MCP_FILES = {"claude": ".claude.json", "codex": ".codex/config.toml",
             "gemini": ".gemini/settings.json", "qwen": ".qwen/settings.json"}
SKILL_DIRS = {"claude": ".claude/skills", "codex": ".agents/skills", "gemini": ".gemini/skills",
              "qwen": ".qwen/skills", "pi": ".pi/agent/skills"}
# How long a CLI waits for a server to start before its first turn. On a loaded node a
# Python server's imports alone take seconds; Claude Code's own wait is 5 s, Codex's 10 s.
STARTUP_S = 60


@dataclass(frozen=True)
class McpServer:
    """One MCP server: stdio (command, args, env) or streamable HTTP (url)."""
    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()     # (name, value) pairs: frozen, so hashable
    url: str | None = None

    @property
    def stdio(self) -> bool:
        return self.command is not None

    def to_json(self) -> dict[str, Any]:
        """The task's shape, as parse_mcp_servers reads it."""
        if not self.stdio:
            return {"url": self.url}
        out: dict[str, Any] = {"command": self.command}
        if self.args:
            out["args"] = list(self.args)
        if self.env:
            out["env"] = dict(self.env)
        return out


@dataclass(frozen=True)
class Skill:
    """One skill: a directory with SKILL.md, copied as NAME/ into the CLI's skills directory."""
    name: str
    path: str


# ---- the task's JSON -----------------------------------------------------------------------

def _name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}: a name must be 1 to 64 of A-Z a-z 0-9 _ -, not {name!r}")
    return name


def _server(name: str, spec: Any) -> McpServer:
    at = f"mcp_servers.{name}"
    if not isinstance(spec, dict):
        raise ValueError(f"{at} must be an object with a command or a url")
    unknown = sorted(set(spec) - SERVER_KEYS)
    if unknown:
        raise ValueError(f"{at}.{unknown[0]}: unknown field (one of {', '.join(sorted(SERVER_KEYS))})")
    command, url, kind = spec.get("command"), spec.get("url"), spec.get("type")
    if (command is None) == (url is None):
        raise ValueError(f"{at}: give either command (stdio) or url (HTTP), not {'both' if command else 'neither'}")
    if kind is not None and kind != ("stdio" if command is not None else "http"):
        raise ValueError(f"{at}.type must be {'stdio' if command is not None else 'http'} "
                         f"with {'a command' if command is not None else 'a url'}, not {kind!r}")
    if url is not None:
        if not isinstance(url, str) or not re.match(r"https?://[^\s/]+", url):
            raise ValueError(f"{at}.url must be an http:// or https:// URL, not {url!r}")
        for key in ("args", "env"):
            if key in spec:
                raise ValueError(f"{at}.{key}: only a stdio server (command) takes {key}")
        return McpServer(name, url=url)
    if not isinstance(command, str) or not command.strip():
        raise ValueError(f"{at}.command must be a non-empty string, not {command!r}")
    args = spec.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"{at}.args must be a list of strings")
    env = spec.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise ValueError(f"{at}.env must be an object of strings")
    bad = [k for k in env if not ENV_NAME.fullmatch(k)]
    if bad:
        raise ValueError(f"{at}.env: {bad[0]!r} is not a variable name")
    return McpServer(name, command=command, args=tuple(args), env=tuple(env.items()))


def parse_mcp_servers(data: Any) -> tuple[McpServer, ...]:
    """The task's mcp_servers ({"NAME": {"command": ..., "args": [...], "env": {...}}} or
    {"NAME": {"url": ...}}); ValueError naming the field that is wrong. None: no servers."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise ValueError("mcp_servers must be an object: {NAME: {command, args, env} or {url}}")
    return tuple(_server(_name(name, "mcp_servers"), spec) for name, spec in data.items())


def _frontmatter(text: str) -> dict[str, str]:
    """The top-level keys of SKILL.md's YAML frontmatter (between --- lines), read plainly."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    out: dict[str, str] = {}
    for line in lines[1:]:
        if line.strip() == "---":
            return out
        key, sep, value = line.partition(":")
        if sep and key and not key[0].isspace():
            out[key.strip()] = value.strip()
    return {}   # never closed: no frontmatter


def parse_skills(data: Any) -> tuple[Skill, ...]:
    """The task's skills ({"NAME": "/path/to/dir"}): each an absolute directory holding a
    SKILL.md whose frontmatter has a name and a description (every CLI skips a skill without
    them, silently). The directories are read again where the session runs."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise ValueError("skills must be an object: {NAME: /path/to/skill/dir}")
    out = []
    for name, path in data.items():
        at = f"skills.{_name(name, 'skills')}"
        if not isinstance(path, str) or not Path(path).is_absolute():
            raise ValueError(f"{at} must be an absolute path to a directory, not {path!r}")
        md = Path(path) / "SKILL.md"
        if not md.is_file():
            raise ValueError(f"{at}: {path} is not a directory holding SKILL.md")
        meta = _frontmatter(md.read_text(errors="replace"))
        missing = [k for k in ("name", "description") if not meta.get(k)]
        if missing:
            raise ValueError(f"{at}: {md} has no {missing[0]!r} in its frontmatter (--- name: ... description: ... ---)")
        out.append(Skill(name, path))
    return tuple(out)


def servers_json(servers: Iterable[McpServer]) -> dict[str, Any]:
    """parse_mcp_servers' input back: how a task stores them."""
    return {s.name: s.to_json() for s in servers}


def skills_json(skills: Iterable[Skill]) -> dict[str, str]:
    return {s.name: s.path for s in skills}


# ---- each CLI's configuration ------------------------------------------------------------

def _claude(servers: Iterable[McpServer]) -> dict[str, Any]:
    """~/.claude.json: user-scope servers load with no approval (a project's .mcp.json asks)."""
    return {s.name: {"type": "stdio", "command": s.command, "args": list(s.args), "env": dict(s.env)}
            if s.stdio else {"type": "http", "url": s.url} for s in servers}


def _gemini(servers: Iterable[McpServer]) -> dict[str, Any]:
    """Gemini CLI's and Qwen Code's settings.json: httpUrl is streamable HTTP (url alone is
    SSE first, then HTTP)."""
    return {s.name: {"command": s.command, "args": list(s.args), "env": dict(s.env)}
            if s.stdio else {"httpUrl": s.url} for s in servers}


def _toml(value: str) -> str:
    return json.dumps(value)    # a JSON string is a TOML basic string (same escapes)


def _codex(servers: Iterable[McpServer]) -> str:
    """config.toml tables, appended after the harness's own."""
    out = []
    for s in servers:
        # required: the first turn waits for the server (optional ones get a short grace,
        # then the turn goes on without their tools), and a server that cannot start fails
        # the run instead of leaving it without its tools
        out += [f"\n[mcp_servers.{s.name}]", "required = true", f"startup_timeout_sec = {STARTUP_S}"]
        if s.stdio:
            out.append(f"command = {_toml(s.command or '')}")
            out.append(f"args = [{', '.join(map(_toml, s.args))}]")
            if s.env:
                out.append("env = { " + ", ".join(f"{_toml(k)} = {_toml(v)}" for k, v in s.env) + " }")
        else:
            out.append(f"url = {_toml(s.url or '')}")
    return "\n".join(out) + "\n"


def env(harness: str, servers: Iterable[McpServer]) -> dict[str, str]:
    """Variables the harness's CLI needs for the servers: Claude Code's -p goes on without a
    server not connected after MCP_CONNECT_TIMEOUT_MS (5 s), its tools missing from the turn."""
    if harness != "claude" or not tuple(servers):
        return {}
    wait = str(STARTUP_S * 1000)
    return {"MCP_CONNECT_TIMEOUT_MS": wait, "MCP_TIMEOUT": wait, "MCP_CONNECTION_NONBLOCKING": "0"}


def _merge_json(text: str | None, servers: dict[str, Any]) -> str:
    data = json.loads(text) if text else {}
    data["mcpServers"] = {**data.get("mcpServers", {}), **servers}
    return json.dumps(data)


def config_files(harness: str, servers: Iterable[McpServer], files: Mapping[str, str]) -> dict[str, str]:
    """The harness's config files (HOME-relative path: text) with the MCP servers added to
    the one its CLI reads them from (merged: every other key stays). No servers: the files
    as they are. ValueError for a harness without MCP."""
    servers = tuple(servers)
    out = dict(files)
    if not servers:
        return out
    if harness not in MCP_FILES:
        raise ValueError(f"the {harness} harness cannot load MCP servers (these can: {', '.join(MCP_FILES)})")
    rel = MCP_FILES[harness]
    if harness == "codex":
        out[rel] = out.get(rel, "") + _codex(servers)
    else:
        out[rel] = _merge_json(out.get(rel), _claude(servers) if harness == "claude" else _gemini(servers))
    return out


def install_skills(harness: str, skills: Iterable[Skill], home: Path) -> list[Path]:
    """Copy each skill's directory to HOME/<the CLI's skills dir>/NAME; the copies' paths.
    ValueError for a harness without skills, or a skill whose SKILL.md is gone."""
    skills = tuple(skills)
    if not skills:
        return []
    if harness not in SKILL_DIRS:
        raise ValueError(f"the {harness} harness cannot load skills (these can: {', '.join(SKILL_DIRS)})")
    out = []
    for s in skills:
        if not (Path(s.path) / "SKILL.md").is_file():
            raise ValueError(f"skills.{s.name}: {s.path} holds no SKILL.md here")
        target = home / SKILL_DIRS[harness] / s.name
        # symlinks copied as links: nothing outside the skill is read through them
        shutil.copytree(s.path, target, symlinks=True, dirs_exist_ok=True)
        out.append(target)
    return out
