"""Proxy users: in regular mode the HTTPS_PROXY user name (TASK~i) rides on CONNECT, not on
the requests inside the tunnel; this addon remembers it per client connection."""

from __future__ import annotations

from mitmproxy import http

from . import sessions


class ProxyUsers:
    def __init__(self):
        self._users: dict[str, str] = {}    # client connection id -> proxy-auth user

    def http_connect(self, flow: http.HTTPFlow):
        user = sessions.proxy_user(flow.request.headers.get("proxy-authorization"))
        if user:
            self._users[flow.client_conn.id] = user

    def client_disconnected(self, client):
        self._users.pop(client.id, None)

    def user(self, flow: http.HTTPFlow) -> str | None:
        """The CONNECT's user, else one on this very request (plain-HTTP proxying)."""
        return self._users.get(flow.client_conn.id) or sessions.proxy_user(
            flow.request.headers.get("proxy-authorization"))
