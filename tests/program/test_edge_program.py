"""The edge under Pulumi's mocks: where it runs, what its configuration holds (and keeps secret), what it waits for,
and that a change of key or of the declared models touches its configuration step alone."""

from __future__ import annotations

import base64
import io
import json
import tarfile

import pytest

from components.plan.edge import key_digest
from tests.harness import PROGRAM_KEY, changed_inputs, run_program, shared_run
from tests.program.test_deployments_program import run_fleet
from tests.program.test_program import SECRETS, prod
from tests.tls_ca import TestCa

CONTAINER = "docker:index/container:Container"
ALICE, BOB = "sk-alice-000000000000000001", "sk-bob-00000000000000000002"


def edge_files(run) -> dict[str, str]:
    """The edge's configuration as its step receives it on stdin: the files of a tar, in base64."""
    raw = base64.b64decode(run.named("spark-vllm-edge-config").inputs["stdin"])
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return {member.name: tar.extractfile(member).read().decode() for member in tar.getmembers()}


def edge_config(run) -> str:
    return edge_files(run)["haproxy.cfg"]


def test_one_model_the_edge_takes_the_endpoint_and_vllm_the_fabric_behind_it():
    run = shared_run(prod(), SECRETS, stack="prod")
    edge = run.named("spark-01-edge")
    assert edge.inputs["name"] == "spark-vllm.edge" and edge.inputs["networkMode"] == "host"
    assert run.named("spark-01-edge-image").inputs["name"] == "haproxy:3.0"
    config = edge_config(run)
    assert "bind 0.0.0.0:30000" in config  # the endpoint the stack always had
    assert "server upstream 192.168.200.12:29002" in config  # vLLM on the head's fabric address
    assert run.exports["endpoint"] == "http://spark-01.lan:30000/v1"
    # the key's digest, never the key; the step's stdin is a secret, its command plain (known in a preview)
    assert key_digest(SECRETS["apiKey"]) in config and SECRETS["apiKey"] not in config
    assert "set-var(txn.client) str(default)" in config  # apiKey's client, by name
    # what reaches vLLM is the program's own key, which the program's steps use too
    assert f'set-header authorization "Bearer {PROGRAM_KEY}"' in config
    assert (
        f"str(spark-vllm) if {{ req.fhdr(authorization),sha2(256),hex,lower -m str {key_digest(PROGRAM_KEY)} }}"
        in config
    )
    step = run.named("spark-vllm-edge-config")
    assert "stdin" in step.secret_paths() and "create" not in step.secret_paths()
    assert step.inputs["create"].startswith("timeout --kill-after=10 120 docker exec -u 0 -i spark-vllm.edge bash -c")


def test_one_model_the_edge_starts_after_the_checks_and_vllms_new_settings():
    """An older version's vLLM listened on the endpoint's port: the edge starts once vLLM was handed its new
    settings (the supervisor restarts it on the fabric), and like every container only after the checks."""
    run = shared_run(prod(), SECRETS, stack="prod")
    edge = run.named("spark-01-edge")
    assert run.named("spark-vllm-serve").urn in edge.dependencies
    assert run.named("spark-vllm-checks-passed").urn in edge.dependencies
    assert run.named("spark-01-guard-ready").urn in edge.dependencies  # network.guard in the prod stack


def test_several_models_the_edge_lists_each_model_once_in_front_of_the_router():
    run = run_fleet()
    config = edge_config(run)
    assert "bind 0.0.0.0:8080" in config and "server upstream 127.0.0.1:29001" in config
    cards = [line for line in config.splitlines() if "path,url_dec" in line]
    # three deployments, four replicas (small twice): a card each model
    assert len(cards) == 3 and sum("/models/Qwen3-0.6B" in line for line in cards) == 1
    # after the router's container: an older version's keeper held the endpoint's port
    assert run.named("spark-vllm-router").urn in run.named("spark-01-edge").dependencies
    assert run.named("spark-vllm-edge-config").urn in run.named("spark-vllm-router-smoke").dependencies


