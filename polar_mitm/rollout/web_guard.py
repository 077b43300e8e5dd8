"""What guards the operator's web surfaces (the rollout server's API, the dashboard) from
whoever else can reach their port: a plain ASGI middleware in front of the app.

- Host names (DNS rebinding). A page on evil.example whose name the attacker points at
  127.0.0.1 is same-origin with the server in the browser's eyes, so it could read every
  answer. Only the server's own names pass: loopback (127.0.0.1, localhost, [::1]), the
  address it listens on (on a wildcard address, any IP address: no one rebinds those), this
  machine's host name beyond loopback, and those added (allowed_hosts, `--allowed-host`); a
  Host with a port must name the port it listens on. Anything else gets 421 (no Host: 400).
- No state change without a JSON content type. A cross-site form or a no-cors fetch may POST
  (text/plain, a form, or no body at all) without the browser asking first; a request that
  says application/json needs the browser's preflight, which these servers never grant.
- A bearer token, once one is set (always, once a server listens beyond loopback): every
  request carries `Authorization: Bearer TOKEN`, compared in constant time (reads too: a
  group's outputs and rewards are what a session must not see). On loopback none is needed,
  and one that is sent is accepted as it is.

Where the token comes from: load_token (a file, made 0600 with a fresh token where there is
none yet)."""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
TOKEN_ENV = "POLAR_ROLLOUT_TOKEN_FILE"   # a client's token file when none is given

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class TokenError(ValueError):
    """A token file that cannot be used (its message names the file and why)."""


