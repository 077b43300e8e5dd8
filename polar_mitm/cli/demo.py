"""The main job, first form: every API style, through the proxy, with the official SDKs."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

PROMPT = "Say hello in five words."
TOOLS_PROMPT = "What is the weather in Paris? Use the tool."
WEATHER: Any = {"name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def drive(proxy_port: int, reverse_port: int, confdir: str | Path, max_tokens: int = 24) -> list[dict]:
    """One call per style and mode; returns what each SDK parsed."""
    import anthropic
    import openai
    from google import genai
    from google.genai import types

    ca = str(Path(confdir) / "mitmproxy-ca-cert.pem")
    out = []

    def note(style, mode, stream, text):
        out.append({"style": style, "mode": mode, "stream": stream, "text": text})

    for mode in ("regular", "reverse"):
        regular = mode == "regular"
        proxy = f"http://127.0.0.1:{proxy_port}" if regular else None
        base = None if regular else f"http://127.0.0.1:{reverse_port}"
        # Each SDK ships its own HTTP client class (openai: httpx, anthropic: httpx2).
        http_args: dict[str, Any] = {"proxy": proxy, "verify": ssl.create_default_context(cafile=ca)} if regular else {}

        oa = openai.OpenAI(api_key=f"polar-demo~openai-{mode}", max_retries=0,
                           base_url=(base + "/v1") if base else None,
                           http_client=openai.DefaultHttpxClient(**http_args, timeout=300))
        r = oa.chat.completions.create(model="gpt-5", max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": PROMPT}])
        note("openai_chat", mode, False, r.choices[0].message.content)
        chunks = oa.chat.completions.create(model="gpt-5", max_tokens=max_tokens, stream=True,
                                            messages=[{"role": "user", "content": TOOLS_PROMPT}],
                                            tools=[{"type": "function", "function": WEATHER}])
        note("openai_chat", mode, True, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

        resp = oa.responses.create(model="gpt-5-codex", input=PROMPT, max_output_tokens=max_tokens)
        note("openai_responses", mode, False, resp.output_text)
        with oa.responses.stream(model="gpt-5-codex", input=PROMPT, max_output_tokens=max_tokens) as rs:
            note("openai_responses", mode, True, rs.get_final_response().output_text)

        an = anthropic.Anthropic(api_key=f"polar-demo~anthropic-{mode}", max_retries=0, base_url=base,
                                 http_client=anthropic.DefaultHttpxClient(**http_args, timeout=300))
        m = an.messages.create(model="claude-sonnet-4-5", max_tokens=max_tokens,
                               messages=[{"role": "user", "content": PROMPT}])
        note("anthropic", mode, False, "".join(b.text for b in m.content if b.type == "text"))
        with an.messages.stream(model="claude-sonnet-4-5", max_tokens=max_tokens,
                                messages=[{"role": "user", "content": PROMPT}]) as ms:
            note("anthropic", mode, True, ms.get_final_text())

        g = genai.Client(api_key=f"polar-demo~google-{mode}", http_options=types.HttpOptions(
            base_url=base, client_args=http_args, timeout=300_000))
        config = types.GenerateContentConfig(max_output_tokens=max_tokens)
        gr = g.models.generate_content(model="gemini-2.5-flash", contents=PROMPT, config=config)
        note("google", mode, False, gr.text)
        text = "".join(c.text or "" for c in g.models.generate_content_stream(
            model="gemini-2.5-flash", contents=PROMPT, config=config))
        note("google", mode, True, text)
    return out


SUMMARY_SQL = """
SELECT session_id, seq, style, stream, requested_model, len(prompt_token_ids) AS prompt_toks,
       len(token_ids) AS output_toks, finish_reason, status_code, round(total_ms) AS ms
FROM calls ORDER BY session_id, seq
"""
