"""A stand-in harness whose model call carries text of its choosing (a forged judge boundary,
forged instructions): one chat call through HTTPS_PROXY, its user message the contents of the
file named by argv[1]. Standard library and httpx only."""

import os
import sys

import httpx

text = open(sys.argv[1]).read()
with httpx.Client(proxy=os.environ.get("HTTPS_PROXY"), verify=os.environ.get("SSL_CERT_FILE") or True,
                  timeout=60, trust_env=False) as client:
    r = client.post("https://api.openai.com/v1/chat/completions", headers={"authorization": "Bearer x"},
                    json={"model": "gpt-4o", "messages": [{"role": "user", "content": text}], "max_tokens": 8})
    r.raise_for_status()
print("made 1 call", flush=True)
