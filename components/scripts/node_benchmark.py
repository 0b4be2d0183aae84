# Runs inside the head's container (`docker exec -i … python3 -`), its parameters in the
# program (node_params.py). A short fixed load against vLLM's /v1/completions, streamed so that
# the time to first token is real: the image's `vllm bench serve` (random dataset) when PARAMS["tool"]
# says so (or "auto" finds it), else a load of its own (threads, standard library). Prints one JSON line
# of figures (they become the `benchmark` stack output and part of the release) and exits 1 when more
# requests failed than PARAMS["max_errors"]. With speculative decoding on, vLLM's spec_decode counters
# (/metrics) before and after the load give its acceptance: rate, mean acceptance length, per position.
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from components.scripts.node_contract import BenchmarkFigures, BenchmarkParams
from components.scripts.node_params import given
from components.scripts.node_timing import polls

P = BenchmarkParams.from_json(given())
TOKEN_IDS = range(32, 256)  # in every tokenizer's vocabulary (byte-level BPE and SentencePiece byte tokens sit here)


def percentile(values, q):
    """numpy's default (linear) percentile, which `vllm bench serve` reports."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ms(value):
    return None if value is None else round(value * 1000, 2)


SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draftTokens",
    "vllm:spec_decode_num_accepted_tokens_total": "acceptedTokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def metrics_text(timeout=30):
    """vLLM's /metrics now (None where it cannot be read)."""
    request = urllib.request.Request(P.base_url + "/metrics")
    if P.api_key:
        request.add_header("Authorization", f"Bearer {P.api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read().decode(errors="replace")
    except (OSError, ValueError):
        return None


def spec_counters():
    """vLLM's speculative-decoding counters now, summed over their series ({} without speculation, or where
    /metrics cannot be read); per position keyed by its `position` label."""
    text = metrics_text()
    if text is None:
        return {}
    found = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_"):
            continue
        series, _, number = line.rpartition(" ")
        name, _, rest = series.partition("{")
        try:
            value = float(number)
        except ValueError:
            continue
        if name in SPEC_COUNTERS:
            found[SPEC_COUNTERS[name]] = found.get(SPEC_COUNTERS[name], 0.0) + value
        elif name == PER_POSITION:
            position = rest.split('position="', 1)[1].split('"', 1)[0] if 'position="' in rest else "?"
            positions = found.setdefault("perPosition", {})
            positions[position] = positions.get(position, 0.0) + value
    return found


def acceptance(before, after):
    """The load's acceptance from two readings of the counters (None when nothing was drafted)."""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in SPEC_COUNTERS.values()}
    if delta["drafts"] <= 0 or delta["draftTokens"] <= 0:
        return None
    positions = after.get("perPosition") or {}
    per_position = [
        round((positions[key] - (before.get("perPosition") or {}).get(key, 0.0)) / delta["drafts"], 4)
        for key in sorted(positions, key=lambda k: int(k) if k.isdigit() else 1 << 30)
    ]
    return {
        "drafts": int(delta["drafts"]),
        "draftTokens": int(delta["draftTokens"]),
        "acceptedTokens": int(delta["acceptedTokens"]),
        "acceptanceRate": round(delta["acceptedTokens"] / delta["draftTokens"], 4),
        "meanAcceptanceLength": round(1 + delta["acceptedTokens"] / delta["drafts"], 3),
        "acceptedPerPosition": per_position,
    }


