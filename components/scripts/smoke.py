# Runs inside the head's Ray container (`docker exec -i … python3 -`), PARAMS prepended by
# components.render.script_program. One short chat completion; prints its latency and token
# counts as JSON (they become stack outputs); exits 1 when it fails.
import json
import sys
import time
import urllib.error
import urllib.request

P = json.loads(PARAMS)  # noqa: F821 - prepended by script_program

body = json.dumps(
    {
        "model": P["model"],
        "messages": [{"role": "user", "content": P["prompt"]}],
        "max_tokens": P["max_tokens"],
        "temperature": 0,
    }
).encode()
request = urllib.request.Request(P["base_url"] + "/v1/chat/completions", data=body, method="POST")
request.add_header("Content-Type", "application/json")
if P.get("api_key"):
    request.add_header("Authorization", f"Bearer {P['api_key']}")
start = time.monotonic()
try:
    with urllib.request.urlopen(request, timeout=P["timeout_seconds"]) as response:
        answer = json.loads(response.read())
except urllib.error.HTTPError as error:
    print(f"smoke test failed: HTTP {error.code}: {error.read()[:500]!r}")
    sys.exit(1)
except OSError as error:
    print(f"smoke test failed: {error}")
    sys.exit(1)
latency = time.monotonic() - start
choices = answer.get("choices") or []
usage = answer.get("usage") or {}
if not choices or not (choices[0].get("message") or {}).get("content"):
    print(f"smoke test failed: no completion in the answer: {json.dumps(answer)[:500]}")
    sys.exit(1)
print(
    json.dumps(
        {
            "latency_seconds": round(latency, 3),
            "completion_tokens": usage.get("completion_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", 0),
        }
    )
)
