"""A small agent harness for the dashboard's tests: it offers the model a `bash` tool over
OpenAI Chat through the node's proxy, runs the tool calls it gets and sends their output
back, up to 4 turns; its last answer goes to stdout. Copied into a task's workspace."""
import json, os, subprocess
import httpx

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the workspace",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
messages = [{"role": "system", "content": "You are a careful agent. Use the bash tool."},
            {"role": "user", "content": os.environ["POLAR_INSTRUCTION"]}]
with httpx.Client(proxy=os.environ["HTTPS_PROXY"], verify=os.environ["SSL_CERT_FILE"], timeout=60,
                  trust_env=False) as client:
    for _ in range(4):
        r = client.post("https://api.openai.com/v1/chat/completions", headers={"authorization": "Bearer x"},
                        json={"model": "gpt-4o", "messages": messages, "tools": TOOLS, "max_tokens": 64})
        r.raise_for_status()
        msg = r.json()["choices"][0]["message"]
        messages.append(msg)
        if not msg.get("tool_calls"):
            print(msg.get("content"), flush=True)
            break
        for call in msg["tool_calls"]:
            command = json.loads(call["function"]["arguments"])["command"]
            out = subprocess.run(command, shell=True, capture_output=True, text=True)
            print("$", command, flush=True)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": out.stdout + out.stderr})
