"""``vllm bench serve`` stand-in: vLLM's serving benchmark (vllm/benchmarks/serve.py, 0.25.0) as far as the program
drives it (components/scripts/node_benchmark.py): the openai backend against /v1/completions, the random dataset,
a fixed number of prompts at most --max-concurrency at a time, streamed, and the result saved as vLLM saves it
(`duration`, `completed`, `failed`, the token totals and throughputs, `errors`, and for each of
--percentile-metrics the mean_/median_/p{N}_ keys in milliseconds). An initial single request goes first, not
counted, as vLLM's "initial test run" does. The key comes from OPENAI_API_KEY, as vLLM's reads it.

Pure standard library. Flags it does not know are refused (argparse, exit 2), as vLLM refuses unknown ones.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def add_parser(sub) -> None:
    """`bench serve`'s flags (vllm/benchmarks/serve.py add_cli_args, datasets/datasets.py), those the program uses."""
    bench = sub.add_parser("bench", prog="vllm bench", allow_abbrev=False, help="vLLM's benchmarks (stand-in).")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="{serve}")
    kinds.required = True
    p = kinds.add_parser("serve", prog="vllm bench serve", allow_abbrev=False)
    p.add_argument("--backend", default="openai", choices=("openai", "vllm"))
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dataset-name", default="random", choices=("random",))
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--seed", type=int, default=0)


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, which vLLM's benchmark reports."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _one(ns: argparse.Namespace, base: str, prompt: str) -> dict:
    """One streamed completion: its first-token time, the gaps between chunks, its output tokens, or its error."""
    body = {"model": ns.served_model_name or ns.model, "prompt": prompt, "max_tokens": ns.random_output_len,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
            "ignore_eos": bool(ns.ignore_eos)}  # fmt: skip
    request = urllib.request.Request(base + ns.endpoint, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if os.environ.get("OPENAI_API_KEY"):
        request.add_header("Authorization", f"Bearer {os.environ['OPENAI_API_KEY']}")
    started = time.perf_counter()
    found = {"ttft": 0.0, "itl": [], "output": 0, "latency": 0.0, "error": "", "start": started}
    last = started
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            for raw in answer:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    found["output"] = chunk["usage"].get("completion_tokens") or 0
                if not any(choice.get("text") for choice in chunk.get("choices") or []):
                    continue
                now = time.perf_counter()
                if found["ttft"] == 0.0:
                    found["ttft"] = now - started
                else:
                    found["itl"].append(now - last)
                last = now
        found["latency"] = time.perf_counter() - started
    except (OSError, urllib.error.HTTPError, ValueError) as error:
        found["error"] = f"{type(error).__name__}: {error}"
    return found


def run(ns: argparse.Namespace) -> int:
    base = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    words = random.Random(ns.seed)
    prompts = [
        " ".join(f"w{words.randrange(10000)}" for _ in range(ns.random_input_len)) for _ in range(ns.num_prompts)
    ]
    print("Starting initial single prompt test run...")
    first = _one(ns, base, prompts[0])
    if first["error"]:
        print(f"Initial test run failed - Please make sure benchmark arguments are correctly specified. Error: "
              f"{first['error']}")  # fmt: skip
        return 1
    print("Initial test run completed.")
    started = time.perf_counter()
    lock, outputs = threading.Lock(), []

    def send(prompt: str) -> None:
        result = _one(ns, base, prompt)
        with lock:
            outputs.append(result)

    with ThreadPoolExecutor(max_workers=ns.max_concurrency or len(prompts)) as pool:
        list(pool.map(send, prompts))
    duration = time.perf_counter() - started
    done = [o for o in outputs if not o["error"]]
    output_tokens = sum(o["output"] for o in done)
    result = {
        "duration": duration, "completed": len(done), "failed": len(outputs) - len(done),
        "total_input_tokens": ns.random_input_len * len(done), "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + ns.random_input_len * len(done)) / duration,
        "ttfts": [o["ttft"] for o in outputs], "itls": [o["itl"] for o in outputs],
        "output_lens": [o["output"] for o in outputs], "errors": [o["error"] for o in outputs],
    }  # fmt: skip
    series = {
        "ttft": [o["ttft"] for o in done],
        "itl": [gap for o in done for gap in o["itl"]],
        "tpot": [(o["latency"] - o["ttft"]) / (o["output"] - 1) for o in done if o["output"] > 1],
        "e2el": [o["latency"] for o in done],
    }
    wanted = [name.strip() for name in ns.percentile_metrics.split(",") if name.strip()]
    levels = [float(level) for level in ns.metric_percentiles.split(",")]
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(f"Successful requests: {len(done)}\nOutput token throughput (tok/s): {result['output_throughput']:.2f}")
    for name in wanted:
        values = [value * 1000 for value in series.get(name, [])]
        result[f"mean_{name}_ms"] = sum(values) / len(values) if values else 0.0
        result[f"median_{name}_ms"] = percentile(values, 50)
        for level in levels:
            result[f"p{level:g}_{name}_ms"] = percentile(values, level)
    if ns.save_result:
        name = ns.result_filename or "result.json"
        with open(os.path.join(ns.result_dir or ".", name), "w", encoding="utf-8") as handle:
            json.dump(result, handle)
    return 0
