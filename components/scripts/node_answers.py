# Runs inside the head's container (`docker exec -i … python3 -`), its parameters in the
# program (node_params.py). Greedy answers (temperature 0) to a fixed set of conversations, the
# later turns of each sent with the earlier turns and their answers (a prefix the server has cached), with
# the generated token ids (vLLM's `return_token_ids`; the text where a server gives none). Prints one JSON
# line: {"answers": [{"id", "tokenIds", "text", "finishReason"}], and with PARAMS' baseline "agreement"};
# exits 1 when a request fails or an answer differs from the baseline's (a failed validation).
import json
import sys
import urllib.error
import urllib.request

from components.scripts.node_chat import chat
from components.scripts.node_contract import AnswersParams, AnswersResult
from components.scripts.node_params import given

P = AnswersParams.from_json(given())


def ask(messages):
    body = {
        "model": P.model,
        "messages": messages,
        "max_tokens": P.max_tokens,
        "temperature": 0,
        "seed": 0,
        "return_token_ids": True,
    }
    answer = chat(P.base_url, body, P.api_key, P.timeout_seconds)
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = message.get("content") or ""
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    ids = choice.get("token_ids")
    return {
        "tokenIds": list(ids) if isinstance(ids, list) else None,
        "text": reasoning + text,
        "content": text,
        "finishReason": choice.get("finish_reason"),
    }


def answers():
    found = []
    for conversation in P.conversations:
        messages = []
        for turn, user in enumerate(conversation["turns"], start=1):
            messages.append({"role": "user", "content": user})
            try:
                answer = ask(messages)
            except urllib.error.HTTPError as error:
                print(f"validation failed: {conversation['id']} turn {turn}: HTTP {error.code}: {error.read()[:300]!r}")
                sys.exit(1)
            except (OSError, ValueError) as error:
                print(f"validation failed: {conversation['id']} turn {turn}: {type(error).__name__}: {error}")
                sys.exit(1)
            messages.append({"role": "assistant", "content": answer.pop("content")})
            found.append({"id": f"{conversation['id']}#{turn}", **answer})
    return found


def first_difference(mine, theirs):
    """(where, what) of the first difference between two answers: token ids where both have them."""
    if mine.get("tokenIds") is not None and theirs.get("tokenIds") is not None:
        a, b = mine["tokenIds"], theirs["tokenIds"]
        unit = "token"
    else:
        a, b = mine.get("text") or "", theirs.get("text") or ""
        unit = "character"
    for index, (x, y) in enumerate(zip(a, b)):  # noqa: B905 - Python 3.7 has no strict=
        if x != y:
            return index, f"{unit} {index}: {x!r} here, {y!r} without speculation"
    if len(a) != len(b):
        return min(len(a), len(b)), f"{len(a)} {unit}s here, {len(b)} without speculation"
    return None, None


def agreement(found, baseline):
    theirs = {each.get("id"): each for each in baseline}
    differing = []
    for mine in found:
        other = theirs.get(mine["id"])
        if other is None:
            differing.append({"id": mine["id"], "at": None, "what": "no answer without speculation to compare"})
            continue
        at, what = first_difference(mine, other)
        if what is not None:
            differing.append({"id": mine["id"], "at": at, "what": what, "text": mine["text"][:120],
                              "baselineText": (other.get("text") or "")[:120]})  # fmt: skip
    return {"compared": len(found), "agreed": len(found) - len(differing), "differing": differing}


found = answers()
result = {"answers": found}
if P.baseline is not None:
    result["agreement"] = agreement(found, P.baseline)
print(json.dumps(AnswersResult.from_json(result).to_json()))
if P.baseline is not None and result["agreement"]["differing"]:
    first = result["agreement"]["differing"][0]
    print(
        f"validation failed: with vllm.speculative, {len(result['agreement']['differing'])} of {len(found)} greedy "
        f"answers differ from the same model's without speculation; first: {first['id']} at {first['what']} "
        f"(here: {first.get('text', '')!r}; without: {first.get('baselineText', '')!r})"
    )
    sys.exit(1)
