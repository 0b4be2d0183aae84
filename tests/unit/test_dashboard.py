"""The dashboard's queries: vLLM's metric names as real vLLM 0.25 has them, the node's as the supervisor serves them,
and the supervisor's node metrics for real."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

from components.config import load_cluster_config
from components.plan.dashboard import PANELS, dashboard, queries
from components.plan.programs import script
from tests.harness import ROOT
from tests.unit.test_config import config
from tests.waiting import free_port, wait_for

VLLM_025 = ROOT / "tests/gpu/results/2026-12-01/vllm-0.25.0-metric-types.txt"  # /metrics of a real vLLM 0.25.0


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(vllm:[a-z_]+|spark_vllm_[a-z_]+)\b", expr))


def test_every_vllm_metric_a_panel_reads_is_one_real_vllm_0_25_serves():
    served = {line.split()[2] for line in VLLM_025.read_text().splitlines() if line.startswith("# TYPE")}
    histograms = {line.split()[2] for line in VLLM_025.read_text().splitlines() if line.endswith(" histogram")}
    for expr in queries():
        for name in metric_names(expr):
            if not name.startswith("vllm:"):
                continue
            base = name.removesuffix("_bucket")
            assert base in served, name
            if name.endswith("_bucket"):
                assert base in histograms, name


def test_every_node_metric_a_panel_reads_is_one_the_supervisor_serves():
    from components.scripts import node_metrics

    source = (ROOT / "components/scripts/node_metrics.py").read_text()
    assert node_metrics is not None
    for expr in queries():
        for name in metric_names(expr):
            if name.startswith("spark_vllm_"):
                assert f'"{name}"' in source, name


def test_the_dashboard_has_the_panels_the_operators_look_at():
    cfg = load_cluster_config(config())
    board = dashboard(cfg, "prod")
    titles = [panel["title"] for panel in board["panels"]]
    assert titles[:6] == ["Output tokens/s", "Prompt tokens/s", "Time to first token", "Inter-token latency",
                          "Requests", "KV cache usage"]  # fmt: skip
    ttft = board["panels"][2]["targets"]
    assert [t["legendFormat"] for t in ttft] == ["p50", "p99"]
    assert all(t["datasource"]["uid"] == "spark-vllm-prometheus" for p in board["panels"] for t in p["targets"])
    assert json.loads(json.dumps(board)) == board  # plain JSON for Grafana's import
    assert len(PANELS) == len(board["panels"])


def test_the_supervisor_serves_the_nodes_memory_and_vllms_counts(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 125000000 kB\nMemAvailable: 100000000 kB\n")
    port = free_port()
    params = {"node": "node-1", "executor": "mp", "run_dir": str(tmp_path / "run"), "ray_argv": None,
              "stop_grace_seconds": 2, "metrics_port": port}  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "VLLM_HOST_IP": "127.0.0.1", "SPARK_VLLM_MEMINFO": str(meminfo)}
    program = tmp_path / "supervisor.py"  # a file, as the container has it (too long for an argument)
    program.write_text(script("supervisor.py"))
    process = subprocess.Popen([sys.executable, str(program), json.dumps(params)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    try:

        def scrape():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    return response.read().decode()
            except OSError:
                return None

        assert wait_for(scrape, 20), "no metrics served"
        text = scrape()
        assert 'spark_vllm_node_memory_available_bytes{node="node-1"} 1.024e+11' in text
        assert 'spark_vllm_vllm_restarts_total{node="node-1"} 0' in text
        assert "# TYPE spark_vllm_vllm_restarts_total counter" in text
        assert 'spark_vllm_vllm_serving{node="node-1"} 0' in text  # no settings yet
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_the_node_metrics_listen_without_asking_the_resolver_for_their_address(monkeypatch):
    """http.server's bind looks the address's name up (socket.getfqdn): 10 s on a node whose name server does not
    answer, before the supervisor starts vLLM. The node's metrics server asks no resolver."""
    import socket

    from components.scripts import node_metrics
    from components.scripts.node_contract import SupervisorStatus, VllmState

    def no_lookup(*_args):
        raise AssertionError("the resolver was asked")

    monkeypatch.setattr(socket, "getfqdn", no_lookup)
    port = free_port()
    server = node_metrics.serve_node_metrics(
        "127.0.0.1", port, "node-1", lambda: SupervisorStatus("node-1", "mp", VllmState.NO_SETTINGS)
    )
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert 'spark_vllm_vllm_restarts_total{node="node-1"} 0' in response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
