# Serving that stops while /health is green, told from vLLM's own counters and answers (supervisor.py
# and router_keeper.py import it), and the GET both read it with. Standard library
# only, no side effects.
#
# Stalled. vLLM 0.25's engine core sends its scheduler's figures after every step, and the API server sets its
# Prometheus gauges and counters from them (v1/core/sched/scheduler.py update_from_output → make_stats: "We must
# return the stats even if there are no request outputs this step"; v1/engine/async_llm.py output_handler →
# v1/metrics/loggers.py PrometheusStatLogger.record). So these move only while the engine steps:
# vllm:num_requests_running and _waiting, vllm:kv_cache_usage_perc (the scheduler allocates each prefill chunk's
# blocks as it schedules it, so a long chunked prefill moves it at every chunk), vllm:generation_tokens_total
# (every decode step) and vllm:prompt_tokens_total (once a prompt's prefill is done). Requests running or waiting
# while none of them moved for stall_seconds: the engine does not step (a process stopped, a collective waiting on
# a rank for good), while /health, answered by the API server alone, stays 200. A request that arrives at an engine
# already stuck never reaches its scheduler, so the gauges say nothing runs: the API server's own count of the
# requests it holds (/load, with --enable-server-load-tracking, which the program sets: vllm/entrypoints/serve/
# instrumentator/basic.py and utils/api_utils.py load_aware_call) counts them too. The one honest step that moves
# nothing for long is a single engine step longer than stall_seconds: a prefill chunk (max_num_batched_tokens:
# 8192 on a GPU of 70 GiB or more, a GB10's included; engine/arg_utils.py) at the end of a very long context.
#
# Wrong. The canary is one short greedy completion (temperature 0, the same prompt, the same engine settings: the
# same fingerprint), asked while nothing else runs, its token ids and each position's margin between the first and
# second most likely token (top_logprobs 2). vLLM does not promise the same tokens under another batch (it is not
# batch invariant by default: other kernels and reduction orders at other batch sizes), so the canary is asked only
# with nothing else running, as its reference was; and a near tie may flip on any change of the arithmetic, so the
# comparison stops at the first position whose reference margin is under NEAR_TIE_NATS: a different token before
# it is wrong numerics. One differing answer is asked again at once; two in a row end vLLM.
import json
import urllib.error
import urllib.request

NEAR_TIE_NATS = 1.0  # in bf16 a logit moves by ~1e-2 between kernels; a flip needs a margin near that, not 1 nat
CANARY_PROMPT = "Count from one to twenty in words, separated by commas:"
CANARY_TOKENS = 8
PROGRESS_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
)


def http_get(url, timeout):
    """(status, body text) of a GET; (None, reason) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, ""
    except (OSError, ValueError) as error:
        return None, str(error)


def read_metrics(text, names=PROGRESS_METRICS):
    """{name: value summed over its label sets} of `names` in Prometheus' text format (every engine of a vLLM)."""
    found = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in names:
            continue
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        found[name] = found.get(name, 0.0) + value
    return found


class HealthWatch:
    """A worker's /health, pass after pass (the router's keeper): gone once it missed `misses` passes in a row, back
    with its first 200. One slow answer on a loaded node is not a replica gone: taken out for it, the replica beside
    it being drained for a rolling change, the model would have no replica in the router at all."""

    def __init__(self, misses=2):
        self.misses, self.missed = misses, 0

    def see(self, healthy):
        """Whether the worker is gone, after this pass's answer (`healthy`: /health 200)."""
        self.missed = 0 if healthy else self.missed + 1
        return self.missed >= self.misses


class StallWatch:
    """Whether a vLLM's counters say it stalled: `see(now, metrics)` with each reading of its /metrics."""

    def __init__(self, stall_seconds):
        self.stall_seconds = stall_seconds
        self.last = None  # the progress counters as last read
        self.moved_at = None  # when they last moved, or the first reading with requests on it since it was idle

    def see(self, now, metrics, load=0):
        """None while it moves (or has nothing to do); the reason, once requests wait on it for stall_seconds
        with nothing moving. `load`: the requests the API server holds (/load), 0 where unknown.

        The clock runs only while requests are on it: a replica idle for minutes keeps its counters still, and
        the request that then arrives is counted by /load before the engine's first step moves a gauge; counted
        from the idle minutes, that request would read as a stall (both of a model's replicas taken out of the
        router at the first request after a pause)."""
        progress = tuple(metrics.get(name) for name in PROGRESS_METRICS)
        engine = (metrics.get("vllm:num_requests_running") or 0) + (metrics.get("vllm:num_requests_waiting") or 0)
        busy = max(engine, load or 0)
        if busy <= 0:
            self.reset()  # nothing waits on it: no stall is being counted
            return None
        if progress != self.last or self.moved_at is None:
            self.last, self.moved_at = progress, now
            return None
        if now - self.moved_at < self.stall_seconds:
            return None
        return (
            f"{busy:g} request(s) running or waiting and none of vLLM's progress counters moved for "
            f"{now - self.moved_at:.0f} s (vllm.stallSeconds {self.stall_seconds:g}): "
            + ", ".join(f"{name.split(':', 1)[1]} {metrics.get(name, 0):g}" for name in PROGRESS_METRICS)
            + f", server_load {load or 0:g}"
        )

    def reset(self):
        self.last, self.moved_at = None, None


def read_load(text):
    """The requests the API server holds, from /load's {"server_load": N}; 0 where it says nothing."""
    try:
        found = json.loads(text).get("server_load")
    except (ValueError, AttributeError):
        return 0
    return found if isinstance(found, (int, float)) and not isinstance(found, bool) else 0


def canary_request(model):
    """The canary's body for /v1/chat/completions."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": CANARY_PROMPT}],
        "max_tokens": CANARY_TOKENS,
        "temperature": 0,
        "seed": 0,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 2,
    }


def canary_answer(body):
    """{"tokenIds", "margins", "text"} of a canary's answer (margins None where the server gave no logprobs)."""
    choice = (body.get("choices") or [{}])[0]
    ids = choice.get("token_ids")
    margins = None
    content = (choice.get("logprobs") or {}).get("content")
    if isinstance(content, list):
        margins = []
        for entry in content:
            tops = sorted((t.get("logprob", 0.0) for t in entry.get("top_logprobs") or []), reverse=True)
            margins.append(tops[0] - tops[1] if len(tops) >= 2 else None)
    text = (choice.get("message") or {}).get("content") or ""
    return {"tokenIds": list(ids) if isinstance(ids, list) else None, "margins": margins, "text": text}


def canary_difference(reference, answer):
    """The first position where `answer` differs from `reference` before the reference's first near tie, as
    {"at", "expected", "found", "compared"}; None when they agree there. Without margins only the first token
    is compared (a near tie cannot be ruled out further on)."""
    expected, found = reference.get("tokenIds") or [], answer.get("tokenIds") or []
    margins = reference.get("margins")
    compared = 0
    for at, token in enumerate(expected):
        margin = margins[at] if margins and at < len(margins) else None
        if (margins is None and at > 0) or (margins is not None and (margin is None or margin < NEAR_TIE_NATS)):
            break
        compared = at + 1
        if at >= len(found) or found[at] != token:
            return {"at": at, "expected": token, "found": found[at] if at < len(found) else None, "compared": compared}
    return None
