"""Which session (one harness run) a call belongs to, without changing the harness.

The harness already sends two things the user controls: its API key and, in regular
proxy mode, the user name in HTTPS_PROXY (http://NAME:x@127.0.0.1:8080). Either names
the session. Secrets are never stored: a key is kept only when the user marked it as a
session name (prefix "polar-"), otherwise as a salted hash. A session name of the form
TASK~SAMPLE puts the session in TASK's GRPO group."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from typing import Mapping, NamedTuple
from urllib.parse import unquote

from polar_mitm.session_auth import parse_api_key
from polar_mitm.session_ids import task_of      # the session-id rule's one place
from polar_mitm.store.records import SessionInfo

SCHEMES = ("auto", "proxy-user", "api-key", "client")
_SAFE = re.compile(r"[^A-Za-z0-9._~+=@:/-]")


def api_key(headers: Mapping[str, str], query: str = "") -> str | None:
    """The key as each provider sends it: x-api-key, Bearer, x-goog-api-key, or ?key=."""
    h = {k.lower(): v for k, v in headers.items()}
    if h.get("x-api-key"):
        return h["x-api-key"].strip()
    auth = h.get("authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    if h.get("x-goog-api-key"):
        return h["x-goog-api-key"].strip()
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        if name == "key" and value:
            return value
    return None


class ProxyAuth(NamedTuple):
    user: str
    password: str      # a node's session credential, or anything ("x") by hand


def proxy_auth(proxy_authorization: str | None) -> ProxyAuth | None:
    """User and password from a Basic Proxy-Authorization header. Both are percent-decoded:
    a client that sends the URL's userinfo as written (%40 for "@") names the same session
    as one that decodes it first (curl, requests, undici); a name never holds "%"."""
    if not proxy_authorization or not proxy_authorization.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(proxy_authorization[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, _, password = decoded.partition(":")
    return ProxyAuth(unquote(user), unquote(password)) if user else None


def proxy_user(proxy_authorization: str | None) -> str | None:
    """User name from a Basic Proxy-Authorization header."""
    auth = proxy_auth(proxy_authorization)
    return auth.user if auth else None


def key_session(key: str, salt: str) -> tuple[str, str]:
    named = parse_api_key(key)
    if named:
        return clean(named[0]), "api_key"
    digest = hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()[:16]
    return f"key-{digest}", "key_hash"


def clean(name: str) -> str:
    return _SAFE.sub("_", name)[:200]


def user_agent_product(user_agent: str) -> str:
    product = (user_agent or "unknown").split("/", 1)[0].split(" ", 1)[0]
    return clean(product.lower()) or "unknown"


class Claim(NamedTuple):
    """The session a call names, and the credential that came with the name (never stored)."""
    session: SessionInfo
    credential: str | None


def claim(*, headers: Mapping[str, str], query: str, proxy: ProxyAuth | None,
          client_host: str, salt: str, scheme: str = "auto") -> Claim:
    """The session a call belongs to, and the credential that names it (the proxy
    password, or the API key's part after ",")."""
    ua = {k.lower(): v for k, v in headers.items()}.get("user-agent", "")
    session_id = source = credential = None
    if scheme in ("auto", "proxy-user") and proxy:
        session_id, source, credential = clean(proxy.user), "proxy_user", proxy.password or None
    if session_id is None and scheme in ("auto", "api-key"):
        key = api_key(headers, query)
        if key:
            session_id, source = key_session(key, salt)
            credential = (parse_api_key(key) or ("", None))[1]
    if session_id is None:
        session_id, source = f"default-{client_host}-{user_agent_product(ua)}", "default"
    return Claim(SessionInfo(session_id, task_id=task_of(session_id), source=source, client=client_host,
                             user_agent=ua[:300]), credential)


def attribute(*, headers: Mapping[str, str], query: str, proxy_auth_user: str | None,
              client_host: str, salt: str, scheme: str = "auto") -> SessionInfo:
    """The session a call belongs to."""
    proxy = ProxyAuth(proxy_auth_user, "") if proxy_auth_user else None
    return claim(headers=headers, query=query, proxy=proxy, client_host=client_host, salt=salt,
                 scheme=scheme).session


def redact_query(path: str) -> str:
    """Drop ?key=... (Google's query-string API key) before a path is stored."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    kept = [p for p in query.split("&") if p.partition("=")[0] != "key"]
    return base + ("?" + "&".join(kept) if kept else "")
