"""The stand-in's OpenAI-compatible HTTP API (standard library only).

Pure helpers (``is_authorized``, ``chat_reply``, ``chat_completion``,
``models_payload``) are unit-tested; ``make_server`` wraps them in a
``ThreadingHTTPServer``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import __version__, log
from .args import PLAYED, ServeConfig

OPEN_PATHS = ("/health", "/version", "/metrics", "/ping", "/load")
# vLLM 0.25's key guards the paths that start with these and nothing else
# (vllm/entrypoints/serve/utils/server_utils.py GUARDED_PREFIX, /cohere from 0.27: versions.Played; OPTIONS is
# never checked)
GUARDED_PREFIX = PLAYED.guarded_prefixes
# Routes vLLM serves on every address it listens on, without the key (the stand-in serves a generative model:
# the pooling routes, /pooling /classify /score /rerank, are not mounted for one, so they are 404 as in vLLM):
#   POST /invocations   vllm/entrypoints/sagemaker/routes.py, mounted by api_server.py with no flag: a chat or
#                       completions body goes to the same handlers (vLLM issue 58144)
#   POST /tokenize, /detokenize   vllm/entrypoints/serve/tokenize/api_router.py
# and with VLLM_SERVER_DEV_MODE=1 the operational ones (vllm/entrypoints/serve/dev/api_router.py and its siblings).
DEV_MODE_ROUTES = ("/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
                   "/reset_mm_cache", "/collective_rpc", "/server_info")  # fmt: skip


def needs_auth(path: str, method: str = "GET") -> bool:
    """vLLM's key guards the paths under GUARDED_PREFIX, for every method but OPTIONS."""
    return method != "OPTIONS" and path.split("?", 1)[0].startswith(GUARDED_PREFIX)


def dev_mode(environ=os.environ) -> bool:
    return environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0", "false", "False")


def tokenize(body: object, cfg: ServeConfig) -> tuple[int, dict]:
    """POST /tokenize (vllm/entrypoints/serve/tokenize/protocol.py TokenizeResponse): a prompt or messages as
    token ids."""
    if not isinstance(body, dict) or not ("prompt" in body or "messages" in body):
        return 400, error_body("a prompt or messages", "BadRequestError", 400)
    if "prompt" in body:
        text = str(body["prompt"])
    else:
        text = " ".join(message_text(m.get("content")) for m in body["messages"] if isinstance(m, dict))
    tokens = word_token_ids(text, cfg.vocab_size)
    return 200, {"count": len(tokens), "max_model_len": cfg.max_model_len, "tokens": tokens, "token_strs": None}


def detokenize(body: object) -> tuple[int, dict]:
    """POST /detokenize (DetokenizeResponse): the stand-in's ids are hashes, so its text is their count."""
    if not isinstance(body, dict) or not isinstance(body.get("tokens"), list):
        return 400, error_body("tokens: a list of ids", "BadRequestError", 400)
    return 200, {"prompt": " ".join("tok" for _ in body["tokens"])}


def is_authorized(path: str, authorization: str | None, api_key: str | None, method: str = "GET") -> bool:
    """True when the request may proceed (no key configured, open path, or the right bearer token)."""
    if not api_key or not needs_auth(path, method):
        return True
    expected = f"Bearer {api_key}"
    return authorization is not None and hmac.compare_digest(authorization.encode(), expected.encode())


def count_tokens(text: str) -> int:
    """The stand-in's tokenizer: whitespace-separated words."""
    return len(text.split())


def message_text(content: object) -> str:
    """OpenAI message content: a string, or a list of parts ``{"type": "text", "text": ...}``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def word_token_ids(text: str, vocab_size: int | None) -> list[int]:
    """The stand-in's token ids of `text`: each word's stable hash in the vocabulary (32000 when config.json
    has no vocab_size)."""
    size = vocab_size or 32000
    return [int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % size for word in text.split()]


def render_chat(body: object, cfg: ServeConfig) -> tuple[int, dict]:
    """POST /v1/chat/completions/render (vllm/entrypoints/scale_out/render/api_router.py): the request as
    the engine would take it, its prompt as token ids (GenerateRequest), nothing generated. vllm-router's
    cache_aware policy asks this of a replica to route by the prompt's tokens."""
    model, problem = _served_model(body, cfg)
    if problem:
        return problem
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return 400, error_body("'messages' must be a non-empty list", "BadRequestError", 400, "messages")
    text = " ".join(f"<|{m.get('role')}|> {message_text(m.get('content'))}" for m in messages if isinstance(m, dict))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return 200, {
        "request_id": f"chatcmpl-{hashlib.sha256(text.encode()).hexdigest()[:24]}",
        "token_ids": word_token_ids(text, cfg.vocab_size) or [0],
        "sampling_params": {"max_tokens": max_tokens},
        "model": model,
        "stream": bool(body.get("stream")),
    }


