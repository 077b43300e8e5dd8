"""Session credentials: how a session that a node runs proves its name to the gateway.

A node's gateway holds one secret (its control token). Each session's credential is an HMAC
of the session id under that secret, so the gateway checks it without any per-session state,
and no session can make a sibling's from its own. The harness carries it where it already
carries its name:

    proxy URL   http://QUOTED_NAME:CREDENTIAL@127.0.0.1:PORT   (the password; the name is
                percent-encoded, so "@" and ":" in run ids parse in every HTTP client)
    API key     polar-NAME,CREDENTIAL                          ("," is never in a name)

Standard library only: imported by the proxy's addons, the node and the CLIs alike."""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import re
from urllib.parse import quote

KEY_PREFIX = "polar-"               # an API key that names its session: polar-NAME[,CREDENTIAL]
CREDENTIAL_SEPARATOR = ","          # in an API key: polar-NAME,CREDENTIAL
CREDENTIAL_HEX = 32


def credential(secret: str, session_id: str) -> str:
    """The session's credential under the gateway's secret (32 hex digits)."""
    return hmac.new(secret.encode(), b"polar-session:" + session_id.encode(), hashlib.sha256).hexdigest()[:CREDENTIAL_HEX]


def valid(secret: str, session_id: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(credential(secret, session_id).encode(), (given or "").encode())


def proxy_url(session_id: str, port: int, cred: str | None = None, host: str = "127.0.0.1") -> str:
    """The HTTPS_PROXY URL that names the session: every reserved character of the name is
    percent-encoded (curl, libcurl, undici and RFC 3986 parsers read the host after the
    first raw "@")."""
    return f"http://{quote(session_id, safe='')}:{cred or 'x'}@{host}:{port}"


def api_key(session_id: str, cred: str | None = None) -> str:
    """The API key that names the session (and proves it, with a credential)."""
    return f"{KEY_PREFIX}{session_id}" + (f"{CREDENTIAL_SEPARATOR}{cred}" if cred else "")


def parse_api_key(key: str) -> tuple[str, str | None] | None:
    """(name, credential or None) of a key api_key made; None for any other key."""
    if not key.startswith(KEY_PREFIX) or len(key) == len(KEY_PREFIX):
        return None
    name, _, cred = key[len(KEY_PREFIX):].partition(CREDENTIAL_SEPARATOR)
    return name, cred or None


# A credential wherever a session's output shows it: in its API key, and as the password of
# its proxy URL.
_IN_KEY = re.compile(r"(polar-[^\s,]*,)[0-9a-f]{%d}" % CREDENTIAL_HEX)
_IN_URL = re.compile(r"(://[^/\s:@]*:)[0-9a-f]{%d}@" % CREDENTIAL_HEX)


def redact(text: str) -> str:
    """Text (a harness's output, say) with every session credential replaced, as it may be kept."""
    return _IN_URL.sub(r"\1[redacted]@", _IN_KEY.sub(r"\1[redacted]", text))


_PR_SET_DUMPABLE = 4


def make_undumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0) for this process: from then on its /proc/PID/{mem,environ,
    fd,...} need CAP_SYS_PTRACE, also for processes of its own user (a harness in the fallback
    sandbox, which drops that capability). For processes that hold a secret: mitmdump, the
    node. False where the call is not there."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