def one_request(index):
    """One streamed completion: (ttft, [inter-token gaps], output tokens, error or None, time per output
    token after the first)."""
    rng = random.Random(index)
    body = {
        "model": P.model,
        "prompt": [rng.choice(TOKEN_IDS) for _ in range(P.prompt_tokens)],
        "max_tokens": P.output_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(P.base_url + "/v1/completions", data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if P.api_key:
        request.add_header("Authorization", f"Bearer {P.api_key}")
    start = time.perf_counter()
    ttft, last, gaps, tokens = None, start, [], 0
    try:
        with urllib.request.urlopen(request, timeout=P.timeout_seconds) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("choices"):
                    if ttft is None:
                        ttft = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens") or 0
    except urllib.error.HTTPError as error:
        return None, [], 0, f"HTTP {error.code}: {error.read()[:300].decode(errors='replace')}", None
    except (OSError, ValueError) as error:
        return None, [], 0, f"{type(error).__name__}: {error}", None
    if ttft is None:
        return None, [], 0, "the stream carried no token", None
    # `vllm bench serve`'s TPOT: the time after the first token over the tokens after it (with speculation
    # a chunk carries several tokens, so the gaps between chunks are not the time per token)
    tpot = (last - start - ttft) / (tokens - 1) if tokens > 1 else None
    return ttft, gaps, tokens, None, tpot


def own_load():
    # One request first, not counted, as `vllm bench serve` sends its "initial test run": the server's
    # first request of a shape pays for paths not warmed yet, which would land in the p99 TTFT.
    warmup = one_request(-1)
    results = [None] * P.requests
    lock = threading.Lock()
    queue = iter(range(P.requests))

    def worker():
        while True:
            with lock:
                index = next(queue, None)
            if index is None:
                return
            results[index] = one_request(index)

    threads = [threading.Thread(target=worker) for _ in range(min(P.concurrency, P.requests))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    duration = time.perf_counter() - start
    done = [r for r in results if r[3] is None]
    ttfts = [r[0] for r in done]
    gaps = [gap for r in done for gap in r[1]]
    tpots = [r[4] for r in done if r[4] is not None]
    return {
        "tool": "spark-vllm",
        "warmup": warmup[3] or "ok",
        "durationSeconds": round(duration, 3),
        "completed": len(done),
        "errors": len(results) - len(done),
        "errorSamples": sorted({r[3] for r in results if r[3] is not None})[:3],
        "outputTokens": sum(r[2] for r in done),
        "outputTokensPerSecond": round(sum(r[2] for r in done) / duration, 2),
        "requestsPerSecond": round(len(done) / duration, 3),
        "ttftMs": {"p50": ms(percentile(ttfts, 50)), "p99": ms(percentile(ttfts, 99))},
        "itlMs": {"p50": ms(percentile(gaps, 50)), "p99": ms(percentile(gaps, 99))},
        "tpotMs": {"p50": ms(percentile(tpots, 50)), "p99": ms(percentile(tpots, 99))},
    }


def vllm_bench_argv(result_dir):
    return [
        "vllm", "bench", "serve", "--backend", "openai", "--base-url", P.base_url, "--endpoint", "/v1/completions",
        "--model", P.model_path, "--served-model-name", P.model, "--dataset-name", "random",
        "--random-input-len", str(P.prompt_tokens), "--random-output-len", str(P.output_tokens),
        "--num-prompts", str(P.requests), "--max-concurrency", str(P.concurrency), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
        "--result-dir", result_dir, "--result-filename", "result.json", "--disable-tqdm",
        *(["--trust-remote-code"] if P.trust_remote_code else []),
    ]  # fmt: skip


def vllm_bench():
    """`vllm bench serve`'s own figures (its saved result file), in this script's shape. The API key
    travels in OPENAI_API_KEY, where vllm bench reads it (never on its command line)."""
    env = dict(os.environ)
    if P.api_key:
        env["OPENAI_API_KEY"] = P.api_key
    with tempfile.TemporaryDirectory() as result_dir:
        run = subprocess.run(
            vllm_bench_argv(result_dir), env=env, capture_output=True, text=True, timeout=P.timeout_seconds
        )
        path = os.path.join(result_dir, "result.json")
        if run.returncode != 0 or not os.path.exists(path):
            tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-20:])
            print(f"benchmark failed: `vllm bench serve` exited {run.returncode}:\n{tail}")
            sys.exit(1)
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    errors = [e for e in result.get("errors") or [] if e]
    return {
        "tool": "vllm bench serve",
        "durationSeconds": round(result["duration"], 3),
        "completed": result["completed"],
        "errors": result.get("failed", len(errors)),
        "errorSamples": sorted({e.strip().splitlines()[-1][:300] for e in errors})[:3],
        "outputTokens": result["total_output_tokens"],
        "outputTokensPerSecond": round(result["output_throughput"], 2),
        "requestsPerSecond": round(result["request_throughput"], 3),
        "ttftMs": {"p50": round(result["p50_ttft_ms"], 2), "p99": round(result["p99_ttft_ms"], 2)},
        "itlMs": {"p50": round(result["p50_itl_ms"], 2), "p99": round(result["p99_itl_ms"], 2)},
        "tpotMs": {"p50": _rounded(result.get("p50_tpot_ms")), "p99": _rounded(result.get("p99_tpot_ms"))},
    }


def _rounded(value):
    return None if value is None else round(value, 2)


def has_vllm_bench():
    if shutil.which("vllm") is None:
        return False
    try:
        probe = subprocess.run(["vllm", "bench", "serve", "--help"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def hold_the_canary():
    """While the load runs the supervisor asks no canary (node_vllm_watch.py reads this file): its tokens would count
    in the figures (MTP's acceptance comes from vLLM's counters, whoever asked). A canary already asked is waited
    for: nothing running or waiting in vLLM, twice in a row, at most 30 s."""
    if not P.measuring_file:
        return
    try:  # whole or not at all: the supervisor reads an empty file as no benchmark (seen in CI, 2026-12-06)
        with open(P.measuring_file + ".tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(P.measuring_file + ".tmp", P.measuring_file)
    except OSError:
        return
    idle = 0
    for _ in polls(30, 0.2):
        idle = idle + 1 if requests_in_vllm() == 0 else 0
        if idle >= 2:
            return


def let_the_canary_go():
    if P.measuring_file:
        try:
            os.unlink(P.measuring_file)
        except OSError:
            pass


def requests_in_vllm():
    """Requests running or waiting in vLLM now (its gauges on /metrics; None where it cannot say)."""
    text = metrics_text(timeout=10)
    if text is None:
        return None
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(gauges):
            try:
                total += float(line.rpartition(" ")[2])
            except ValueError:
                pass
    return total


tool = P.tool
if tool == "auto":
    tool = "vllm" if has_vllm_bench() else "spark-vllm"
hold_the_canary()
try:
    counters_before = spec_counters()
    figures = vllm_bench() if tool == "vllm" else own_load()
    speculative = acceptance(counters_before, spec_counters())
finally:
    let_the_canary_go()
if speculative is not None:
    figures["speculative"] = speculative
figures["settings"] = {"concurrency": P.concurrency, "requests": P.requests, "promptTokens": P.prompt_tokens,
                       "outputTokens": P.output_tokens}  # fmt: skip
print(json.dumps(BenchmarkFigures(**figures).to_json()))
if figures["errors"] > P.max_errors:
    print(
        f"benchmark failed: {figures['errors']} of {P.requests} requests failed (benchmark.maxErrors "
        f"{P.max_errors}); first errors: {figures['errorSamples']}"
    )
    sys.exit(1)
