"""A hostile session, from inside its sandbox: tries to write into a sibling's trajectory
through the proxy (naming the sibling by proxy user and by API key, with and without its own
credential, and naming no one), to read the gateway's health and to sync weights of its own
choice, then makes one honest call. Writes what each attempt got to tamper.json in the
workspace: [status, body]. Usage: python tamper_probe.py SIBLING_SAMPLE"""

import json
import os
import sys
from urllib.parse import quote, urlsplit

import httpx

proxy_url = os.environ["HTTPS_PROXY"]
parts = urlsplit(proxy_url)
own_credential, port = parts.password, parts.port
me = os.environ["POLAR_SESSION"]
sibling = f"{me.rsplit('~', 1)[0]}~{sys.argv[1]}"
ca = os.environ["SSL_CERT_FILE"]
plain = f"http://127.0.0.1:{port}"


def call(proxy: str, key: str) -> list:
    with httpx.Client(proxy=proxy, verify=ca, trust_env=False, timeout=30) as c:
        r = c.post("https://api.openai.com/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                   json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        return [r.status_code, r.json()]


def control(method: str, url: str, **kw) -> list:
    with httpx.Client(proxy=plain, trust_env=False, timeout=30) as c:
        r = c.request(method, url, **kw)
        return [r.status_code, r.text[:300]]


got = {
    "sibling by proxy user": call(f"http://{quote(sibling, safe='')}:x@127.0.0.1:{port}", "x"),
    "sibling by proxy user, own credential": call(
        f"http://{quote(sibling, safe='')}:{own_credential}@127.0.0.1:{port}", "x"),
    "sibling by API key": call(plain, f"polar-{sibling}"),
    "sibling by API key, own credential": call(plain, f"polar-{sibling},{own_credential}"),
    "no name": call(plain, "sk-anything"),
    "health": control("GET", "http://polar.health/_polar/health"),
    "sync": control("POST", "http://polar.sync/_polar/sync", json={"checkpoint": "/tmp/mine", "version": 99},
                    headers={"authorization": f"Bearer {own_credential}"}),
    "verify": control("POST", "http://polar.sync/_polar/verify"),
    "own": call(proxy_url, "x"),
}
with open("tamper.json", "w") as f:
    json.dump(got, f, indent=1)
print(json.dumps({k: v[0] for k, v in got.items()}))
