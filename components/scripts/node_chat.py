# One chat completion in OpenAI's shape, as a client sends it: what the smoke test, the validation's answers and
# the router's smoke share (prepended to each: components.plan.programs.SCRIPT_HELPERS). Standard library only.
import json
import urllib.request


def chat(base_url, body, api_key, timeout):
    """POST `body` to base_url/v1/chat/completions, with the API key when there is one: the answer's JSON.
    urllib's HTTPError (an answer other than 2xx), OSError (no answer) and ValueError (no JSON) reach the caller."""
    request = urllib.request.Request(base_url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())
