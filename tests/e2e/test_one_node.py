"""The one-node shape (Pulumi.dev.yaml: one machine, no fabric peer, TP 1) through the real CLI, language host
and plugins: a new stack's first `pulumi preview` (after a bad certificate and a key two clients share were
refused), its `pulumi up` serving over TLS through the edge to two clients with keys of their own, a key replaced
and one removed under load (the edge's configuration alone), then a preview that changes nothing and a destroy
that leaves nothing. The shapes of the other example stack files are the other
rehearsal modules' (two nodes at TP 2: test_rehearsal.py; three nodes with deployments and the router:
test_deployments.py; MTP: test_speculative.py)."""

from __future__ import annotations

import json
import os
import time

import pytest

from components.config.vllm_versions import rules
from tests.e2e.cli_stack import StackError
from tests.e2e.conftest import _cluster, _image
from tests.e2e.image.build import publish_played
from tests.e2e.observe import no_containers
from tests.e2e.rehearsal import CACHE_DIR, Load, curl_chat, edge_requests, openai_tour, rehearsal_config, request
from tests.tls_ca import TestCa

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def one_node(registry, tmp_path_factory, request):
    yield from _cluster(1, registry, tmp_path_factory, request)


def test_one_node_previews_deploys_serves_and_destroys(one_node, model_dir, new_stack, tmp_path):
    """On vLLM 0.34 (the stand-in plays it here; the other modules play 0.25: #65): its image checked and recorded
    with 0.34's rules, its readiness read from 0.34's log lines."""
    base = _image(one_node)
    image = publish_played(CACHE_DIR, one_node.nodes[0].docker_host, base.ref, "0.34.0")
    node = one_node.nodes[0]
    stack = new_stack("dev", checkpoints=True)  # the README's `pulumi up --yes`, as a user's CLI runs it
    config, secrets = rehearsal_config(one_node, image, model_dir, tensorParallelSize=1, tls=True)
    refused_before_anything(stack, config, secrets)
    stack.configure(config, secrets)
    preview = stack.preview()
    assert preview.changed and set(preview.changed.values()) == {"create"}, preview.changed
    run = stack.up(preview_first=True)  # `pulumi up --yes` as the README types it
    assert set(run.changed) == set(preview.changed)
    assert stack.outputs_read_by_cli == 0 and run.outputs == stack.outputs(show_secrets=True)  # the event log's
    held = rules((0, 34, 0))
    assert run.outputs["release"]["vllm"] == {"version": "0.34.0", "heldTo": "0.34.0", "rules": held.fingerprint()}
    # the host check passed on a host with no NVIDIA driver: what it could say, in the release (#68)
    hosts = run.outputs["release"]["hosts"]
    assert hosts["kernel"] == [os.uname().release] and hosts["driver"] == [] and hosts["gpus"] == []
    assert "Loading model from scratch" in one_node.container_file(
        node, "spark-vllm-node-1", "/run/spark-vllm/vllm.log"
    )
    endpoint, keys, served = run.outputs["endpoint"], secrets["apiKeys"], run.outputs["servedModelName"]
    assert endpoint == f"https://{node.mgmt_ip}:8000/v1" and run.outputs["tls"]["names"] == [node.mgmt_ip]
    tour = openai_tour(endpoint, keys["alice"])  # the openai SDK, verifying the certificate with the stack's CA
    assert tour["models"] == [served] and tour[served]["chunks"] and tour[served]["tool"] == "get_weather"
    status, said = curl_chat(endpoint, keys["bob"], served, secrets["tls"]["ca"], tmp_path)
    assert status == 0 and '"choices"' in said, said
    assert request(f"{endpoint}/models")[0] == 401
    counted = edge_requests(one_node, node)
    assert counted[("alice", served)] == 2 and counted[("bob", served)] == 1, counted
    replaced_and_removed_under_load(one_node, stack, config, secrets, endpoint, served)
    assert stack.preview().changed == {}
    stack.destroy(preview_first=True)
    assert no_containers(one_node) and not stack.holds_resources()


def refused_before_anything(stack, config, secrets) -> None:
    """A certificate for another address and a key two clients share: the first preview names both, shows
    neither the key nor the certificate, and nothing exists."""
    other = TestCa().issue("10.99.0.1")
    wrong = {**secrets, "tls": {**secrets["tls"], "certificate": other.certificate, "key": other.key},
             "apiKeys": {**secrets["apiKeys"], "bob": secrets["apiKey"]}}  # fmt: skip
    stack.configure(config, wrong)
    with pytest.raises(StackError) as caught:
        stack.preview()
    message = str(caught.value)
    assert "tls.certificate: '[PEM]' — a certificate for " in message and "(it names 10.99.0.1)" in message
    assert "tls.ca: '[PEM]' — the CA that signed" in message  # another CA's: not the one the stack trusts
    assert "apiKeys.bob: '[secret]' — a key of its own: apiKey, apiKeys.bob are one key" in message
    for secret in (secrets["apiKey"], other.key.splitlines()[1], other.certificate.splitlines()[1]):
        assert secret not in message
    assert stack.resource_count() == 0


def replaced_and_removed_under_load(cluster, stack, config, secrets, endpoint, served) -> None:
    """alice's key replaced, bob's removed, while the `default` client (apiKey) keeps chatting: the edge's
    configuration step alone, no request failed, the old keys refused right after, vLLM not restarted."""
    node = cluster.nodes[0]
    old = secrets["apiKeys"]
    rotated = {**secrets, "apiKeys": {"alice": "sk-alice-rotated-" + "2" * 20}}
    containers = cluster.docker(node, "ps", "-q", "--no-trunc").stdout.split()
    status = cluster.container_file(node, "spark-vllm-node-1", "/run/spark-vllm/status.json")
    stack.configure(config, rotated)
    assert stack.preview().changed == {"spark-vllm-edge-config": "update"}
    with Load(endpoint, secrets["apiKey"], served) as load:
        time.sleep(2)
        run = stack.up()
        refused = [request(f"{endpoint}/models", key)[0] for key in old.values()]
        time.sleep(2)
    assert refused == [401, 401] and load.failures == [] and load.ok > 0, (refused, load.failures[:3])
    assert set(run.changed) == {"spark-vllm-edge-config"}
    assert request(f"{endpoint}/models", rotated["apiKeys"]["alice"])[0] == 200
    assert cluster.docker(node, "ps", "-q", "--no-trunc").stdout.split() == containers
    after = cluster.container_file(node, "spark-vllm-node-1", "/run/spark-vllm/status.json")
    for field in ("vllm_pid", "restarts_total"):
        assert json.loads(after)[field] == json.loads(status)[field], field
    print(f"\nKEY ROTATION (one model) under load: {load.ok} requests answered during the up, none failed")
