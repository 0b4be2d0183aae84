"""Operating it, under mocks: what memory.oomGuard hands each node's supervisor."""

import json

from tests.harness import CONTAINER, changed_inputs, run_program
from tests.program.test_deployments_program import fleet, run_fleet
from tests.program.test_program import SECRETS, prod


def spec_of(run, name):
    stdin = run.named(name).inputs["stdin"]
    return json.loads(json.loads(stdin.split("\n", 1)[0].split("=", 1)[1]))["spec"]


def test_the_oom_guard_hands_the_os_reserve_to_every_supervisor_and_off_hands_nothing():
    guarded = run_program(prod(memory={"oomGuard": True, "osReserveGib": 10}), SECRETS, stack="prod")
    assert spec_of(guarded, "spark-vllm-serve")["oom_guard_mib"] == 10 * 1024
    plain = run_program(prod(), SECRETS, stack="prod")
    assert "oom_guard_mib" not in spec_of(plain, "spark-vllm-serve")  # off: no key, so no vLLM restart on upgrade


def test_the_diagnostics_output_says_how_to_reach_every_node_and_holds_no_secret():
    run = run_program(prod(metrics={"prometheusNode": "spark-02"}), SECRETS, stack="prod")
    facts = run.exports["diagnostics"]
    assert "diagnostics" not in run.secret_exports
    assert run.exports["diagnoseCommand"] == "python3 scripts/diagnose.py --stack prod"
    head, worker = facts["nodes"]
    assert (head["name"], head["host"], head["user"], head["sshPort"], head["head"]) == (
        "spark-01",
        "spark-01.lan",
        "aurora",
        22,
        True,
    )
    assert head["hostKey"].startswith("ssh-ed25519 ") and head["identity"].endswith("/prod/id_spark_vllm")
    assert head["containers"] == ["spark-vllm-spark-01", "spark-vllm.guard"]
    assert worker["containers"] == ["spark-vllm-spark-02", "spark-vllm.guard", "spark-vllm.prometheus"]
    plain = json.dumps(facts)
    assert not any(value in plain for value in SECRETS.values())


GRAFANA = {**SECRETS, "grafanaAdminPassword": "grafana-pw-9b2e"}


def test_grafana_runs_on_its_node_after_prometheus_with_its_password_a_secret():
    run = run_program(prod(metrics={"prometheusNode": "spark-02", "grafanaNode": "spark-01"}), GRAFANA, stack="prod")
    container = run.named("spark-01-grafana")
    assert container.inputs["name"] == "spark-vllm.grafana"
    assert run.named("spark-01-grafana-image").inputs["name"] == "grafana/grafana:12.0.2"
    assert "envs" in container.secret_paths()
    envs = container.inputs["envs"]
    assert "GF_SECURITY_ADMIN_PASSWORD=grafana-pw-9b2e" in envs
    assert "GF_SERVER_HTTP_PORT=3000" in envs
    board = json.loads(next(e for e in envs if e.startswith("SPARK_VLLM_GRAFANA_DASHBOARD=")).split("=", 1)[1])
    assert board == run.exports["dashboard"]
    assert "grafana-pw-9b2e" not in json.dumps(container.inputs["entrypoints"])
    assert run.named("spark-02-prometheus").urn in container.dependencies
    assert run.exports["metrics"]["grafana"] == "http://spark-01.lan:3000"
    head = run.exports["diagnostics"]["nodes"][0]
    assert head["containers"][-1] == "spark-vllm.grafana"
    assert "grafana-pw-9b2e" not in json.dumps(run.plain_exports())


def test_without_grafana_node_there_is_no_grafana():
    run = run_program(prod(metrics={"prometheusNode": "spark-02"}), SECRETS, stack="prod")
    assert not [reg for reg in run.registrations if "grafana" in reg.name]
    assert "grafana" not in run.exports["metrics"]


def test_every_container_the_program_starts_rotates_its_log_and_the_setting_changes_each():
    """Node containers, the edge, the router, the guard, Prometheus, Grafana: json-file, container.logs' size and
    count (#64: a keyless flood or a chatty vLLM cannot fill a node's disk)."""
    cfg = fleet(metrics={"prometheusNode": "spark-01", "grafanaNode": "spark-02"})
    secrets = {**SECRETS, "grafanaAdminPassword": "grafana-admin-0000"}
    before = run_fleet(cfg, secrets=secrets)
    containers = [r for r in before.registrations if r.typ == CONTAINER]
    roles = {r.name.rsplit("-", 1)[-1] for r in containers}
    assert {"container", "edge", "router", "guard", "prometheus", "grafana"} <= roles, roles
    for container in containers:
        assert container.inputs["logDriver"] == "json-file", container.name
        assert container.inputs["logOpts"] == {"max-size": "50m", "max-file": "5"}, container.name
    after = run_fleet({**cfg, "container": {"logs": {"maxSize": "20m", "maxFiles": 3}}}, secrets=secrets)
    changed = changed_inputs(before, after)
    assert {name for name, keys in changed.items() if keys == {"logOpts"}} == {r.name for r in containers}
    # and each replica leaves the router while its container is replaced, one at a time, as for any such change
    others = {name: keys for name, keys in changed.items() if keys != {"logOpts"}}
    assert others and all(name.endswith(("-router-drain", "-router-undrain")) for name in others), others
    assert all(keys == {"triggers"} for keys in others.values()), others
