"""The gateway's one secret, as an addon: the control token that /_polar/sync, /_polar/sleep,
/_polar/verify and /_polar/health require, and under which sessions' credentials are made
(polar_mitm/session_auth.py).

A harness shares the machine with the proxy and, in the fallback sandbox, sees its processes:
so the token never goes on mitmdump's command line or into its environment (both readable in
/proc). `polar_control_token_file` names a file that is read once and removed at once; the
process then turns itself non-dumpable, so that its memory, environment and open files in
/proc need CAP_SYS_PTRACE, which the fallback sandbox drops (runtime.py)."""

from __future__ import annotations

import hmac
import logging
import os

from mitmproxy import ctx, exceptions, http

from polar_mitm import session_auth

log = logging.getLogger("polar")


class Control:
    def __init__(self) -> None:
        self.token = ""
        self.session_auth = False
        self.refused = 0          # calls that named a session without its credential

    def load(self, loader) -> None:
        loader.add_option("polar_control_token_file", str, "",
                          "File holding the control token; read once at start and removed "
                          "(a token on the command line is readable in /proc by every process).")
        loader.add_option("polar_control_token", str, "",
                          "Bearer token for /_polar/sync, /_polar/sleep, /_polar/verify and "
                          "/_polar/health (empty: syncs are off, health is open). Prefer "
                          "polar_control_token_file: a command line is readable by any process.")
        loader.add_option("polar_session_auth", str, "off",
                          "on: a model call is stored only when it carries the credential of "
                          "the session it names (HMAC of the name under the control token, in "
                          "the proxy password or the API key polar-NAME,CREDENTIAL); others get "
                          "a 403 and are stored nowhere. A gateway node turns it on.",
                          choices=("off", "on"))

    def configure(self, updated: set[str]) -> None:
        if "polar_control_token_file" in updated and ctx.options.polar_control_token_file:
            path = ctx.options.polar_control_token_file
            try:
                with open(path) as f:
                    token = f.read().strip()
                os.unlink(path)
            except OSError as e:
                raise exceptions.OptionsError(f"polar_control_token_file: {e}") from None
            if not token:
                raise exceptions.OptionsError(f"polar_control_token_file: {path} is empty")
            self.token = token
            ctx.options.polar_control_token_file = ""    # read: the path means nothing any more
        if "polar_control_token" in updated and ctx.options.polar_control_token:
            self.token = ctx.options.polar_control_token
        if "polar_session_auth" in updated or "polar_control_token" in updated or "polar_control_token_file" in updated:
            self.session_auth = ctx.options.polar_session_auth == "on"
            if self.session_auth and not self.token:
                raise exceptions.OptionsError("polar_session_auth=on needs the control token "
                                              "(polar_control_token_file): credentials are made under it")

    def running(self) -> None:
        if self.token and not session_auth.make_undumpable():
            log.warning("polar: could not make mitmdump non-dumpable; its memory is as readable as its user's")

    def authorized(self, flow: http.HTTPFlow) -> bool:
        """The request carries the control token (Authorization: Bearer TOKEN)."""
        given = flow.request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return bool(self.token) and hmac.compare_digest(given.encode(), self.token.encode())

    def may_store(self, session_id: str, source: str | None, credential: str | None) -> bool:
        """Whether a call naming this session may be stored under it."""
        if not self.session_auth:
            return True
        return source in ("proxy_user", "api_key") and session_auth.valid(self.token, session_id, credential)
