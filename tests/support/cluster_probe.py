"""From inside a session on a Ray cluster: what of the machine it can reach. Every TCP port
of loopback is tried (the session's network namespace should show only its own proxy's), and
the ports in targets.json (the Ray cluster's, the stand-in replicas') are also asked for
through the session's own proxy. Prints one line: PROBE {json}. Standard library only."""

import json
import os
import socket
import urllib.request


def open_ports() -> list[int]:
    found = []
    for port in range(1, 65536):
        s = socket.socket()
        s.settimeout(0.2)
        try:
            # a connection to itself (the kernel picked the same port as the source: TCP's
            # simultaneous open) is no listener
            if s.connect_ex(("127.0.0.1", port)) == 0 and s.getsockname() != s.getpeername():
                found.append(port)
        finally:
            s.close()
    return found


def through_proxy(url: str) -> str:
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("HTTP_PROXY") or ""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy, "https": proxy}))
    try:
        with opener.open(url, timeout=10) as r:
            return f"{r.status} {r.read(200)!r}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read(200)!r}"
    except OSError as e:
        return f"error {type(e).__name__}"


targets = json.load(open("targets.json"))
proxy_port = int((os.environ.get("HTTPS_PROXY") or ":0").rsplit(":", 1)[1].strip("/") or 0)
report = {"open": open_ports(), "proxy_port": proxy_port,
          "via_proxy": {name: through_proxy(url) for name, url in targets.items()}}
print("PROBE " + json.dumps(report), flush=True)