def chat_reply(messages: list) -> str:
    """Deterministic answer: ``standin reply:`` followed by the last user message's words reversed."""
    last = ""
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user":
            last = message_text(m.get("content"))
    words = last.split()
    return " ".join(["standin", "reply:"] + list(reversed(words)))


def reasoning_words() -> list[str]:
    """What a reasoning model 'thinks' before its answer: more than 16 words, so the smoke test's 16
    tokens never reach the answer (as with Qwen3.5 on real vLLM)."""
    return "Okay, the user asks me to reply, so I will think about it first and then answer with the words reversed".split()


@dataclass(frozen=True)
class Pace:
    """How fast the stand-in "generates": a request's first token comes after its prefill (prompt tokens at
    ``prefill_tokens_per_second``) and one decode step; every further token one step
    (1 / ``tokens_per_second``) later, each in a chunk of its own when streaming. Every request decodes at
    that rate however many run at once, so a benchmark measures the stand-in's pace, not a model's."""

    tokens_per_second: float = 100.0
    prefill_tokens_per_second: float = 10000.0

    @property
    def step_seconds(self) -> float:
        return 1.0 / self.tokens_per_second

    def first_token_seconds(self, prompt_tokens: int) -> float:
        return prompt_tokens / self.prefill_tokens_per_second + self.step_seconds


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def models_payload(cfg: ServeConfig, created: int) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": cfg.model,
                "parent": None,
                "max_model_len": cfg.max_model_len,
                "permission": [],
            }
            for name in cfg.served_model_names
        ],
    }


def _served_model(body: object, cfg: ServeConfig) -> tuple[str, tuple[int, dict] | None]:
    """The model a request names (default: the first served name), or the error vLLM answers: a body
    that is not an object (400), a model it does not serve (404)."""
    if not isinstance(body, dict):
        return "", (400, error_body("request body must be a JSON object", "BadRequestError", 400))
    model = body.get("model")
    if model is not None and model not in cfg.served_model_names:
        return "", (404, error_body(f"The model `{model}` does not exist.", "NotFoundError", 404, "model"))
    return model or cfg.served_model_names[0], None


SAMPLE_VALUES = {"string": "standin", "integer": 1, "number": 1.0, "boolean": True, "array": [], "object": {}}


def _tool_call(body: dict, cfg: ServeConfig) -> tuple[dict | None, tuple[int, dict] | None]:
    """A tool call, where the request makes one certain (vLLM 0.25's serving_chat.py): a named tool_choice, or
    "required", is decoded to the function's schema without any parser; "auto" (the default with tools) needs
    --enable-auto-tool-choice and --tool-call-parser, else 400. The stand-in fills each required argument."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        return None, None
    if choice in (None, "auto") and not cfg.auto_tool_choice:
        return None, (400, error_body('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                      "to be set", "BadRequestError", 400))  # fmt: skip
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if choice != "required" and named is None:
        return None, None  # auto, or none: the stand-in answers in words
    functions = [tool.get("function") or {} for tool in tools if isinstance(tool, dict)]
    function = next((f for f in functions if f.get("name") == named), None) if named else functions[0]
    if function is None:
        return None, (400, error_body(f"Tool '{named}' has not been passed in `tools`.", "BadRequestError", 400))
    schema = function.get("parameters") or {}
    properties = schema.get("properties") or {}
    arguments = {
        name: (properties.get(name, {}).get("enum") or [SAMPLE_VALUES.get(properties.get(name, {}).get("type"), "")])[0]
        for name in schema.get("required") or []
    }
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]
    call = {"id": f"chatcmpl-tool-{digest}", "type": "function",
            "function": {"name": function.get("name"), "arguments": json.dumps(arguments)}}  # fmt: skip
    return call, None


def fault(environ=os.environ) -> str:
    """What the test switched on while it runs (``STANDIN_FAULT_FILE``, default /tmp/vllm-standin-fault): "hang" (the
    engine stops stepping: on the API server's node its engine core, on a headless rank that rank, which the
    collective then waits on), "wrong" (answers other tokens, /health and the counters as ever), or nothing."""
    try:
        with open(environ.get("STANDIN_FAULT_FILE") or "/tmp/vllm-standin-fault") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def garbled(words: list[str]) -> list[str]:
    """The "wrong" fault's tokens: each word spelled backwards (other ids, the same count)."""
    return [word[::-1] + "~" for word in words]