def test_a_new_key_changes_the_edges_configuration_and_no_container():
    before = shared_run(prod(), SECRETS, stack="prod")
    after = shared_run(prod(), {**SECRETS, "apiKey": "sk-another-key-000000000000"}, stack="prod")
    assert edge_config(before) != edge_config(after)
    containers = {r.name: r.inputs for r in before.of_type(CONTAINER)}
    assert containers == {r.name: r.inputs for r in after.of_type(CONTAINER)}
    assert (
        before.named("spark-vllm-edge-config").inputs["create"]
        == after.named("spark-vllm-edge-config").inputs["create"]
    )


def test_the_edges_log_is_one_of_the_log_commands():
    run = shared_run(prod(), SECRETS, stack="prod")
    assert run.exports["logCommands"]["edge"] == (
        "ssh -t -p 22 aurora@spark-01.lan 'docker logs --tail 200 -f spark-vllm.edge'"
    )
    assert run_fleet().exports["logCommands"]["edge"].endswith("'docker logs --tail 200 -f spark-vllm.edge'")


def test_one_listed_deployment_without_the_router_gets_the_edge_on_its_own_head():
    """Not the stack's first node: the edge stands where that deployment's vLLM is."""
    from tests.program.test_deployments_program import Models, fleet

    raw = fleet()
    raw["deployments"] = [raw["deployments"][1]]  # coder alone, on spark-03
    run = run_program(raw, SECRETS, stack="prod", mocks=Models())
    assert run.named("spark-03-edge").inputs["name"] == "spark-vllm.edge"
    assert "server upstream 192.168.200.14:29002" in edge_config(run)
    assert run.exports["endpoint"] == "http://spark-03.lan:8000/v1"
    assert "spark-03.lan" in run.exports["logCommands"]["edge"]


KEYS = {**SECRETS, "apiKeys": {"alice": ALICE, "bob": BOB}}


def tls_for(host: str, ca: TestCa | None = None) -> dict:
    ca = ca or TestCa()
    issued = ca.issue(host)
    return {"certificate": issued.certificate, "key": issued.key, "ca": ca.pem}


def test_each_named_key_is_a_client_of_its_own_and_none_is_in_the_configuration():
    config = edge_config(shared_run(prod(), KEYS, stack="prod"))
    for name, key in (("alice", ALICE), ("bob", BOB), ("default", SECRETS["apiKey"])):
        assert f"str({name}) if {{ req.fhdr(authorization),sha2(256),hex,lower -m str {key_digest(key)} }}" in config
        assert key not in config
    assert "client=%[var(txn.client)] model=%[var(txn.model)]" in config  # the name in the log, never the key


@pytest.mark.parametrize("shape", ["one model", "several models"])
def test_adding_removing_or_replacing_a_key_changes_the_edges_configuration_step_alone(shape):
    def run(secrets):
        return run_fleet(secrets=secrets) if shape == "several models" else shared_run(prod(), secrets, stack="prod")

    before = run(KEYS)
    # alice removed, bob's key replaced, carol added, in one run: whatever one of them touched besides the edge's
    # step would show in the difference (a run of the several-models stack is 0.7 CPU-s)
    after_keys = {"bob": "sk-bob-rotated-000000000004", "carol": "sk-carol-0000000000000003"}
    assert changed_inputs(before, run({**SECRETS, "apiKeys": after_keys})) == {"spark-vllm-edge-config": {"stdin"}}
    # apiKey itself too: vLLM's key is the program's own, not a client's
    other = run({**KEYS, "apiKey": "sk-another-key-000000000000"})
    assert changed_inputs(before, other) == {"spark-vllm-edge-config": {"stdin"}}


def test_with_tls_the_edge_serves_https_with_the_certificate_in_a_file_of_its_own():
    tls = tls_for("spark-01.lan")
    run = run_program(prod(), {**KEYS, "tls": tls}, stack="prod")
    files = edge_files(run)
    [pem_name] = [name for name in files if name.startswith("tls-")]
    assert files[pem_name] == tls["certificate"].strip() + "\n" + tls["key"].strip() + "\n"
    assert f"bind 0.0.0.0:30000 proto h1 ssl crt /etc/spark-vllm-edge/{pem_name} alpn http/1.1" in files["haproxy.cfg"]
    assert run.exports["endpoint"] == "https://spark-01.lan:30000/v1"
    out = run.exports["tls"]
    assert out["names"] == ["spark-01.lan"] and len(out["fingerprintSha256"]) == 95 and out["notAfter"].endswith("Z")
    assert "tls" not in run.secret_exports  # public facts; the key is in no output
    assert tls["key"].split("\n")[1] not in json.dumps(run.exports)


