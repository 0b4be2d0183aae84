# Runs inside the head's Ray container (`docker exec -i … python3 -`), its parameters in the
# program (node_params.py). One short chat completion: it proves the server generates (text,
# reasoning, or tokens up to the limit); prints its latency, token counts and where the tokens went as
# JSON (they become stack outputs); exits 1 when it fails.
import json
import sys
import time
import urllib.error
import urllib.request

from components.scripts.node_chat import chat, wait_served
from components.scripts.node_contract import SmokeParams, SmokeResult
from components.scripts.node_params import given

P = SmokeParams.from_json(given())

body = {
    "model": P.model,
    "messages": [{"role": "user", "content": P.prompt}],
    "max_tokens": P.max_tokens,
    "temperature": 0,
}
tls = (P.server_name, P.tls_ca) if P.tls_ca else None
if P.wait_served_seconds:  # through the endpoint: once the edge's checks have seen vLLM serve
    try:
        unserved = wait_served(P.base_url, P.wait_served_seconds, tls)
    except OSError as error:
        print(f"smoke test failed: {P.base_url}/health: {error}")
        sys.exit(1)
    if unserved is not None:
        print(f"smoke test failed: the endpoint's /health ({P.base_url}) still answered {unserved} after "
              f"{P.wait_served_seconds:g} s: the edge's checks of vLLM's /health did not pass")  # fmt: skip
        sys.exit(1)
start = time.monotonic()
try:
    answer = chat(P.base_url, body, P.api_key, P.timeout_seconds, tls)
except urllib.error.HTTPError as error:
    print(f"smoke test failed: HTTP {error.code}: {error.read()[:500]!r}")
    sys.exit(1)
except OSError as error:
    print(f"smoke test failed: {error}")
    sys.exit(1)
latency = time.monotonic() - start


def generated(answer):
    """Where the server's tokens went: the answer's text, the reasoning a reasoning parser split off
    (`reasoning` in vLLM 0.25, `reasoning_content` before), or, when neither holds text, tokens counted
    up to the length limit (a model that spent them all thinking, its chat template having opened
    <think>). None when it generated nothing."""
    choices = answer.get("choices") or []
    message = (choices[0].get("message") or {}) if choices else {}
    for field in ("content", "reasoning", "reasoning_content"):
        if isinstance(message.get(field), str) and message[field].strip():
            return field
    tokens = (answer.get("usage") or {}).get("completion_tokens") or 0
    if choices and tokens > 0 and choices[0].get("finish_reason") == "length":
        return "tokens"
    return None


where = generated(answer)
usage = answer.get("usage") or {}
if where is None:
    shown = json.dumps(answer)[:500]
    print(f"smoke test failed: the server generated nothing (no content, no reasoning, no tokens): {shown}")
    sys.exit(1)
result = SmokeResult(
    latency_seconds=round(latency, 3),
    completion_tokens=usage.get("completion_tokens", 0),
    prompt_tokens=usage.get("prompt_tokens", 0),
    generated_in=where,
)
print(json.dumps(result.to_json()))