def _logprobs_problem(body: dict) -> tuple[int, dict] | None:
    """vLLM 0.25's ChatCompletionRequest (entrypoints/openai/chat_completion/protocol.py check_logprobs):
    top_logprobs below 0 (but -1), or set without logprobs; above --max-logprobs (20) the engine refuses it."""
    top = body.get("top_logprobs")
    if top is None:
        return None
    if not isinstance(top, int) or (top < 0 and top != -1):
        return 400, error_body("`top_logprobs` must be a positive value or -1.", "BadRequestError", 400, "top_logprobs")
    if (top == -1 or top > 0) and not body.get("logprobs"):
        return 400, error_body("when using `top_logprobs`, `logprobs` must be set to true.", "BadRequestError", 400,
                               "top_logprobs")  # fmt: skip
    if top > MAX_LOGPROBS:
        return 400, error_body(f"Requested sample logprobs of {top}, which is greater than max allowed: "
                               f"{MAX_LOGPROBS}", "BadRequestError", 400)  # fmt: skip
    return None


MAX_LOGPROBS = 20  # vLLM's --max-logprobs default


def chat_logprobs(words: list[str], top: int) -> dict:
    """A choice's ``logprobs`` (ChatCompletionLogProbs): each token sure of itself, its runner-up far behind."""
    content = []
    for word in words:
        tops = [{"token": word, "logprob": -0.01, "bytes": list(word.encode())},
                {"token": word + "_", "logprob": -6.0, "bytes": list((word + "_").encode())}]  # fmt: skip
        content.append({**tops[0], "top_logprobs": tops[: max(0, top)]})
    return {"content": content}


def chat_completion(body: object, cfg: ServeConfig, created: int, wrong: bool = False) -> tuple[int, dict]:
    """(status, JSON) for a non-streaming ``POST /v1/chat/completions`` (``wrong``: the "wrong" fault's tokens)."""
    model, problem = _served_model(body, cfg)
    if problem:
        return problem
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return 400, error_body("'messages' must be a non-empty list", "BadRequestError", 400, "messages")
    call, problem = _tool_call(body, cfg)
    if problem:
        return problem
    problem = _max_tokens_problem(body) or _logprobs_problem(body)
    if problem:
        return problem
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    prompt_tokens = sum(count_tokens(message_text(m.get("content"))) for m in messages if isinstance(m, dict))
    problem = _context_problem(cfg, prompt_tokens, max_tokens or 0)
    if problem:
        return problem
    words = chat_reply(messages).split()
    words = garbled(words) if wrong else words
    thinking = reasoning_words() if cfg.reasoning_parser else []
    finish = "stop"
    if max_tokens is not None and len(thinking) + len(words) > max_tokens:
        finish = "length"
        thinking, words = thinking[:max_tokens], words[: max(0, max_tokens - len(thinking))]
    # vLLM 0.25's reasoning parsers put the thinking in `reasoning`, and `content` is null when the limit
    # came before the answer (a chat template that opens <think> in the prompt, as Qwen3.5's does).
    text = " ".join(words) if words or not thinking else None
    reasoning = " ".join(thinking) if thinking else None
    if call is not None:  # the call's arguments are what it decoded
        text, reasoning, words, thinking = "", None, call["function"]["arguments"].split(), []
        finish = "tool_calls" if body.get("tool_choice") == "required" else "stop"
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]
    extra = {}
    if body.get("return_token_ids"):  # vLLM 0.25: the generated ids beside the text
        extra["token_ids"] = word_token_ids(" ".join(thinking + words), cfg.vocab_size)
    logprobs = chat_logprobs(thinking + words, body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return 200, {
        "id": f"chatcmpl-{digest}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [call] if call else [],
                    "reasoning": reasoning,
                },
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": None,
                **extra,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(thinking) + len(words),
            "total_tokens": prompt_tokens + len(thinking) + len(words),
        },
    }


def _max_tokens_problem(body: dict) -> tuple[int, dict] | None:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        return 400, error_body("max_tokens must be a positive integer", "BadRequestError", 400, "max_tokens")
    return None


def _context_problem(cfg: ServeConfig, prompt_tokens: int, max_tokens: int) -> tuple[int, dict] | None:
    if prompt_tokens + max_tokens > cfg.max_model_len:
        return 400, error_body(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            "BadRequestError",
            400,
        )
    return None


COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default