def test_a_renewed_certificate_changes_the_edges_configuration_step_alone():
    ca = TestCa()
    before = run_program(prod(), {**KEYS, "tls": tls_for("spark-01.lan", ca)}, stack="prod")
    after = run_program(prod(), {**KEYS, "tls": tls_for("spark-01.lan", ca)}, stack="prod")
    assert changed_inputs(before, after) == {"spark-vllm-edge-config": {"stdin"}}
    # another CA: the smoke test through the endpoint verifies with the new one, so it runs again too
    other = run_program(prod(), {**KEYS, "tls": tls_for("spark-01.lan")}, stack="prod")
    assert changed_inputs(before, other) == {
        "spark-vllm-edge-config": {"stdin"},
        "spark-vllm-endpoint-smoke": {"stdin"},
    }


def smoke_params_of(run, name: str) -> dict:
    return json.loads(json.loads(run.named(name).inputs["stdin"].split("\n")[0][len("PARAMS = ") :]))


def test_one_model_a_chat_goes_through_the_endpoint_verified_for_the_heads_name_after_the_edge():
    tls = tls_for("spark-01.lan")
    run = run_program(prod(), {**KEYS, "tls": tls}, stack="prod")
    params = smoke_params_of(run, "spark-vllm-endpoint-smoke")
    assert params["base_url"] == "https://127.0.0.1:30000" and params["server_name"] == "spark-01.lan"
    assert params["tls_ca"] == tls["ca"] and params["api_key"] == PROGRAM_KEY  # the program's own client
    step = run.named("spark-vllm-endpoint-smoke")
    after = {run.by_urn()[urn].name for urn in step.dependencies}
    # after the edge's configuration, and after the benchmark (prod's): never a request inside its window
    assert {"spark-vllm-edge-config", "spark-vllm-benchmark"} <= after
    plain = smoke_params_of(shared_run(prod(), SECRETS, stack="prod"), "spark-vllm-endpoint-smoke")
    assert plain["base_url"] == "http://127.0.0.1:30000" and "tls_ca" not in plain and "server_name" not in plain
    # vLLM's own smoke test is as it was: no tls keys in its parameters
    assert "tls_ca" not in smoke_params_of(run, "spark-vllm-smoke")


@pytest.mark.parametrize("benchmark", [True, False], ids=["after-the-benchmark", "after-the-smoke-test"])
def test_one_model_the_chat_through_the_endpoint_runs_again_after_every_start_of_vllm(benchmark):
    """Its triggers hold the head's last step after vLLM's start (the benchmark, else the smoke test), which runs
    anew whenever vLLM started anew: the edge's checks saw that vLLM go, and `up` ends once the edge serves the new
    one, not while a client's request would meet its 503."""
    config = prod() if benchmark else prod(benchmark={"enabled": False})
    run = shared_run(config, SECRETS, stack="prod")
    step = run.named("spark-vllm-endpoint-smoke")
    last = run.named("spark-vllm-benchmark" if benchmark else "spark-vllm-smoke")
    assert (last.name == "spark-vllm-benchmark") == benchmark and last.id in step.inputs["triggers"]
    sources = {run.by_urn()[urn].name for urn in step.property_dependencies["triggers"]}
    assert {last.name, "spark-vllm-serve"} <= sources, sources


def test_the_routers_smoke_goes_through_the_edge_over_tls_verified_for_the_endpoints_name():
    tls = tls_for("spark-01.lan")  # the router's node
    run = run_fleet(secrets={**KEYS, "tls": tls})
    stdin = run.named("spark-vllm-router-smoke").inputs["stdin"]
    params = json.loads(json.loads(stdin.split("\n")[0][len("PARAMS = ") :]))
    assert params["tls_ca"] == tls["ca"] and params["server_name"] == "spark-01.lan"
    assert params["api_key"] == PROGRAM_KEY  # the program's own client at the edge
