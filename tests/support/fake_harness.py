"""A stand-in harness for the fault tests: makes model calls through HTTPS_PROXY like a real
CLI (regular mode, the mitmproxy CA), then behaves as told: ok | hang | crash | slow:SECONDS."""

import os
import sys
import time

import httpx

mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
calls = int(sys.argv[2]) if len(sys.argv) > 2 else 1
if os.environ.get("HTTPS_PROXY", "").endswith(":1"):
    calls = 0   # no proxy on this node: the scheduling tests need none
with httpx.Client(proxy=os.environ.get("HTTPS_PROXY"), verify=os.environ.get("SSL_CERT_FILE") or True,
                  timeout=60, trust_env=False) as client:
    messages = [{"role": "user", "content": os.environ.get("POLAR_INSTRUCTION", "hi")}]
    for _ in range(calls):
        r = client.post("https://api.openai.com/v1/chat/completions", headers={"authorization": "Bearer x"},
                        json={"model": "gpt-4o", "messages": messages, "max_tokens": 8})
        r.raise_for_status()
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
print(f"made {calls} call(s)", flush=True)
if mode == "hang":
    time.sleep(3600)
elif mode == "crash":
    print("fake harness crashed", flush=True)
    sys.exit(3)
elif mode.startswith("slow:"):
    time.sleep(float(mode.split(":", 1)[1]))
with open("result.txt", "w") as f:
    f.write("ok\n")
