"""Proxy users: in regular mode the HTTPS_PROXY user name (TASK~i) and password (a node's
session credential) ride on CONNECT, not on the requests inside the tunnel; this addon
remembers them per client connection."""

from __future__ import annotations

from mitmproxy import http

from . import sessions


class ProxyUsers:
    def __init__(self):
        self._users: dict[str, sessions.ProxyAuth] = {}    # client connection id -> proxy auth

    def http_connect(self, flow: http.HTTPFlow):
        auth = sessions.proxy_auth(flow.request.headers.get("proxy-authorization"))
        if auth:
            self._users[flow.client_conn.id] = auth

    def client_disconnected(self, client):
        self._users.pop(client.id, None)

    def auth(self, flow: http.HTTPFlow) -> sessions.ProxyAuth | None:
        """The CONNECT's user and password, else those on this very request (plain-HTTP proxying)."""
        return self._users.get(flow.client_conn.id) or sessions.proxy_auth(
            flow.request.headers.get("proxy-authorization"))

    def user(self, flow: http.HTTPFlow) -> str | None:
        auth = self.auth(flow)
        return auth.user if auth else None
