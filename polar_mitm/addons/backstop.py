"""The fail-closed backstop: whatever the options say and whatever another addon gets wrong,
nothing the proxy receives is relayed to the outside.

- Passthrough options (ignore/allow/tcp/udp hosts, streamed bodies) are forced off in
  configure, and relaying modes (upstream, DNS, WireGuard, transparent...) are refused.
- Raw TCP/UDP/DNS/QUIC layers (non-HTTP after CONNECT or inside TLS) are replaced by a close.
- mitmproxy itself opens no server connection, lookups included, except to the proxy's own
  loopback stream relay.
- A request no addon answered gets a 500 (Unanswered, last in the chain), never goes upstream.
"""

from __future__ import annotations

import logging

from mitmproxy import ctx, exceptions, http
from mitmproxy.proxy import commands, events, layer, mode_specs
from mitmproxy.proxy.layers import DNSLayer, RawQuicLayer, TCPLayer, UDPLayer

from .http_json import internal_error

log = logging.getLogger("polar")


class Backstop:
    def __init__(self, local_addresses=lambda: ()):
        self.local_addresses = local_addresses     # () -> addresses of our own loopback relay

    def configure(self, updated):
        # rawtcp stays: it tells non-HTTP apart, and next_layer closes what it would relay.
        forced = {"connection_strategy": "lazy", "upstream_cert": False,
                  "stream_large_bodies": None,  # a streamed body goes to the server before `request`
                  "ignore_hosts": [], "allow_hosts": [], "tcp_hosts": [], "udp_hosts": []}
        for name, value in forced.items():
            # Forced rather than refused: a script whose configure fails stays loaded with these.
            if name in updated and name in ctx.options and getattr(ctx.options, name) != value:
                if name not in ("connection_strategy", "upstream_cert"):
                    log.warning("polar: %s would pass traffic to the outside; ignored", name)
                setattr(ctx.options, name, value)
        if "mode" in updated:
            for spec in ctx.options.mode:
                mode = mode_specs.ProxyMode.parse(spec)
                if not (isinstance(mode, (mode_specs.RegularMode, mode_specs.Socks5Mode))
                        or isinstance(mode, mode_specs.ReverseMode) and mode.scheme in ("http", "https")):
                    raise exceptions.OptionsError(
                        f"mode {spec}: polar-mitm answers HTTP itself and relays nothing; "
                        f"use regular, socks5 or reverse:http(s)://")

    def next_layer(self, nextlayer: layer.NextLayer):
        if nextlayer.layer is None:
            # Scripts run before mitmproxy's own next_layer addon: decide with it, then check.
            builtin = ctx.master.addons.get("nextlayer")
            if builtin is None:
                return
            builtin.next_layer(nextlayer)
        child = nextlayer.layer
        while child is not None:
            if isinstance(child, (TCPLayer, UDPLayer, DNSLayer, RawQuicLayer)):
                log.info("polar: refused a %s connection to %s (nothing is relayed)",
                         type(child).__name__, nextlayer.context.server.address)
                nextlayer.layer = Refused(nextlayer.context)
                return
            child = getattr(child, "child_layer", None)

    def server_connect(self, data):
        if data.server.address in self.local_addresses():
            return
        data.server.error = "polar-mitm relays nothing to the outside"


class Unanswered:
    """Last in the chain: a request that no addon answered (a bug) must not go through to the
    real host. Flows sent to our own relay are answered there."""

    def __init__(self, local_addresses=lambda: ()):
        self.local_addresses = local_addresses

    def request(self, flow: http.HTTPFlow):
        if flow.response is None and (flow.request.host, flow.request.port) not in self.local_addresses():
            log.error("polar: no addon answered %s %s", flow.request.method, flow.request.pretty_url)
            flow.response = internal_error()


class Refused(layer.Layer):
    """Stands in for a relay layer: closes the client connection and opens nothing."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)