def completion(body: object, cfg: ServeConfig, created: int, wrong: bool = False) -> tuple[int, dict]:
    """(status, JSON) for ``POST /v1/completions``: ``prompt`` a string or a list of token ids (what
    ``vllm bench serve``'s random dataset and spark-vllm's benchmark send), ``max_tokens`` (default 16)
    and vLLM's ``ignore_eos`` (then exactly max_tokens tokens). A single prompt only: a batch of prompts
    is refused (vLLM would take it; nothing here sends one)."""
    model, problem = _served_model(body, cfg)
    if problem:
        return problem
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt_tokens, prompt_words = count_tokens(prompt), prompt.split()
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) < 0 or (cfg.vocab_size is not None and max(prompt) >= cfg.vocab_size):
            bad = min(prompt) if min(prompt) < 0 else max(prompt)
            return 400, error_body(f"Token id {bad} is out of vocabulary", "BadRequestError", 400)
        prompt_tokens, prompt_words = len(prompt), [f"t{t}" for t in prompt]
    else:
        return 400, error_body(
            "stand-in: 'prompt' must be a string or a non-empty list of token ids", "BadRequestError", 400, "prompt"
        )
    problem = _max_tokens_problem(body)
    if problem:
        return problem
    max_tokens = body.get("max_tokens") or COMPLETION_DEFAULT_MAX_TOKENS
    problem = _context_problem(cfg, prompt_tokens, max_tokens)
    if problem:
        return problem
    words = ["standin", "completion:", *reversed(prompt_words)]
    if body.get("ignore_eos") is True:
        words += ["more"] * max(0, max_tokens - len(words))
    finish = "length" if len(words) >= max_tokens else "stop"
    words = garbled(words[:max_tokens]) if wrong else words[:max_tokens]
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]
    return 200, {
        "id": f"cmpl-{digest}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": " " + " ".join(words), "logprobs": None, "finish_reason": finish, "stop_reason": None}
        ],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
                  "total_tokens": prompt_tokens + len(words)},
    }  # fmt: skip


def completion_stream_chunks(result: dict, include_usage: bool) -> list[dict]:
    """A completed ``/v1/completions`` result as vLLM's streamed ``text_completion`` chunks: one a token,
    the last one with the finish reason, then the usage when asked for."""
    base = {"id": result["id"], "object": "text_completion", "created": result["created"], "model": result["model"]}
    choice = result["choices"][0]
    words = choice["text"].split()
    chunks = []
    for i, word in enumerate(words):
        finish = choice["finish_reason"] if i == len(words) - 1 else None
        chunks.append(dict(base, choices=[{"index": 0, "text": " " + word, "logprobs": None,
                                           "finish_reason": finish, "stop_reason": None}]))  # fmt: skip
    if include_usage:
        chunks.append(dict(base, choices=[], usage=result["usage"]))
    return chunks


# Speculative decoding (--speculative-config): the stand-in's model of acceptance, so that the metrics, the
# benchmark's acceptance and speed-up and the release's floors have something to read. Each decode step
# drafts k tokens; draft position i is accepted (with all before it) with the unconditional rate
# ACCEPTANCE[i] (STANDIN_SPEC_ACCEPTANCE, comma-separated, overrides), and the step emits 1 + the accepted.
# A step with k drafts takes (1 + VERIFY_COST × k) plain steps: the drafter's passes and the wider verify.
# Greedy answers are what they are without speculation (vLLM's rejection sampling keeps the target's
# distribution; the stand-in's answers do not depend on it at all).
DEFAULT_ACCEPTANCE = (0.8, 0.6, 0.45, 0.3, 0.2)
VERIFY_COST = 0.1


def acceptance_rates(environ=os.environ) -> tuple[float, ...]:
    raw = environ.get("STANDIN_SPEC_ACCEPTANCE")
    return tuple(float(part) for part in raw.split(",")) if raw else DEFAULT_ACCEPTANCE


def speculative_steps(tokens: int, drafts: int, rates: tuple[float, ...], seed: str) -> list[int]:
    """The tokens each decode step emits (1 + accepted drafts) until `tokens` are out; seeded by the request."""
    rng = random.Random(seed)
    steps, left = [], tokens
    while left > 0:
        draw = rng.random()
        accepted = sum(1 for i in range(drafts) if draw < rates[min(i, len(rates) - 1)])
        steps.append(min(left, 1 + accepted))
        left -= steps[-1]
    return steps


def speculative_delays(delays: list[float], steps: list[int], step_seconds: float, drafts: int) -> list[float]:
    """`delays` (one decode step per token after the first) regrouped into `steps` of the tokens after the
    first (which comes from the prefill): the first token of a step after the step, the others with it."""
    starts, at = set(), 0
    for size in steps:
        starts.add(at)
        at += size
    timed = [index for index, delay in enumerate(delays) if delay]
    found = list(delays)
    for token, index in enumerate(timed[1:]):
        found[index] = step_seconds * (1 + VERIFY_COST * drafts) if token in starts else 0.0
    return found


