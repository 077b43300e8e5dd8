"""Harness runners: how each CLI is installed, configured offline and started through the proxy.

Every runner works in regular proxy mode: the harness keeps its real provider host and
reaches it through HTTPS_PROXY, whose user name (TASK~i) names the session; the mitmproxy CA
comes in through the variables each runtime reads. Nothing here changes a harness's code:
only its HOME (config files) and its environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..models import cache_dir


@dataclass(frozen=True)
class Package:
    npm: str
    version: str
    bin: str


# Pinned versions: the ones measured through this proxy (../shared/reference/harnesses.md).
PACKAGES: dict[str, Package] = {
    "claude": Package("@anthropic-ai/claude-code", "2.1.197", "claude"),
    "codex": Package("@openai/codex", "0.171.0", "codex"),
    "gemini": Package("@google/gemini-cli", "0.61.0", "gemini"),
    "qwen": Package("@qwen-code/qwen-code", "0.15.10", "qwen"),
    "pi": Package("@mariozechner/pi-coding-agent", "0.73.1", "pi"),
}


@dataclass(frozen=True)
class RunContext:
    session_id: str
    instruction: str
    proxy_port: int
    ca_path: str
    home: Path
    workdir: Path
    command: str | None = None     # the `command` harness's shell line


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]


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


def proxy_env(ctx: RunContext) -> dict[str, str]:
    proxy = f"http://{ctx.session_id}:x@127.0.0.1:{ctx.proxy_port}"
    return {"HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy, "http_proxy": proxy,
            "ALL_PROXY": proxy, "NO_PROXY": "", "no_proxy": "",
            "NODE_EXTRA_CA_CERTS": ctx.ca_path, "SSL_CERT_FILE": ctx.ca_path,
            "CODEX_CA_CERTIFICATE": ctx.ca_path, "REQUESTS_CA_BUNDLE": ctx.ca_path}


def base_env(ctx: RunContext) -> dict[str, str]:
    """A clean environment: nothing of the node's own (its keys and tokens) leaks in."""
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    tmp = ctx.home.parent / "tmp"
    return {"PATH": path, "HOME": str(ctx.home), "USER": os.environ.get("USER", "polar"),
            "LANG": os.environ.get("LANG", "C.UTF-8"), "TERM": "dumb", "NO_COLOR": "1",
            "CI": "1", "TMPDIR": str(tmp), "POLAR_SESSION": ctx.session_id,
            **proxy_env(ctx)}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _claude(exe: Path, ctx: RunContext) -> Launch:
    env = {"ANTHROPIC_API_KEY": f"polar-{ctx.session_id}",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           # against a first-party host Claude defers most tools behind ToolSearch, whose
           # tool_reference blocks only Anthropic's API expands
           "ENABLE_TOOL_SEARCH": "false"}
    return Launch([str(exe), "-p", ctx.instruction, "--allowedTools", "Bash,Read,Edit,Write,Glob,Grep"], env)


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


def _codex(exe: Path, ctx: RunContext) -> Launch:
    codex_home = ctx.home / ".codex"
    _write(codex_home / "config.toml", _CODEX_CONFIG)
    return Launch([str(exe), "exec", "--skip-git-repo-check", ctx.instruction],
                  {"CODEX_HOME": str(codex_home), "POLAR_API_KEY": f"polar-{ctx.session_id}"})


def _settings(auth: str) -> str:
    return json.dumps({"privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
                       "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
                       "security": {"auth": {"selectedType": auth}}})


def _gemini(exe: Path, ctx: RunContext) -> Launch:
    _write(ctx.home / ".gemini" / "settings.json", _settings("gemini-api-key"))
    return Launch([str(exe), "-y", "-p", ctx.instruction],
                  {"GEMINI_API_KEY": f"polar-{ctx.session_id}", "GEMINI_CLI_TRUST_WORKSPACE": "true"})


def _qwen(exe: Path, ctx: RunContext) -> Launch:
    _write(ctx.home / ".qwen" / "settings.json", _settings("openai"))
    return Launch([str(exe), "-y", "-p", ctx.instruction],
                  {"OPENAI_API_KEY": f"polar-{ctx.session_id}", "OPENAI_MODEL": "qwen3-coder-plus"})


def _pi(exe: Path, ctx: RunContext) -> Launch:
    models = {"providers": {"polar": {
        "baseUrl": "https://api.openai.com/v1", "api": "openai-completions",
        "apiKey": f"polar-{ctx.session_id}",
        "models": [{"id": "polar-policy", "reasoning": False,
                    "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False}}]}}}
    _write(ctx.home / ".pi" / "agent" / "models.json", json.dumps(models))
    _write(ctx.home / ".pi" / "agent" / "settings.json", json.dumps({"enableInstallTelemetry": False}))
    return Launch([str(exe), "--no-session", "--provider", "polar", "--model", "polar-policy",
                   "-p", ctx.instruction],
                  {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"})


_RUNNERS = {"claude": _claude, "codex": _codex, "gemini": _gemini, "qwen": _qwen, "pi": _pi}


def launch(name: str, ctx: RunContext) -> Launch:
    """argv and environment for one session; config files are written into ctx.home."""
    env = base_env(ctx)
    if name == "command":
        if not ctx.command:
            raise ValueError("the command harness needs a command")
        env["POLAR_INSTRUCTION"] = ctx.instruction
        return Launch(["/bin/sh", "-c", ctx.command], env)
    made = _RUNNERS[name](executable(name), ctx)
    return Launch(made.argv, {**env, **made.env})
