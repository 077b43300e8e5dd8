"""Harness runners: how each CLI is installed, configured offline and started through the proxy.

Every runner works in regular proxy mode: the harness keeps its real provider host and
reaches it through HTTPS_PROXY, whose user name (TASK~i) names the session; the mitmproxy CA
comes in through the variables each runtime reads. Nothing here changes a harness's code:
only its HOME (config files) and its environment.

HARNESSES is the registry: one entry per harness with everything about it (its npm package,
pinned version and lockfile folder, its command line, environment and config files, the API
style it speaks). The task spec, the HTTP API, the CLIs and the installs read it, so a new
harness is one entry here (and its lockfile folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import session_auth
from ..models import cache_dir
from . import mcp


@dataclass(frozen=True)
class Package:
    npm: str
    version: str
    bin: str


@dataclass(frozen=True)
class RunContext:
    session_id: str
    instruction: str
    proxy_port: int
    ca_path: str
    home: Path
    workdir: Path
    command: str | None = None     # the `command` harness's shell line
    credential: str | None = None  # the session's credential (session_auth.py), where the gateway checks them
    mcp_servers: tuple[mcp.McpServer, ...] = ()   # the task's tools, in the CLI's own config (mcp.py)
    skills: tuple[mcp.Skill, ...] = ()


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class Harness:
    """One harness: what to install, how to start it for a session, what it speaks."""
    name: str
    api_style: str | None                     # the provider API it calls (adapters' STYLE); None: any
    package: Package | None                   # the npm CLI at its pinned version; None: nothing to install
    argv: Callable[[str, RunContext], list[str]]          # (its executable, the session)
    env: Callable[[RunContext], dict[str, str]]           # on top of base_env
    files: Callable[[RunContext], dict[str, str]] = field(default=lambda ctx: {})   # HOME-relative path: text

    @property
    def lock_dir(self) -> Path | None:
        """Its lockfile folder (package.json, package-lock.json), shipped with the package."""
        return LOCKS / self.name if self.package else None


class HarnessMissing(RuntimeError):
    """The CLI is not installed; the message says how to install it."""


def harness_root() -> Path:
    return Path(os.environ.get("POLAR_HARNESS_DIR") or cache_dir() / "harnesses")


# Each CLI's whole dependency tree, resolved once and shipped (package-lock.json), so two
# installs of one pinned version are the same packages (`npm ci`), not whatever npm resolves
# that day. Regenerate with `npm install --package-lock-only` in the folder after a bump.
LOCKS = Path(__file__).with_name("harness_locks")


def lock_id(name: str) -> str:
    return hashlib.sha256((LOCKS / name / "package-lock.json").read_bytes()).hexdigest()[:10]


def install_dir(name: str) -> Path:
    pkg = PACKAGES[name]
    return harness_root() / f"{name}-{pkg.version}-{lock_id(name)}"


def install(name: str, *, quiet: bool = True) -> Path:
    """npm-install a CLI at its pinned version, from its lockfile, into the cache; returns
    its executable."""
    if name not in PACKAGES:
        raise ValueError(f"unknown harness {name!r}; one of {', '.join(PACKAGES)}")
    pkg, target = PACKAGES[name], install_dir(name)
    exe = target / "node_modules" / ".bin" / pkg.bin
    if exe.exists():
        return exe
    npm = shutil.which("npm")
    if not npm:
        raise HarnessMissing("npm is not installed (Node.js 20 or newer is needed for the harness CLIs)")
    target.mkdir(parents=True, exist_ok=True)
    for f in ("package.json", "package-lock.json"):
        shutil.copyfile(LOCKS / name / f, target / f)
    flags = ["--prefix", str(target), "--no-audit", "--no-fund", "--loglevel=error"]
    done = subprocess.run([npm, "ci", *flags], capture_output=True, text=True, timeout=900)
    if done.returncode != 0 and "in sync" in (done.stderr or ""):
        # An optional platform package the registry lacks (qwen's clipboard builds) cannot be
        # locked, and `npm ci` refuses the lock for it; `npm install` keeps to the lock's
        # versions for everything it holds.
        done = subprocess.run([npm, "install", "--no-save", *flags], capture_output=quiet, text=True, timeout=900)
    if done.returncode != 0 or not exe.exists():
        raise HarnessMissing(f"npm ci of {pkg.npm}@{pkg.version} (its lockfile) failed (exit {done.returncode}): "
                             f"{(done.stderr or '')[-2000:]}")
    return exe


def executable(name: str) -> Path:
    """The pinned install (from its lockfile). A CLI of the same name on PATH is never used:
    its version, and so what the policy is trained against, would be anyone's guess."""
    pkg = PACKAGES[name]
    exe = install_dir(name) / "node_modules" / ".bin" / pkg.bin
    if exe.exists():
        return exe
    on_path = shutil.which(pkg.bin)
    hint = f" (the {pkg.bin} on PATH, {on_path}, is not used: not the pinned {pkg.version})" if on_path else ""
    raise HarnessMissing(f"{name} {pkg.version} is not installed: run `polar-mitm harness install {name}`{hint}")