def chunk_piece(chunk: dict) -> str | None:
    """The text a stream chunk carries (a token of the stand-in's), or None."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    delta = choices[0].get("delta") or {}
    return choices[0].get("text", delta.get("content") or delta.get("reasoning"))


def token_delays(chunks: list[dict], prompt_tokens: int, pace: Pace) -> list[float]:
    """How long before each chunk is sent: the first one that carries choices after the first token's
    time, each further one that carries text one decode step later, the rest at once."""
    delays, first = [], True
    for chunk in chunks:
        if not chunk.get("choices"):
            delays.append(0.0)
        elif first:
            delays.append(pace.first_token_seconds(prompt_tokens))
            first = False
        else:
            delays.append(pace.step_seconds if chunk_piece(chunk) else 0.0)
    return delays


def stream_chunks(result: dict, include_usage: bool) -> list[dict]:
    """Turn a completed chat completion into OpenAI ``chat.completion.chunk`` events."""
    base = {
        "id": result["id"],
        "object": "chat.completion.chunk",
        "created": result["created"],
        "model": result["model"],
    }
    choice = result["choices"][0]
    chunks = [dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]
    for field in ("reasoning", "content"):  # vLLM 0.25 streams a reasoning parser's thinking as `reasoning`
        for i, w in enumerate((choice["message"][field] or "").split()):
            piece = w if i == 0 else " " + w
            chunks.append(dict(base, choices=[{"index": 0, "delta": {field: piece}, "finish_reason": None}]))
    for index, call in enumerate(choice["message"].get("tool_calls") or []):
        delta = {"tool_calls": [{"index": index, **call}]}
        chunks.append(dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": None}]))
    chunks.append(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]))
    if include_usage:
        chunks.append(dict(base, choices=[], usage=result["usage"]))
    return chunks


# vLLM's buckets (vllm/v1/metrics/loggers.py) for the histograms the stand-in keeps.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip


FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM 0.25's, every one always shown


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, metric: str, name: str) -> list[str]:
        """Its rows as vLLM's /metrics has them (labels in prometheus_client's order: by name)."""
        labels = f'{{engine="0",model_name="{name}"}}'
        bounds = [*(str(bound) for bound in self.buckets), "+Inf"]
        rows = [
            f'{metric}_bucket{{engine="0",le="{bound}",model_name="{name}"}} {float(n)}'
            for bound, n in zip(bounds, [*self.counts, self.count], strict=True)
        ]
        return [*rows, f"{metric}_count{labels} {float(self.count)}", f"{metric}_sum{labels} {self.sum}"]


KV_POOL_SEQUENCES = 16
# vLLM's max_num_batched_tokens on a GPU of 70 GiB or more (engine/arg_utils.py: 8192 for the API server): a prompt
# is prefilled in chunks of at most this many tokens, one engine step each (STANDIN_PREFILL_CHUNK_TOKENS).
PREFILL_CHUNK_TOKENS = 8192
STEP_FRESH_SECONDS = 0.25  # the engine core steps every 0.05 s; older than this, it has stopped stepping


class InFlight:
    """One request in the engine, as vLLM's counters see it: its prompt prefilled chunk by chunk (each chunk's KV
    blocks taken as it is scheduled), the prompt counted once its first token comes, then one token a decode step
    (vllm/v1/metrics/stats.py IterationStats.update_from_output). Every wait is the engine's work: it does not
    advance while the engine does not step."""

    def __init__(self, state: ServerState, prompt_tokens: int):
        self.state, self.prompt_tokens = state, prompt_tokens
        self.arrived = time.monotonic()
        self.held = 0  # KV cache tokens it holds
        self.generated = 0
        self.prefilled = False

    def advance(self, delay: float, carries_token: bool) -> None:
        state = self.state
        if self.arrived is not None:  # scheduled by a step after it arrived: none comes from a stopped engine
            state.engine_work(0.0, since=self.arrived)
            self.arrived = None
        if not self.prefilled and delay:
            prefill = self.prompt_tokens / state.pace.prefill_tokens_per_second
            chunks = max(1, -(-self.prompt_tokens // state.prefill_chunk))
            for index in range(chunks):
                state.engine_work(prefill / chunks)
                size = max(0, min(state.prefill_chunk, self.prompt_tokens - index * state.prefill_chunk))
                self.hold(size)
            with state.lock:
                state.prompt_tokens_total += self.prompt_tokens
            self.prefilled, delay = True, max(0.0, delay - prefill)
        state.engine_work(delay)
        if carries_token:
            self.hold(1)
            self.generated += 1
            with state.lock:
                state.generation_tokens_total += 1

    def hold(self, tokens: int) -> None:
        with self.state.lock:
            self.state.cached_tokens += tokens
        self.held += tokens

    def done(self, usage: dict, counted: bool) -> None:
        """It leaves the engine: its blocks freed; counted, what it generated without a step of its own is too."""
        with self.state.lock:
            self.state.cached_tokens -= self.held
            if counted:
                self.state.generation_tokens_total += max(0, usage["completion_tokens"] - self.generated)
                if not self.prefilled:
                    self.state.prompt_tokens_total += usage["prompt_tokens"]


class ServerState:
    """Shared between the HTTP threads and the engine monitor; counts what vLLM's /metrics counts, under
    vLLM's metric names (vllm/v1/metrics/loggers.py)."""

    def __init__(self, cfg: ServeConfig, pace: Pace | None = None):
        self.cfg = cfg
        self.pace = pace or Pace()
        self.created = int(time.time())
        self.engine_alive = True
        self.lock = threading.Lock()
        self.running = 0
        # The KV cache the running requests hold, in tokens, out of a pool of KV_POOL_SEQUENCES full-length
        # sequences (vLLM's vllm:kv_cache_usage_perc: the fraction of its KV cache blocks in use, 0..1).
        self.cached_tokens = 0
        self.kv_pool_tokens = KV_POOL_SEQUENCES * cfg.max_model_len
        self.requests_total: dict[str, int] = {}  # by finished_reason
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        # speculative decoding's counters (vllm/v1/spec_decode/metrics.py SpecDecodingProm)
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted = 0
        self.spec_accepted_per_pos = [0] * ((cfg.speculative or {}).get("num_speculative_tokens") or 0)
        self.prefill_chunk = PREFILL_CHUNK_TOKENS
        # The engine core's steps (cli.py feeds them): when it last stepped, None with no engine core attached
        # (always stepping); the gauges as of that step, as vLLM sets them from the step's scheduler stats.
        self.engine_stepped: float | None = None
        self.shown = (0, 0)  # running, cached tokens
        # GET /load (vllm/entrypoints/serve/instrumentator/basic.py): with --enable-server-load-tracking the
        # generating requests the API server holds, counted in as they arrive and out once answered (utils/
        # api_utils.py load_aware_call), whatever the engine does; 0 without it
        self.server_load = 0

    def stepped(self) -> None:
        """The engine core made a step."""
        with self.lock:
            self.engine_stepped = time.monotonic()
            self.shown = (self.running, self.cached_tokens)

    def engine_work(self, seconds: float, since: float | None = None) -> None:
        """`seconds` of the engine's work, and then for as long as it does not step (a hang, a stopped engine core,
        a collective waiting on a rank): a request does not move while its engine does not. `since`: a step must
        come after this moment too (a request that just arrived is first scheduled by the engine's next step)."""
        if seconds:
            time.sleep(seconds)
        while self.engine_stepped is not None and (
            time.monotonic() - self.engine_stepped > STEP_FRESH_SECONDS or (since and self.engine_stepped < since)
        ):
            time.sleep(0.02)

    def speculate(self, delays: list[float], seed: str) -> list[float]:
        """With --speculative-config: the request's tokens after the first in decode steps of 1 + accepted
        drafts, counted as vLLM counts them, and its delays regrouped; without: `delays` as they are."""
        spec = self.cfg.speculative
        if not spec:
            return delays
        drafts = spec["num_speculative_tokens"]
        tokens = max(0, sum(1 for delay in delays if delay) - 1)
        steps = speculative_steps(tokens, drafts, acceptance_rates(), seed)
        with self.lock:
            self.spec_drafts += len(steps)
            self.spec_draft_tokens += drafts * len(steps)
            self.spec_accepted += sum(size - 1 for size in steps)
            for size in steps:
                for position in range(size - 1):
                    self.spec_accepted_per_pos[position] += 1
        return speculative_delays(delays, steps, self.pace.step_seconds, drafts)

    def finished(self, finish: str, ttft: float, itls: list[float], e2e: float) -> None:
        with self.lock:
            self.requests_total[finish] = self.requests_total.get(finish, 0) + 1
            self.ttft.observe(ttft)
            for gap in itls:
                self.itl.observe(gap)
            self.e2e.observe(e2e)

    def metrics_text(self) -> str:
        name = self.cfg.served_model_names[0]
        lbl = f'{{engine="0",model_name="{name}"}}'
        out: list[str] = []

        def head(metric: str, kind: str, help_: str) -> None:
            out.extend([f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}"])

        with self.lock:
            running, cached = (self.running, self.cached_tokens) if self.engine_stepped is None else self.shown
            head("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")
            out.append(f"vllm:num_requests_running{lbl} {float(running)}")
            head("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
            out.append(f"vllm:num_requests_waiting{lbl} 0.0")
            head("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
            out.append(f"vllm:kv_cache_usage_perc{lbl} {min(1.0, cached / self.kv_pool_tokens)}")
            head("vllm:request_success_total", "counter", "Count of successfully processed requests.")
            for reason in FINISHED_REASONS:
                out.append(
                    f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{name}"}} '
                    f"{float(self.requests_total.get(reason, 0))}"
                )
            head("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
            out.append(f"vllm:prompt_tokens_total{lbl} {float(self.prompt_tokens_total)}")
            head("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.")
            out.append(f"vllm:generation_tokens_total{lbl} {float(self.generation_tokens_total)}")
            for metric, hist, help_ in (
                ("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds."),
                ("vllm:inter_token_latency_seconds", self.itl, "Histogram of inter-token latency in seconds."),
                ("vllm:e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency in seconds."),
            ):
                head(metric, "histogram", help_)
                out.extend(hist.lines(metric, name))
            if self.cfg.speculative:
                for metric, value, help_ in (
                    ("vllm:spec_decode_num_drafts_total", self.spec_drafts, "Number of spec decoding drafts."),
                    ("vllm:spec_decode_num_draft_tokens_total", self.spec_draft_tokens, "Number of draft tokens."),
                    ("vllm:spec_decode_num_accepted_tokens_total", self.spec_accepted, "Number of accepted tokens."),
                ):
                    head(metric, "counter", help_)
                    out.append(f"{metric}{lbl} {float(value)}")
                metric = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                head(metric, "counter", "Accepted tokens per draft position.")
                for position, value in enumerate(self.spec_accepted_per_pos):
                    out.append(f'{metric}{{engine="0",model_name="{name}",position="{position}"}} {float(value)}')
        return "\n".join(out) + "\n"


def make_handler(state: ServerState):
    cfg = state.cfg

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"
        sys_version = ""

        def log_message(self, format, *args):  # noqa: A002 - stdlib signature
            pass

        def _send(self, status: int, body: bytes = b"", ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if body and self.command != "HEAD":
                self.wfile.write(body)
            try:
                phrase = HTTPStatus(status).phrase
            except ValueError:
                phrase = ""
            log.uvicorn(
                '%s:%s - "%s %s HTTP/1.1" %d %s',
                self.client_address[0],
                self.client_address[1],
                self.command,
                self.path,
                status,
                phrase,
            )

        def _json(self, status: int, obj: object) -> None:
            self._send(status, json.dumps(obj).encode())

        def _authorized(self) -> bool:
            if is_authorized(self.path, self.headers.get("Authorization"), cfg.api_key, self.command):
                return True
            self._json(401, {"error": "Unauthorized"})
            return False

        def do_GET(self):  # noqa: N802 - stdlib name
            path = self.path.split("?", 1)[0]
            if not self._authorized():
                return
            if path == "/health":
                self._send(200 if state.engine_alive else 503, b"")
            elif path == "/ping":
                self._send(200 if state.engine_alive else 503, b"")
            elif path == "/version":
                self._json(200, {"version": __version__})
            elif path == "/metrics":
                self._send(200, state.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/load":
                self._json(200, {"server_load": state.server_load})
            elif path in PLAYED.keyless_routes_added:  # /kv_event_sources: no KV events published here
                self._json(200, {})
            elif path == "/v1/models":
                self._json(200, models_payload(cfg, state.created))
            elif path == "/v1/chat/completions":
                self._json(405, {"detail": "Method Not Allowed"})
            else:
                self._json(404, {"detail": "Not Found"})

        def _event(self, event: str) -> None:
            data = b"data: " + event.encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _stream(self, chunks: list[dict], delays: list[float], generated, request: InFlight) -> None:
            """Server-sent events, each chunk sent when its time comes (chunked, as uvicorn sends them).
            ``generated`` runs once the last chunk is out and before ``[DONE]``: vLLM's engine has counted a
            request by the time its stream ends (vllm/v1/engine/async_llm.py: the output handler records a step's
            stats in the pass that hands its outputs to the requests' queues, before the API server's task can
            end the stream), so a client that reads /metrics after the stream sees it."""
            self.send_response(200)
            self.send_header("content-type", "text/event-stream; charset=utf-8")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for chunk, delay in zip(chunks, delays, strict=True):
                request.advance(delay, bool(chunk_piece(chunk)))
                self._event(json.dumps(chunk))
            generated()
            self._event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            log.uvicorn('%s:%s - "POST %s HTTP/1.1" 200 OK', self.client_address[0], self.client_address[1], self.path)

        def do_POST(self):  # noqa: N802 - stdlib name
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not self._authorized():
                return
            refused = PLAYED.render_refusal(cfg.scale_out) if path == "/v1/chat/completions/render" else None
            if refused == 403:  # vllm/entrypoints/scale_out/factories.py (0.32 on): the route says why
                message = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
                self._json(403, error_body(message, "PermissionDeniedError", 403))
                return
            if refused == 404:  # 0.30-0.31: not mounted
                self._json(404, {"detail": "Not Found"})
                return
            if path in ("/v1/chat/completions/render", "/tokenize", "/detokenize"):
                try:
                    body = json.loads(raw or b"null")
                except ValueError as e:
                    self._json(400, error_body(f"invalid JSON body: {e}", "BadRequestError", 400))
                    return
                answer = {"/tokenize": lambda: tokenize(body, cfg), "/detokenize": lambda: detokenize(body)}
                self._json(*answer.get(path, lambda: render_chat(body, cfg))())
                return
            if path in DEV_MODE_ROUTES and dev_mode():
                self._json(200, {"path": path, "dev_mode": True})
                return
            if path == "/invocations":  # the SageMaker route: a chat body if it has messages, else completions
                try:
                    path = "/v1/chat/completions" if "messages" in json.loads(raw or b"null") else "/v1/completions"
                except (ValueError, TypeError):
                    self._json(400, error_body("invalid JSON body", "BadRequestError", 400))
                    return
            if path not in ("/v1/chat/completions", "/v1/completions"):
                if path in ("/health", "/version", "/metrics", "/v1/models"):
                    self._json(405, {"detail": "Method Not Allowed"})
                else:
                    self._json(404, {"detail": "Not Found"})
                return
            if not state.engine_alive:
                self._json(
                    500,
                    error_body(
                        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                        "InternalServerError",
                        500,
                    ),
                )
                return
            try:
                body = json.loads(raw or b"null")
            except ValueError as e:
                self._json(400, error_body(f"invalid JSON body: {e}", "BadRequestError", 400))
                return
            chat = path == "/v1/chat/completions"
            status, result = (chat_completion if chat else completion)(body, cfg, int(time.time()), fault() == "wrong")
            if status != 200:
                self._json(status, result)
                return
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = (stream_chunks if chat else completion_stream_chunks)(result, include_usage)
            delays = token_delays(chunks, result["usage"]["prompt_tokens"], state.pace)
            delays = state.speculate(delays, hashlib.sha256(raw).hexdigest())
            began = time.monotonic()
            request = InFlight(state, result["usage"]["prompt_tokens"])
            done = []

            def generated(counted: bool = True) -> None:
                """The request leaves the engine, once: counted (``counted``) before its last bytes reach the
                client; a client gone mid-stream only frees its room, as before."""
                if done:
                    return
                done.append(True)
                with state.lock:
                    state.running -= 1
                    state.server_load -= 1 if cfg.load_tracking else 0
                request.done(result["usage"], counted)
                if not counted:
                    return
                timed = [d for d in delays if d]
                finish = result["choices"][0]["finish_reason"]
                state.finished(finish, timed[0] if timed else 0.0, timed[1:], time.monotonic() - began)

            with state.lock:
                state.running += 1
                state.server_load += 1 if cfg.load_tracking else 0
            try:
                if body.get("stream"):
                    self._stream(chunks, delays, generated, request)
                else:
                    for chunk, delay in zip(chunks, delays, strict=True):
                        request.advance(delay, bool(chunk_piece(chunk)))
                    generated()
                    self._json(200, result)
            finally:
                generated(counted=False)

    return Handler


def make_server(state: ServerState) -> ThreadingHTTPServer:
    """Bind ``--host``/``--port`` (raises OSError when the address is taken)."""
    host = state.cfg.host

    class Server(ThreadingHTTPServer):
        allow_reuse_address = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def server_bind(self):
            # uvicorn binds and asks no resolver; http.server's bind looks the address's name up (socket.getfqdn),
            # which held every start 10 s on the simulated nodes (a name server that never answered, 2026-12-07)
            socketserver.TCPServer.server_bind(self)
            self.server_name, self.server_port = self.server_address[:2]

        def get_request(self):
            # TCP_NODELAY on every connection, as vLLM's server has it (uvicorn on asyncio, whose TCP transports
            # set it: cpython Lib/asyncio/selector_events.py _set_nodelay). Without it a kept-alive connection
            # waits out the client's delayed ACK (40 ms) between the small writes of a streamed answer.
            conn, address = super().get_request()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn, address

    server = Server((host, state.cfg.port), make_handler(state))
    server.daemon_threads = True
    return server
