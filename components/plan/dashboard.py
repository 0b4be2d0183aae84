"""The stack's Grafana dashboard (the `dashboard` output): throughput, time to first token and inter-token
latency (p50, p99), running and waiting requests, KV cache usage, each node's memory, vLLM's restarts and the
times it was ended while /health answered,
from the metrics the `prometheusConfig` scrapes. vLLM's names are vLLM 0.25's own (a test holds them to the
names the GPU lane read off a real vLLM); the node's are the supervisor's (metrics.nodePort). Pure."""

from __future__ import annotations

from typing import Any

from components.config import ClusterConfig

RATE = "$__rate_interval"  # Grafana's: at least four scrape intervals
DATASOURCE_UID = "spark-vllm-prometheus"


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [
        (f"p{int(q * 100)}", f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{RATE}])))")
        for q in (0.5, 0.99)
    ]


# (title, unit, [(legend, PromQL)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Output tokens/s", "short", [("output", f"sum(rate(vllm:generation_tokens_total[{RATE}]))")]),
    ("Prompt tokens/s", "short", [("prompt", f"sum(rate(vllm:prompt_tokens_total[{RATE}]))")]),
    ("Time to first token", "s", _quantiles("vllm:time_to_first_token_seconds")),
    ("Inter-token latency", "s", _quantiles("vllm:inter_token_latency_seconds")),
    (
        "Requests",
        "short",
        [("running", "sum(vllm:num_requests_running)"), ("waiting", "sum(vllm:num_requests_waiting)")],
    ),
    ("KV cache usage", "percentunit", [("used", "max(vllm:kv_cache_usage_perc)")]),
    (
        "Memory available per node",
        "bytes",
        [("{{node}}", "spark_vllm_node_memory_available_bytes")],
    ),
    (
        "GPU or unified memory in use per node",
        "bytes",
        # the GPUs' own memory where nvidia-smi reports it, else (a GB10) the unified memory in use
        [
            (
                "{{node}}",
                "sum by (node) (spark_vllm_gpu_memory_used_bytes) or on (node) "
                "(spark_vllm_node_memory_total_bytes - spark_vllm_node_memory_available_bytes)",
            )
        ],
    ),
    ("vLLM restarts per node", "short", [("{{node}}", "spark_vllm_vllm_restarts_total")]),
    ("vLLM serving per node", "short", [("{{node}}", "spark_vllm_vllm_serving")]),
    # stalled, wrong tokens, a rank whose head went away: ended while /health answered (docs/recovery.md)
    ("vLLM ended while /health answered", "short", [("{{node}} {{kind}}", "spark_vllm_vllm_faults_total")]),
]


def queries() -> list[str]:
    """Every panel's PromQL, in order."""
    return [expr for _, _, targets in PANELS for _, expr in targets]


def dashboard(cfg: ClusterConfig, stack: str) -> dict[str, Any]:
    """A Grafana dashboard (JSON model, schema 39) over the stack's Prometheus datasource."""
    datasource = {"type": "prometheus", "uid": DATASOURCE_UID}
    panels = []
    for index, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": title,
                "datasource": datasource,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + n), "datasource": datasource, "expr": expr, "legendFormat": legend}
                    for n, (legend, expr) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": f"spark-vllm-{stack}"[:40],
        "title": f"spark-vllm {stack}: {cfg.served_model_name or 'promoted release'}",
        "tags": ["spark-vllm", "vllm"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "panels": panels,
    }