def is_loopback(host: str) -> bool:
    """host (an address or a name) is this machine's loopback only."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None]:
    """('name', port or None) of a Host header or an --allowed-host entry; ValueError if malformed."""
    value = value.strip().lower()
    if value.startswith("["):                       # [::1]:8090
        end = value.find("]")
        if end < 0:
            raise ValueError(value)
        name, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(value)
        port_text = rest[1:] if rest else ""
    elif value.count(":") > 1:                      # a bare IPv6 address
        name, port_text = value, ""
    else:
        name, _, port_text = value.partition(":")
    if not name or (port_text and not port_text.isdigit()):
        raise ValueError(value)
    return name.rstrip("."), int(port_text) if port_text else None


@dataclass(frozen=True)
class GuardConfig:
    """allowed_hosts: names (or name:port) accepted besides loopback and the listening
    address; "*" turns the Host check off. token: None = no token asked for (loopback only)."""
    allowed_hosts: tuple[str, ...] = ()
    token: str | None = None


class WebGuard:
    """The middleware: WebGuard(app, listen_host, config). The listening port is read from
    each request's scope (the socket it came in on), so port 0 needs no second step."""

    def __init__(self, app: ASGIApp, listen_host: str, config: GuardConfig | None = None,
                 token_beyond_loopback: bool = True):
        self.app = app
        self.config = config or GuardConfig()
        if token_beyond_loopback and not is_loopback(listen_host) and not self.config.token:
            raise ValueError(f"listening on {listen_host} (beyond loopback) needs a token")
        self.any_host = "*" in self.config.allowed_hosts
        names: dict[str, set[int | None]] = {}
        for entry in (*LOOPBACK_NAMES, *_own_names(listen_host), *self.config.allowed_hosts):
            if entry == "*":
                continue
            try:
                name, port = split_host(entry)
            except ValueError:
                raise ValueError(f"allowed host {entry!r} is not a host name or HOST:PORT") from None
            names.setdefault(name, set()).add(port)
        self.names = names
        # Listening on every address: any of them may be how a client reaches it, and an IP
        # address as the Host is never a rebinding (that needs the attacker's own name).
        self.any_address = listen_host.strip("[]") in WILDCARDS
        self.token = self.config.token.encode() if self.config.token else None

    def allowed_names(self) -> list[str]:
        return sorted(f"[{n}]" if ":" in n else n for n in self.names)

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.check(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message = refusal
        body = json.dumps({"error": {"message": message}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"cache-control", b"no-store")]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="polar-mitm"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def check(self, scope: dict) -> tuple[int, str] | None:
        """(status, message) of a request that must not reach the app; None: it may."""
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers") or ():
            headers.setdefault(k.lower(), v)
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.any_host:
            if not host:
                return 400, "a Host header is required"
            server = scope.get("server") or (None, None)
            if not self._host_ok(host, server[1]):
                return 421, (f"Host {host[:200]!r} is not a name of this server (it answers to "
                             f"{', '.join(self.allowed_names())} on port {server[1]}); add a name with "
                             f"--allowed-host (a guard against DNS rebinding)")
        method = scope.get("method", "GET").upper()
        if method in MUTATING:
            ctype = headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()
            if ctype != "application/json" and not ctype.endswith("+json"):
                return 415, (f"{method} needs content-type: application/json (got {ctype or 'none'}): "
                             f"no state changes from a cross-site form")
        if self.token is not None:
            return self._token_refusal(headers.get(b"authorization"))
        return None          # no token set (loopback only): one sent is accepted as it is

    def _host_ok(self, host: str, port: int | None) -> bool:
        try:
            name, given = split_host(host)
        except ValueError:
            return False
        ports = self.names.get(name)
        if ports is None:
            if not (self.any_address and _is_address(name)):
                return False
            ports = {None}
        return given is None or given == port or given in ports

    def _token_refusal(self, header: bytes | None) -> tuple[int, str] | None:
        assert self.token is not None
        scheme, _, given = (header or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return 401, "this server needs Authorization: Bearer TOKEN (its token file: --token-file)"
        if not hmac.compare_digest(given.strip(), self.token):
            return 401, "the bearer token is not this server's"
        return None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _own_names(listen_host: str) -> list[str]:
    """The names a client of a server listening here uses: the address itself (unless a
    wildcard), and beyond loopback this machine's own host names (no attacker names them)."""
    out: list[str] = []
    host = listen_host.strip("[]")
    if host:
        out.append(host)
    if not is_loopback(listen_host):
        for name in {socket.gethostname(), socket.getfqdn()}:
            if name and name.lower() not in ("localhost",):
                out.append(name)
    return out


def auth_headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def load_token(path: str | os.PathLike, create: bool = False) -> str:
    """The token in the file at path. create: where there is no file, a fresh token is
    written there first (mode 0600, never over an existing file). TokenError when the file is
    missing (and not to be made), empty, or readable by others."""
    p = Path(path)
    if create:
        fresh = secrets.token_urlsafe(32)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        except OSError as e:
            raise TokenError(f"cannot write the token file {p}: {e.strerror or e}") from None
        else:
            with os.fdopen(fd, "w") as f:
                f.write(fresh + "\n")
            return fresh
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise TokenError(f"no token file at {p} (the rollout server writes one: see docs/rollouts.md)") from None
    except OSError as e:
        raise TokenError(f"cannot read the token file {p}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_mode & 0o077:
            raise TokenError(f"the token file {p} is readable by others (mode {st.st_mode & 0o777:o}): "
                             f"chmod 600 it")
        token = f.read(4096).decode(errors="replace").strip()
    if not token or any(c.isspace() for c in token):
        raise TokenError(f"the token file {p} holds no token (one line, no spaces)")
    return token


def client_token(token: str | None = None, token_file: str | os.PathLike | None = None) -> str | None:
    """A client's token: the one given, else the file's (given, else $POLAR_ROLLOUT_TOKEN_FILE's),
    else None (a server on loopback without one)."""
    if token:
        return token
    path = token_file or os.environ.get(TOKEN_ENV)
    return load_token(path) if path else None


def guarded(app: Any, listen_host: str, allowed_hosts: Iterable[str] = (), token: str | None = None,
            token_beyond_loopback: bool = True) -> WebGuard:
    """app behind the guard (ValueError for a bad --allowed-host, or, token_beyond_loopback,
    listening beyond loopback without a token)."""
    return WebGuard(app, listen_host, GuardConfig(tuple(allowed_hosts), token), token_beyond_loopback)
