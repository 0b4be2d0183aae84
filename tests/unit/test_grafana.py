"""metrics.grafanaNode: the provisioning Grafana reads, the entrypoint that writes it, the rules around it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from components.config import load_cluster_config
from components.plan.dashboard import DATASOURCE_UID, dashboard
from components.resources import grafana
from tests.unit.test_config import config, problems_of

PASSWORD = "gr-4f$(touch /tmp/owned)'\"`id`"


def grafana_config(**changes):
    raw = config(**{"metrics": {"prometheusNode": "spark-02", "grafanaNode": "spark-01"}, **changes})
    raw["grafanaAdminPassword"] = PASSWORD
    return raw


def test_the_datasource_is_the_stacks_prometheus_under_the_uid_every_panel_names():
    cfg = load_cluster_config(grafana_config())
    board = dashboard(cfg, "prod")
    files = {env: json.loads(text) for env, text in grafana.provisioning(cfg, board).items()}
    (source,) = files["SPARK_VLLM_GRAFANA_DATASOURCE"]["datasources"]
    assert files["SPARK_VLLM_GRAFANA_DATASOURCE"]["apiVersion"] == 1
    assert (source["type"], source["uid"], source["access"]) == ("prometheus", DATASOURCE_UID, "proxy")
    assert source["url"] == "http://10.9.0.2:9090"  # Prometheus on another node: over the fabric
    used = {target["datasource"]["uid"] for panel in board["panels"] for target in panel["targets"]}
    assert used == {DATASOURCE_UID}
    (provider,) = files["SPARK_VLLM_GRAFANA_PROVIDER"]["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == grafana.DASHBOARDS
    assert os.path.dirname(grafana.FILES["SPARK_VLLM_GRAFANA_DASHBOARD"]) == grafana.DASHBOARDS
    assert files["SPARK_VLLM_GRAFANA_DASHBOARD"] == board


def test_on_prometheus_own_node_grafana_reads_it_on_loopback():
    cfg = load_cluster_config(grafana_config(metrics={"prometheusNode": "spark-01", "grafanaNode": "spark-01"}))
    datasource = json.loads(grafana.provisioning(cfg, {})["SPARK_VLLM_GRAFANA_DATASOURCE"])
    assert datasource["datasources"][0]["url"] == "http://127.0.0.1:9090"
    assert grafana.grafana_url(cfg) == "http://10.0.0.1:3000"


def test_the_entrypoint_writes_each_file_from_the_environment_then_hands_over(tmp_path, monkeypatch):
    """Run for real by /bin/sh: each file holds its variable's text byte for byte, however hostile."""
    root = tmp_path / "root"
    monkeypatch.setattr(grafana, "PROVISIONING", f"{root}/provisioning")
    monkeypatch.setattr(grafana, "DASHBOARDS", f"{root}/dashboards")
    monkeypatch.setattr(grafana, "FILES", {
        "SPARK_VLLM_GRAFANA_DATASOURCE": f"{root}/provisioning/datasources/spark-vllm.yaml",
        "SPARK_VLLM_GRAFANA_PROVIDER": f"{root}/provisioning/dashboards/spark-vllm.yaml",
        "SPARK_VLLM_GRAFANA_DASHBOARD": f"{root}/dashboards/spark-vllm.json",
    })  # fmt: skip
    handover = tmp_path / "run.sh"
    handover.write_text(f'#!/bin/sh\necho "$GF_SECURITY_ADMIN_PASSWORD" > {tmp_path}/handed\n')
    handover.chmod(0o755)
    monkeypatch.setattr(grafana, "ENTRYPOINT", str(handover))
    cfg = load_cluster_config(grafana_config())
    board = dashboard(cfg, "prod")
    board["title"] = '$(touch owned) `id` "; rm -rf /'
    env = dict(item.split("=", 1) for item in grafana.grafana_env(cfg, board, PASSWORD))
    done = subprocess.run(grafana.grafana_entrypoint(), env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for variable, path in grafana.FILES.items():
        assert json.loads(open(path).read()) == json.loads(env[variable])
    assert json.loads(open(grafana.FILES["SPARK_VLLM_GRAFANA_DASHBOARD"]).read())["title"] == board["title"]
    assert (tmp_path / "handed").read_text() == PASSWORD + "\n"
    assert not (tmp_path / "owned").exists()


def test_the_password_is_only_in_the_environment_never_in_the_command_line():
    cfg = load_cluster_config(grafana_config())
    assert PASSWORD not in json.dumps(grafana.grafana_entrypoint())
    assert f"GF_SECURITY_ADMIN_PASSWORD={PASSWORD}" in grafana.grafana_env(cfg, {}, PASSWORD)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"metrics": {"grafanaNode": "spark-01"}}, "metrics.grafanaNode: 'spark-01' — a Prometheus beside it"),
        (
            {"metrics": {"prometheusNode": "spark-02", "grafanaNode": "spark-09"}},
            "metrics.grafanaNode: 'spark-09' — one of the node names",
        ),
        ({"metrics": {"prometheusNode": "spark-02", "grafanaNode": "spark-01", "grafanaPort": 8000}}, "8000"),
    ],
)
def test_grafana_without_what_it_needs_is_refused(change, expected):
    raw = grafana_config()
    raw.update(change)
    assert any(expected in problem for problem in problems_of(raw)), problems_of(raw)


@pytest.mark.parametrize("password", [None, "", "   "])
def test_grafana_without_a_password_is_refused_naming_the_secret_not_a_value(password):
    raw = grafana_config()
    if password is None:
        del raw["grafanaAdminPassword"]
    else:
        raw["grafanaAdminPassword"] = password
    problems = problems_of(raw)
    assert any(problem.startswith("grafanaAdminPassword") for problem in problems), problems
