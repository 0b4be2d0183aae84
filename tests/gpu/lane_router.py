"""The GPU lane's `router` phase: the stack's router as the program renders it (scripts/router_keeper.py in
its serve mode, running vllm-router 0.1.17 in IGW mode, behind the edge: HAProxy with the configuration the
program renders, tests/edge_harness.py) in front of the lane's real vLLM, then the steps
`pulumi up` runs against it (workers, ready, smoke, drain, undrain) and what a client sees through it:
the answer, the API key passed on to vLLM, /v1/models, the router's metrics, and what the hop adds to the
time to first token (streamed requests alternating between vLLM and the router)."""

from __future__ import annotations

import http.client
import json
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from components.config import load_cluster_config  # noqa: E402
from components.plan.edge import SEES_UPSTREAM_SECONDS  # noqa: E402
from components.plan.endpoint import edge_spec, vllm_url  # noqa: E402
from components.plan.names import SMOKE_MAX_TOKENS, SMOKE_PROMPT  # noqa: E402
from components.plan.programs import script_program  # noqa: E402
from components.plan.router_params import keeper_params  # noqa: E402
from tests.edge_harness import Edge  # noqa: E402

HOP_SAMPLES = 100  # each path


def first_token_ms(host: str, port: int, key: str, model: str) -> float:
    """One streamed chat completion: milliseconds until its first chunk with a choice."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Count to five."}],
                       "max_tokens": 8, "ignore_eos": True, "stream": True})  # fmt: skip
    connection = http.client.HTTPConnection(host, port, timeout=60)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=body,
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # fmt: skip
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{host}:{port} answered {response.status}: {response.read()[:300]!r}")
    buffer = b""
    try:
        while True:
            part = response.read1(65536)
            if not part:
                raise RuntimeError("the stream ended before any choice")
            buffer += part
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                # vLLM sends its first chunk once the first token is out (dummy weights' tokens may decode to "")
                if json.loads(line[6:]).get("choices"):
                    return (time.perf_counter() - started) * 1000
    finally:
        connection.close()


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"p50": round(statistics.median(ordered), 3), "p90": round(ordered[int(len(ordered) * 0.9)], 3),
            "n": len(ordered)}  # fmt: skip


def status_of(url: str, key: str | None, body: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(errors="replace")[:600]
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")[:600]
    except OSError as error:
        return 0, str(error)


def router_phase(raw: dict, node: Any, served: str, api_key: str, report: dict, step: Callable) -> None:
    """`node`: the lane's Node (its env has vllm-router importable); `raw`: the lane's stack config."""
    direct_url = vllm_url(load_cluster_config(raw))  # the lane's vLLM, as the program rendered it: no router
    base = raw["vllm"]["port"]  # the lane's ports (lane.stack_config): the router's are the last three
    raw = {**raw, "router": {"enabled": True, "node": raw["nodes"][0]["name"], "port": base + 3,
                             "innerPort": base + 4, "metricsPort": base + 5}}  # fmt: skip
    cfg = load_cluster_config(raw)
    fabric = str(cfg.head_node.fabric_address)
    run_dir = str(node.run_dir / "router")
    base = keeper_params(cfg, "serve")
    env = {**node.env, "SPARK_VLLM_ROUTER_RUN_DIR": run_dir}
    worker = {"url": direct_url, "model": served, "replica": "lane"}
    result: dict = {"port": cfg.router.port, "policy": cfg.router.policy, "version": cfg.router.version}
    report["router"] = result

    def keeper(mode: str, timeout: float = 180, **extra: Any) -> tuple[int, str, float]:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-"], input=script_program("router_keeper.py", {**base, "mode": mode,
                              "timeout": timeout, **extra}), env=env, capture_output=True, text=True,
                              timeout=timeout + 60)  # fmt: skip
        if done.returncode == 0:
            node.record("router_keeper.py", done.stdout)
        return done.returncode, done.stdout + done.stderr, time.monotonic() - started

    log = open(node.out / "router-keeper.log", "w")
    serving = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                               env=env, text=True)  # fmt: skip
    serving.stdin.write(script_program("router_keeper.py", base))
    serving.stdin.close()
    card = {"id": served, "root": cfg.model, "max_model_len": cfg.max_model_len}
    edge = None
    try:  # the keeper and its vllm-router are stopped whatever fails after they started, the edge's start too
        edge = Edge(edge_spec(cfg, api_key, [served], [card]), node.out).start()
        if not step("router_ready", *keeper("ready", 120)):
            return
        if not step("router_workers", *keeper("workers", 120, workers=[worker])):
            return
        code, output, seconds = keeper("smoke", 180, models=[served], prompt=SMOKE_PROMPT,
                                       max_tokens=SMOKE_MAX_TOKENS, api_key=api_key,
                                       wait_served_seconds=SEES_UPSTREAM_SECONDS)  # fmt: skip
        step("router_smoke", code, output, seconds)
        if code == 0:
            result["smoke"] = json.loads(output.strip().splitlines()[-1])
        router = f"http://127.0.0.1:{cfg.router.port}"
        chat = {"model": served, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        result["without_key"] = status_of(router + "/v1/chat/completions", None, chat)[0]
        result["wrong_key"] = status_of(router + "/v1/chat/completions", "wrong-key", chat)[0]
        result["with_key"] = status_of(router + "/v1/chat/completions", api_key, chat)[0]
        result["models"] = status_of(router + "/v1/models", api_key)
        metrics = status_of(f"http://{fabric}:{cfg.router.metrics_port}/metrics", None)
        result["metric_names"] = sorted({line.split()[2] for line in metrics[1].splitlines()
                                         if line.startswith("# TYPE")})[:40]  # fmt: skip
        direct, routed = [], []
        for _ in range(HOP_SAMPLES):
            direct.append(first_token_ms(*direct_url[len("http://") :].split(":"), api_key, served))
            routed.append(first_token_ms("127.0.0.1", cfg.router.port, api_key, served))
        result["ttft_ms"] = {"direct": summary(direct), "router": summary(routed)}
        result["hop_ms_p50"] = round(result["ttft_ms"]["router"]["p50"] - result["ttft_ms"]["direct"]["p50"], 3)
        print(f"lane: router hop {result['hop_ms_p50']} ms at p50 ({result['ttft_ms']})", flush=True)
        if not step("router_drain", *keeper("drain", 300, worker=worker)):
            return
        result["while_drained"] = status_of(router + "/v1/chat/completions", api_key, chat)
        if not step("router_undrain", *keeper("undrain", 120, worker=worker)):
            return
        result["after_undrain"] = status_of(router + "/v1/chat/completions", api_key, chat)[0]
    finally:
        if edge is not None:
            edge.close()
        serving.send_signal(signal.SIGTERM)
        try:
            serving.wait(30)
        except subprocess.TimeoutExpired:
            serving.kill()
        log.close()
        result["keeper_exit"] = serving.returncode
        result["keeper_log_tail"] = (node.out / "router-keeper.log").read_text().splitlines()[-8:]