# The variables through which a harness's runtime gets the proxy's CA (the sandbox gives it
# the certificate file they name, bwrap.py).
CA_VARS = ("NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE", "CODEX_CA_CERTIFICATE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def proxy_env(ctx: RunContext) -> dict[str, str]:
    # The name percent-encoded (a run id's "@" would end the userinfo for curl and undici),
    # the credential as the password.
    proxy = session_auth.proxy_url(ctx.session_id, ctx.proxy_port, ctx.credential)
    return {"HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy, "http_proxy": proxy,
            "ALL_PROXY": proxy, "NO_PROXY": "", "no_proxy": "", **{v: ctx.ca_path for v in CA_VARS}}


def base_env(ctx: RunContext) -> dict[str, str]:
    """A clean environment: nothing of the node's own (its keys and tokens) leaks in."""
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    tmp = ctx.home.parent / "tmp"
    return {"PATH": path, "HOME": str(ctx.home), "USER": os.environ.get("USER", "polar"),
            "LANG": os.environ.get("LANG", "C.UTF-8"), "TERM": "dumb", "NO_COLOR": "1",
            "CI": "1", "TMPDIR": str(tmp), "POLAR_SESSION": ctx.session_id,
            **proxy_env(ctx)}


def session_key(ctx: RunContext) -> str:
    """The API key a harness sends: it names the session too, with its credential (the proxy
    user wins)."""
    return session_auth.api_key(ctx.session_id, ctx.credential)


_CODEX_CONFIG = """\
model = "gpt-5.1-codex"
model_provider = "polar"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

# The real host, reached through the proxy. A custom provider does not try the WebSocket
# transport first (the built-in one loses ~6 s per run falling back from it).
[model_providers.polar]
name = "polar"
base_url = "https://api.openai.com/v1"
env_key = "POLAR_API_KEY"
wire_api = "responses"

[analytics]
enabled = false

[features]
plugins = false
"""


def _settings(auth: str) -> str:
    """Gemini CLI's and Qwen Code's settings.json: no telemetry, no updates, this auth."""
    return json.dumps({"privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
                       "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
                       "security": {"auth": {"selectedType": auth}}})


def _pi_models(ctx: RunContext) -> str:
    return json.dumps({"providers": {"polar": {
        "baseUrl": "https://api.openai.com/v1", "api": "openai-completions",
        "apiKey": session_key(ctx),
        "models": [{"id": "polar-policy", "reasoning": False,
                    "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False}}]}}})


def _claude_tools(ctx: RunContext) -> str:
    """Claude Code's --allowedTools: -p refuses any other tool. The task's MCP servers (each
    one's tools, `mcp__NAME`) and skills (the Skill tool) are allowed along with its own."""
    tools = ["Bash", "Read", "Edit", "Write", "Glob", "Grep"] + [f"mcp__{s.name}" for s in ctx.mcp_servers]
    return ",".join(tools + (["Skill"] if ctx.skills else []))


def _command_argv(exe: str, ctx: RunContext) -> list[str]:
    if not ctx.command:
        raise ValueError("the command harness needs a command")
    return ["/bin/sh", "-c", ctx.command]


_REGISTRY = [
    # Pinned versions: the ones measured through this proxy (../shared/reference/harnesses.md).
    Harness("claude", "anthropic", Package("@anthropic-ai/claude-code", "2.1.197", "claude"),
            argv=lambda exe, ctx: [exe, "-p", ctx.instruction, "--allowedTools", _claude_tools(ctx)],
            env=lambda ctx: {"ANTHROPIC_API_KEY": session_key(ctx),
                             "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                             "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                             # against a first-party host Claude defers most tools behind
                             # ToolSearch, whose tool_reference blocks only Anthropic's API expands
                             "ENABLE_TOOL_SEARCH": "false"}),
    Harness("codex", "openai_responses", Package("@openai/codex", "0.171.0", "codex"),
            argv=lambda exe, ctx: [exe, "exec", "--skip-git-repo-check", ctx.instruction],
            env=lambda ctx: {"CODEX_HOME": str(ctx.home / ".codex"), "POLAR_API_KEY": session_key(ctx)},
            files=lambda ctx: {".codex/config.toml": _CODEX_CONFIG}),
    Harness("gemini", "google", Package("@google/gemini-cli", "0.61.0", "gemini"),
            argv=lambda exe, ctx: [exe, "-y", "-p", ctx.instruction],
            env=lambda ctx: {"GEMINI_API_KEY": session_key(ctx), "GEMINI_CLI_TRUST_WORKSPACE": "true"},
            files=lambda ctx: {".gemini/settings.json": _settings("gemini-api-key")}),
    Harness("qwen", "openai_chat", Package("@qwen-code/qwen-code", "0.15.10", "qwen"),
            argv=lambda exe, ctx: [exe, "-y", "-p", ctx.instruction],
            env=lambda ctx: {"OPENAI_API_KEY": session_key(ctx), "OPENAI_MODEL": "qwen3-coder-plus"},
            files=lambda ctx: {".qwen/settings.json": _settings("openai")}),
    Harness("pi", "openai_chat", Package("@mariozechner/pi-coding-agent", "0.73.1", "pi"),
            argv=lambda exe, ctx: [exe, "--no-session", "--provider", "polar", "--model", "polar-policy",
                                   "-p", ctx.instruction],
            env=lambda ctx: {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"},
            files=lambda ctx: {".pi/agent/models.json": _pi_models(ctx),
                               ".pi/agent/settings.json": json.dumps({"enableInstallTelemetry": False})}),
    # A shell line of the task's own (its `command`), run in the workspace; the instruction in
    # $POLAR_INSTRUCTION.
    Harness("command", None, None, argv=_command_argv,
            env=lambda ctx: {"POLAR_INSTRUCTION": ctx.instruction}),
]
HARNESSES: dict[str, Harness] = {h.name: h for h in _REGISTRY}
DEFAULT = "pi"
PACKAGES: dict[str, Package] = {h.name: h.package for h in _REGISTRY if h.package}
"""The harnesses installed from npm, and their pinned packages."""


def launch(name: str, ctx: RunContext) -> Launch:
    """argv and environment for one session; config files are written into ctx.home, with
    the task's MCP servers merged into the CLI's own and its skills copied in (ValueError
    where the CLI has no place for them)."""
    h = HARNESSES[name]
    argv = h.argv(str(executable(name)) if h.package else "", ctx)
    for rel, text in mcp.config_files(name, ctx.mcp_servers, h.files(ctx)).items():
        path = ctx.home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    mcp.install_skills(name, ctx.skills, ctx.home)
    return Launch(argv, {**base_env(ctx), **h.env(ctx), **mcp.env(name, ctx.mcp_servers)})
