"""Nothing the proxy receives leaves the machine: not HTTP (answered locally), and not the
traffic mitmproxy would relay raw (non-HTTP after CONNECT or inside TLS, passthrough hosts,
streamed bodies, DNS). Listeners on 127.0.0.1 stand for the outside hosts; none may ever
see a connection."""

import socket
import ssl
import time

import pytest
from mitmproxy import exceptions
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.test import taddons

from support.fake_vllm import FakeVLLM
from polar_mitm.stack import launch
from polar_mitm.addons.gateway import PolarGateway


class Outside:
    """A host on the outside: its kernel completes any connection, so accept() tells."""

    def __init__(self, kind=socket.SOCK_STREAM):
        self.sock = socket.socket(socket.AF_INET, kind)
        self.sock.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            self.sock.listen(16)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def reached(self) -> bool:
        try:
            if self.sock.type == socket.SOCK_STREAM:
                self.sock.accept()[0].close()
            else:
                self.sock.recv(4096)
            return True
        except BlockingIOError:
            return False


def connect_tunnel(proxy_port: int, target: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy_port), timeout=5)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        assert chunk, "the proxy closed the CONNECT"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return s


def drain(s) -> bytes:
    """What the proxy answers before it closes (it must close, not relay)."""
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except (ssl.SSLError, ConnectionResetError):
        pass
    s.close()
    return out


@pytest.mark.parametrize("sets", [
    [],
    # every passthrough mitmproxy offers, turned on: the addon must turn them off
    ["rawtcp=true", "ignore_hosts=.*", "tcp_hosts=.*", "udp_hosts=.*", "stream_large_bodies=1"],
    ["allow_hosts=^nowhere$"],   # not allowed means passed through, in mitmproxy
], ids=["defaults", "passthrough-options", "allow-hosts"])
def test_non_http_traffic_reaches_no_outside_host(start_proxy, sets):
    name_server = Outside(socket.SOCK_DGRAM)
    with FakeVLLM() as fake:
        proxy = start_proxy(fake.url, sets + [f"dns_name_servers=127.0.0.1:{name_server.port}"])
        ssh, raw, tls, plain, streamed = (Outside() for _ in range(5))

        # CONNECT to a non-HTTP port, then a client that speaks first (SSH)
        s = connect_tunnel(proxy.port, f"127.0.0.1:{ssh.port}")
        s.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        drain(s)

        # raw binary TCP after CONNECT
        s = connect_tunnel(proxy.port, f"127.0.0.1:{raw.port}")
        s.sendall(b"\x00\x01\x02\x03 not http at all\n" * 4)
        drain(s)

        # TLS through the tunnel (the proxy terminates it), carrying non-HTTP data
        s = connect_tunnel(proxy.port, f"127.0.0.1:{tls.port}")
        tls_ctx = ssl.create_default_context(cafile=proxy.ca)
        tls_ctx.check_hostname = False
        t = tls_ctx.wrap_socket(s, server_hostname="outside.example")
        t.sendall(b"\x00\x01\x02\x03 binary inside TLS\n" * 4)
        drain(t)

        # plain HTTP to the outside host: answered locally
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        s.sendall(f"GET http://127.0.0.1:{plain.port}/x HTTP/1.1\r\nHost: 127.0.0.1:{plain.port}\r\n"
                  f"Connection: close\r\n\r\n".encode())
        assert drain(s).startswith(b"HTTP/1.1 404")

        # a body mitmproxy would stream to the server (stream_large_bodies) before `request`
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        body = b"x" * 5000
        s.sendall(f"POST http://127.0.0.1:{streamed.port}/upload HTTP/1.1\r\n"
                  f"Host: 127.0.0.1:{streamed.port}\r\nContent-Length: {len(body)}\r\n"
                  f"Connection: close\r\n\r\n".encode() + body)
        assert drain(s).startswith(b"HTTP/1.1 204")

        # a name on port 22: closed without a lookup or a connection attempt
        s = connect_tunnel(proxy.port, "ssh.polar-outside.invalid:22")
        s.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        drain(s)

        # DNS over TCP after CONNECT to port 53: mitmproxy would resolve it with a name server
        s = connect_tunnel(proxy.port, "127.0.0.1:53")
        query = bytes.fromhex("abcd01000001000000000000") + b"\x07example\x03com\x00\x00\x01\x00\x01"
        s.sendall(len(query).to_bytes(2, "big") + query)
        assert drain(s) == b""

        time.sleep(0.5)
        assert not any(o.reached() for o in (ssh, raw, tls, plain, streamed, name_server))
        assert fake.bodies == []
    log = proxy.log.read_text(errors="replace")  # nothing even tried: no lookup, no connect
    assert "server connect" not in log and "killed before connect" not in log


def test_mitmdump_refuses_to_run_a_dns_listener(tmp_path):
    """UDP/DNS modes would resolve names with a real name server (here: one on 127.0.0.1):
    with the addon loaded, mitmdump does not start them at all."""
    name_server = Outside(socket.SOCK_DGRAM)
    port, dns_port = launch.free_ports(2)
    log = tmp_path / "mitmdump.log"
    with FakeVLLM() as fake:
        proxy = launch.Service("mitmdump", [
            launch.mitmdump_path(), "-s", str(launch.ADDON_FILE), "--listen-host", "127.0.0.1",
            "--mode", f"regular@{port}", "--mode", f"dns@{dns_port}",
            "--set", f"confdir={tmp_path / 'conf'}", "--set", f"polar_db={tmp_path / 'c.duckdb'}",
            "--set", f"polar_backend={fake.url}",
            "--set", f"dns_name_servers=127.0.0.1:{name_server.port}"], None, log)
        try:
            assert proxy.proc.wait(30) != 0
        finally:
            proxy.stop()
    assert f"mode dns@{dns_port}: polar-mitm answers HTTP itself" in log.read_text(errors="replace")
    assert not name_server.reached()


@pytest.mark.parametrize("mode", ["dns@5353", "upstream:http://127.0.0.1:3128", "wireguard",
                                  "reverse:tcp://127.0.0.1:22", "reverse:dns://127.0.0.1:53",
                                  "transparent"])
def test_relaying_modes_are_refused(mode):
    gw = PolarGateway()
    with taddons.context(gw) as tctx:
        with pytest.raises(exceptions.OptionsError, match="relays nothing"):
            tctx.configure(gw, mode=[mode])


def test_passthrough_options_are_forced_off():
    gw = PolarGateway()
    with taddons.context(Proxyserver(), gw) as tctx:
        tctx.configure(gw, ignore_hosts=[".*"], tcp_hosts=[".*"], udp_hosts=[".*"],
                       stream_large_bodies="1", connection_strategy="eager", upstream_cert=True,
                       mode=["regular@1", "reverse:http://127.0.0.1:8000@2", "socks5@3"])
        o = tctx.options
        assert (o.ignore_hosts, o.tcp_hosts, o.udp_hosts, o.stream_large_bodies,
                o.connection_strategy, o.upstream_cert) == ([], [], [], None, "lazy", False)
