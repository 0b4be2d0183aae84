"""scripts/dashboard_snapshot.py: the dashboard's panels drawn from Prometheus's answers, without Grafana."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from components.config import load_cluster_config
from components.plan.dashboard import dashboard
from scripts import dashboard_snapshot as snap
from tests.harness import ROOT
from tests.unit.test_config import config

END = 1_780_000_000.0


def answer_for(query: str) -> dict:
    """Two nodes for per-node queries, one series else; nothing for restarts (a panel with no data)."""
    if "restarts" in query:
        return {"status": "success", "data": {"resultType": "matrix", "result": []}}
    if "bad(" in query:
        return {"status": "error", "error": "parse error: unknown function"}
    nodes = ["spark-01", "spark-02"] if "spark_vllm_" in query else [None]
    result = [
        {"metric": {"node": node} if node else {}, "values": [[END - 60 * k, str(k * 1.5)] for k in range(5, 0, -1)]}
        for node in nodes
    ]
    return {"status": "success", "data": {"resultType": "matrix", "result": result}}


def board():
    return dashboard(load_cluster_config(config()), "prod")


def test_every_panel_is_asked_with_its_queries_over_the_window_and_rate_interval_replaced():
    asked = []

    def fetch(path, params):
        asked.append((path, params))
        return answer_for(params["query"])

    panels = snap.collect(board(), fetch, END, 15, "2m")
    assert len(panels) == len(board()["panels"])
    assert {path for path, _ in asked} == {"/api/v1/query_range"}
    assert all(float(p["end"]) - float(p["start"]) == 900 for _, p in asked)
    assert not any("$__rate_interval" in p["query"] for _, p in asked)
    assert any("[2m]" in p["query"] for _, p in asked)
    memory = next(p for p in panels if p.title == "Memory available per node")
    assert [s.legend for s in memory.series] == ["spark-01", "spark-02"]  # legendFormat {{node}}
    restarts = next(p for p in panels if p.title == "vLLM restarts per node")
    assert restarts.series == [] and restarts.errors == []


def test_a_query_prometheus_refuses_is_said_on_its_panel_and_the_others_draw():
    spec = board()
    spec["panels"][0]["targets"][0]["expr"] = "bad(vllm:generation_tokens_total)"
    panels = snap.collect(spec, lambda path, params: answer_for(params["query"]), END, 15, "1m")
    assert panels[0].errors == ["A: parse error: unknown function"] and panels[0].series == []
    assert all(p.series for p in panels[1:] if "restarts" not in p.title)


def test_the_page_is_self_contained_and_escapes_what_it_shows():
    spec = board()
    spec["title"] = "<script>alert(1)</script>"
    spec["panels"][0]["title"] = '"><img src=x onerror=alert(1)>'
    panels = snap.collect(spec, lambda path, params: answer_for(params["query"]), END, 15, "1m")
    text = snap.page(spec, panels, "http://prom:9090", END - 900, END)
    assert "<script" not in text and "<img" not in text
    assert not re.search(r'(src|href)="', text)  # nothing is fetched when the page opens
    assert text.count('class="panel"') == len(spec["panels"]) and text.count("<polyline") >= len(spec["panels"]) - 1
    assert "No data" in text  # the restarts panel


def test_units_read_as_grafana_shows_them():
    assert snap.human(3 * 2**30, "bytes") == "3.0 GiB"
    assert snap.human(0.0123, "s") == "12.3 ms" and snap.human(2.5, "s") == "2.50 s"
    assert snap.human(0.42, "percentunit") == "42%"
    assert snap.human(1500, "short") == "1.5k" and snap.human(2, "short") == "2"


def test_the_script_against_an_http_prometheus_writes_the_page_and_require_data_fails_on_an_empty_panel(tmp_path):
    class Prometheus(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            query = parse_qs(urlparse(self.path).query)["query"][0]
            body = json.dumps(answer_for(query)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "board.json").write_text(json.dumps(board()))
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv = [sys.executable, str(ROOT / "scripts/dashboard_snapshot.py"), "--dashboard", str(tmp_path / "board.json"),
                "--prometheus", url, "--out", str(tmp_path / "d.html")]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "Memory available per node: 2 series, 10 points" in done.stdout
        assert "no data in: vLLM restarts per node" in done.stderr
        assert (tmp_path / "d.html").read_text().startswith("<!doctype html>")
        strict = subprocess.run([*argv, "--require-data"], capture_output=True, text=True, timeout=60)
        assert strict.returncode == 1
    finally:
        server.shutdown()
