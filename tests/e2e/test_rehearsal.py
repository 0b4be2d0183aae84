"""The rehearsal: the README's `pulumi` commands, run by the real CLI and engine on simulated nodes.

Runs as root in CI with no skips (tests/e2e/conftest.py fails without the CLI). The tests in this
module share one deployment and run in order: deploy → no-op → vLLM-only change → drift → destroy
from a fresh clone. What is refused before any container is in test_refusals.py, three nodes in
test_three_nodes.py: each module has simulated nodes of its own, so that modules run side by side.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from tests import edge_load
from tests.attacks import refusals, smuggling
from tests.e2e.observe import RAY_NODES, container_ids, netns_processes, no_containers
from tests.e2e.rehearsal import (
    BENCHMARK,
    chat,
    compile_cache_keys,
    compile_factors,
    edge_under_load,
    last_vllm_start,
    program_key,
    rehearsal_config,
    request,
)
from tests.edge_harness import exchange, statuses
from tests.harness import ROOT
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e
# The README's path on nodes as a user has them: the first `up` pulls the image on every node, with its
# progress (other modules start from nodes that hold it already: tests/e2e/seed.py).
NODES_WITHOUT_IMAGE = True


@pytest.fixture(scope="module")
def deployed(sim_cluster, image, prometheus_image, model_dir, new_stack):
    stack = new_stack(checkpoints=True)  # the README's path: the CLI as a user's writes the state
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    config["benchmark"] = BENCHMARK
    # a real Prometheus on the worker, scraping vLLM on the head across the fabric
    config["metrics"] = {"prometheusNode": "node-2", "prometheusImage": prometheus_image, "scrapeIntervalSeconds": 1,
                         "nodePort": 9108}  # fmt: skip
    stack.configure(config, secrets)
    preview = stack.preview()
    run = stack.up()
    return {"stack": stack, "config": config, "secrets": secrets, "preview": preview, "run": run}


def test_the_first_preview_creates_everything_and_touches_nothing(sim_cluster, deployed):
    preview = deployed["preview"]
    assert set(preview.changed.values()) == {"create"}
    assert {"node-1-container", "node-2-container", "spark-vllm-serve"} <= set(preview.changed)
    assert set(deployed["run"].changed) == set(preview.changed)  # up did what the preview said


def test_the_pull_shows_its_progress_per_node(deployed):
    output = deployed["run"].output
    for node in ("node-1", "node-2"):
        assert f"{node}-pull" in output and f"[{node}] pulled " in output  # streamed by the pull step


def test_the_memory_plan_is_an_output(deployed):
    plan = deployed["run"].outputs["memoryPlan"]
    assert plan["checked"] is True and plan["fits"] is True and plan["maxModelLen"] == 4096
    assert set(plan["nodes"]) == {"node-1", "node-2"}
    assert plan["nodes"]["node-1"]["kv_per_token_mib"] > 0


def test_the_fabric_gate_passed_and_its_figures_are_an_output_and_in_the_release(sim_cluster, deployed):
    fabric = deployed["run"].outputs["fabric"]
    assert fabric["checked"] is True and fabric["problems"] == []
    for node in sim_cluster.nodes:
        link = fabric["links"][node.name]
        assert link["interface"] == node.fabric_interface and link["mtu"] == 1500 and link["speedGbps"] == 10.0
    assert fabric["floorGbps"] == 0.5  # 5 % of the veth's 10 Gb/s
    assert fabric["bandwidthGbps"]["node-1->node-2"] > fabric["floorGbps"]
    assert deployed["run"].outputs["release"]["fabric"]["bandwidthGbps"] == fabric["bandwidthGbps"]


def test_the_benchmark_measured_the_stand_ins_pace_and_is_part_of_the_release(deployed):
    bench = deployed["run"].outputs["benchmark"]
    assert bench["tool"] == "vllm bench serve"  # auto: the image's own, as on a real vLLM image (the stand-in's)
    assert bench["completed"] == 8 and bench["errors"] == 0 and bench["outputTokens"] == 8 * 16
    # 2 streams at the stand-in's 100 tokens/s each (STANDIN_TOKENS_PER_SECOND): at most 200 output tokens/s
    assert 50 < bench["outputTokensPerSecond"] <= 205
    assert 9.5 <= bench["itlMs"]["p50"] < 60 and bench["ttftMs"]["p50"] >= 10
    assert bench["settings"] == {"concurrency": 2, "requests": 8, "promptTokens": 32, "outputTokens": 16}
    release = deployed["run"].outputs["release"]
    assert release["benchmark"]["outputTokensPerSecond"] == bench["outputTokensPerSecond"]
    assert release["validated"] is True


def prometheus_api(cluster, node, path: str) -> dict:
    out = cluster.docker(node, "exec", "spark-vllm.prometheus", "curl", "-s", f"http://127.0.0.1:9090{path}").stdout
    return json.loads(out or "{}")


def test_a_real_prometheus_on_the_worker_scrapes_every_target(sim_cluster, deployed):
    worker = sim_cluster.nodes[1]
    metrics = deployed["run"].outputs["metrics"]
    assert metrics["prometheus"] == f"http://{worker.mgmt_ip}:9090"
    expected = {*[t for targets in metrics["targets"].values() for t in targets], "127.0.0.1:9090"}
    assert metrics["targets"]["vllm"] == [f"{sim_cluster.nodes[0].fabric_ip}:29002"]  # vLLM behind the edge
    seen: dict = {}

    def all_up() -> bool:
        active = prometheus_api(sim_cluster, worker, "/api/v1/targets").get("data", {}).get("activeTargets", [])
        seen.update({t["labels"]["instance"]: t["health"] for t in active})
        return set(seen) == expected and set(seen.values()) == {"up"}

    assert wait_for(all_up, timeout=60), seen

    def tokens() -> list[float]:  # the last scrape may have come before the benchmark's last tokens
        query = prometheus_api(sim_cluster, worker, "/api/v1/query?query=vllm:generation_tokens_total")
        values = [float(row["value"][1]) for row in query["data"]["result"]]
        return values if values and values[0] >= 8 * 16 else []

    # the benchmark's tokens, counted by the stand-in, scraped across nodes
    assert wait_for(tokens, timeout=60), prometheus_api(sim_cluster, worker, "/api/v1/targets")
    # it holds no key (vLLM's guards /v1 only): a plain output, which the edge's job is part of
    config = json.loads(deployed["stack"].outputs()["prometheusConfig"])
    assert "spark-vllm-edge" in {job["job_name"] for job in config["scrape_configs"]}
    assert deployed["secrets"]["apiKey"] not in json.dumps(config)


def test_every_dashboard_panel_returns_series_from_the_real_prometheus(sim_cluster, deployed):
    """The `dashboard` output's queries, as Grafana would send them ($__rate_interval as 1m), against the
    Prometheus of the stack: vLLM's metrics from the stand-in (vLLM 0.25's names), the nodes' from each
    supervisor (metrics.nodePort)."""
    worker = sim_cluster.nodes[1]
    board = deployed["run"].outputs["dashboard"]
    exprs = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    assert len(exprs) >= 10
    empty: dict = {}

    def every_panel_has_series() -> bool:
        empty.clear()
        for expr in exprs:
            query = urllib.parse.quote(expr.replace("$__rate_interval", "1m"))
            result = prometheus_api(sim_cluster, worker, f"/api/v1/query?query={query}")
            if result.get("status") != "success" or not result["data"]["result"]:
                empty[expr] = result.get("error", "no series")
        return not empty

    assert wait_for(every_panel_has_series, timeout=90), empty
    nodes_query = urllib.parse.quote("spark_vllm_node_memory_available_bytes")
    result = prometheus_api(sim_cluster, worker, f"/api/v1/query?query={nodes_query}")["data"]["result"]
    assert {row["metric"]["node"] for row in result} == {node.name for node in sim_cluster.nodes}


def test_the_dashboard_snapshot_draws_every_panel_from_the_real_prometheus(sim_cluster, deployed, tmp_path):
    """scripts/dashboard_snapshot.py, as a user runs it against the `metrics.prometheus` output: every panel
    drew a series. SPARK_VLLM_SNAPSHOT_DIR keeps the page, drawn over two minutes of which 100 s carry a
    steady load of two clients (the README's picture is its screenshot)."""
    outputs = deployed["run"].outputs
    keep = os.environ.get("SPARK_VLLM_SNAPSHOT_DIR")
    if keep:
        endpoint, key, served = outputs["endpoint"], deployed["secrets"]["apiKey"], outputs["servedModelName"]
        until = time.monotonic() + 100

        def client() -> None:
            while time.monotonic() < until:
                chat(endpoint, key, served)

        clients = [threading.Thread(target=client) for _ in range(2)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
    (tmp_path / "board.json").write_text(json.dumps(outputs["dashboard"]))
    page = tmp_path / "dashboard.html"
    argv = [sys.executable, str(ROOT / "scripts/dashboard_snapshot.py"), "--dashboard", str(tmp_path / "board.json"),
            "--prometheus", outputs["metrics"]["prometheus"], "--minutes", "2" if keep else "5", "--out", str(page),
            "--require-data"]  # fmt: skip
    done: dict = {}

    def drawn() -> bool:
        done["run"] = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return done["run"].returncode == 0

    assert wait_for(drawn, timeout=90), (done["run"].stdout, done["run"].stderr)
    lines = done["run"].stdout.splitlines()
    assert len(lines) == len(outputs["dashboard"]["panels"]) and all(" 0 series" not in line for line in lines)
    assert page.read_text().count("<polyline") >= len(lines)
    if keep:
        shutil.copy(page, Path(keep) / "dashboard.html")


def test_two_node_deploy_forms_ray_on_the_fabric_and_serves_with_the_key(sim_cluster, deployed):
    head = sim_cluster.nodes[0]
    alive = json.loads(sim_cluster.docker(head, "exec", "spark-vllm-node-1", "python3", "-c", RAY_NODES).stdout)
    assert sorted(alive) == sorted(node.fabric_ip for node in sim_cluster.nodes)
    assert not {node.mgmt_ip for node in sim_cluster.nodes} & set(alive)
    # no idle Python worker per CPU started for the first driver (components/scripts/node_ray_keeper.py RAY_ENV):
    # two on the head here before, twenty on a Spark's
    assert netns_processes(sim_cluster, words=("ray::IDLE",)) == []

    outputs, key = deployed["run"].outputs, deployed["secrets"]["apiKey"]
    endpoint = outputs["endpoint"]
    assert endpoint == f"http://{head.mgmt_ip}:8000/v1"
    status, models = request(f"{endpoint}/models", key)
    assert status == 200 and [m["id"] for m in models["data"]] == [outputs["servedModelName"]]
    answer = chat(endpoint, key, outputs["servedModelName"])
    assert answer["choices"][0]["message"]["content"]
    assert request(f"{endpoint}/models")[0] == 401
    assert request(f"{endpoint}/models", "wrong-key")[0] == 401
    assert outputs["smoke"]["completionTokens"] > 0
    assert outputs["release"]["validated"] is True
    # pulled from the registry: the release names the image by its repo digest
    assert outputs["release"]["image"].startswith(f"{sim_cluster.registry.address}/spark-vllm-rehearsal@sha256:")


def test_no_spelling_of_a_route_not_served_and_no_smuggled_request_gets_past_the_edge(sim_cluster, deployed):
    """The attack table (tests/attacks.py) against the deployed endpoint from the management network: vLLM's own
    key would let /invocations, /tokenize and the rest through; the edge refuses them, and every request hidden
    behind a chat is answered by the edge (its JSON error), never by vLLM (whose 404 says "detail")."""
    head, key = sim_cluster.nodes[0], deployed["secrets"]["apiKey"]
    assert refusals(head.mgmt_ip, 8000, key) == []
    for name, raw in smuggling(key).items():
        answer = exchange(8000, raw, host=head.mgmt_ip)
        assert b'"detail"' not in answer and statuses(answer)[-1] in (400, 401, 404, 405), (name, answer[-300:])


def test_vllm_listens_on_the_fabric_only_behind_the_edge(sim_cluster, deployed):
    """From the management network only the edge answers; on the fabric vLLM still serves its unguarded routes
    (/invocations answers a chat without the key): the fabric is the nodes' own network (docs/security.md)."""
    head = sim_cluster.nodes[0]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((head.mgmt_ip, 29002), timeout=5).close()
    body = json.dumps({"model": deployed["run"].outputs["servedModelName"], "prompt": "hi", "max_tokens": 2})
    probe = (
        "import sys, urllib.request; r = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), "
        "headers={'Content-Type': 'application/json'}); print(urllib.request.urlopen(r, timeout=30).status)"
    )
    found = sim_cluster.run_in(
        sim_cluster.nodes[1], [sys.executable, "-c", probe, f"http://{head.fabric_ip}:29002/invocations", body]
    )
    assert found.stdout.strip() == "200"


def test_the_worker_joined_through_its_fabric_address_and_vllm_placed_a_bundle_on_it(sim_cluster, deployed):
    head = sim_cluster.nodes[0]
    log = sim_cluster.docker(head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm.log").stdout
    for node in sim_cluster.nodes:
        assert node.fabric_ip in log  # one actor per GPU bundle, reported with its node's address


def test_each_ray_worker_keeps_its_own_nodes_interface_and_hca_names(sim_cluster, deployed):
    """node-2 names its fabric interface enp1s0f1np1 and has no RDMA device; the head names fab0 and
    rocep1s0f1. vLLM's Ray executor hands the driver's environment to every worker unless a name is in
    ray_non_carry_over_env_vars.json (vLLM 0.25; the stand-in does the same): listed, each keeps its own."""
    head, worker = sim_cluster.nodes
    log = sim_cluster.docker(head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm.log").stdout
    ranks = {}
    for line in log.splitlines():
        match = re.search(r"rank \d+: node_id=\S+ node_ip=(\S+) .* env=(\{.*\})$", line)
        if match:
            ranks[match.group(1)] = ast.literal_eval(match.group(2))
    assert ranks[head.fabric_ip]["NCCL_SOCKET_IFNAME"] == "fab0"
    assert ranks[head.fabric_ip]["NCCL_IB_HCA"] == "rocep1s0f1"
    assert ranks[worker.fabric_ip]["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1"
    assert ranks[worker.fabric_ip]["UCX_NET_DEVICES"] == "enp1s0f1np1"
    assert ranks[worker.fabric_ip]["NCCL_IB_HCA"] is None  # not the head's HCA
    listed = sim_cluster.docker(
        head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm-config/ray_non_carry_over_env_vars.json"
    ).stdout
    assert json.loads(listed) == ["NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES", "VLLM_API_KEY"]


def test_the_api_key_stays_with_the_api_server_and_out_of_every_nodes_compile_cache(sim_cluster, deployed):
    """vLLM 0.25's workers hash every VLLM_* variable they have into their torch.compile cache and write the
    raw values beside it (cache_key_factors.json; the stand-in writes it as each Ray worker "compiles"): the
    key is never handed to a Ray worker, on any node."""
    key = program_key(sim_cluster, sim_cluster.nodes[0], "spark-vllm-node-1")  # vLLM's: the program's own
    assert key != deployed["secrets"]["apiKey"]  # a client's key never reaches vLLM
    for node in sim_cluster.nodes:
        factors = compile_factors(sim_cluster, node)
        assert factors and all("VLLM_API_KEY" not in found["env"] for found in factors), node.name
        assert key not in json.dumps(factors)


def test_ray_refuses_a_client_without_the_token(sim_cluster, deployed):
    head = sim_cluster.nodes[0]
    probe = f"import ray; ray.init(address='{head.fabric_ip}:6379', logging_level='ERROR'); print('joined')"
    without = sim_cluster.docker(
        head, "exec", "spark-vllm-node-1", "env", "-u", "RAY_AUTH_TOKEN", "timeout", "60", "python3", "-c", probe,
        check=False,
    )  # fmt: skip
    assert without.returncode != 0 and "joined" not in without.stdout
    env = sim_cluster.docker(head, "exec", "spark-vllm-node-1", "env").stdout
    assert "RAY_AUTH_MODE=token" in env


def test_no_secret_is_on_any_command_line_in_any_output_or_in_the_stored_state(sim_cluster, deployed):
    stack = deployed["stack"]
    # vLLM's key, the program's own, as secret as the stack's
    values = {**deployed["secrets"], "program": program_key(sim_cluster, sim_cluster.nodes[0], "spark-vllm-node-1")}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for secret in values.values():
            assert secret.strip() not in cmdline, f"pid {pid}: {cmdline[:80]}"
    exported = stack.export()
    config_file = stack.config_file.read_text()
    outputs = json.dumps(stack.outputs())
    cli_output = deployed["run"].output + deployed["preview"].output
    key_body = values["sshPrivateKey"].strip().splitlines()[1]
    for secret in (values["apiKey"], values["hfToken"], values["program"], key_body):
        assert secret not in exported
        assert secret not in config_file
        assert secret not in outputs
        assert secret not in cli_output
    assert "ciphertext" in exported  # the secrets are there, encrypted


def test_under_load_from_one_address_the_edge_serves_a_keyed_client_from_another(sim_cluster, deployed):
    """#64 through the real CLI: the edge's limits back at their defaults (its configuration alone changes, no
    container), then each attack of tests/edge_load.py from one management address while a keyed client chats
    from another: none of its requests fails, and no keyless request reached vLLM."""
    head = sim_cluster.nodes[0]
    served = deployed["run"].outputs["servedModelName"]
    body = json.dumps({"model": served, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    before = sim_cluster.docker(head, "ps", "-q", "--no-trunc").stdout.split()
    loaded = edge_under_load(deployed["stack"], sim_cluster, deployed["config"], deployed["secrets"],
                             edge_load.Target(head.mgmt_ip, 8000), body)  # fmt: skip
    deployed["config"]["edge"].pop("keylessPerSource")  # what the stack now says, for the tests after this one
    assert loaded["preview"].changed == {"spark-vllm-edge-config": "update"}, loaded["preview"].changed
    assert sim_cluster.docker(head, "ps", "-q", "--no-trunc").stdout.split() == before
    print("\nEDGE UNDER LOAD (one model, plain HTTP):\n  " + "\n  ".join(edge_load.report(loaded["found"])))
    for name, result in loaded["found"].items():
        assert result["new"].failures == [] and result["kept"].failures == [], (name, result["new"].failures[:3])
    vllm_log = sim_cluster.container_file(head, "spark-vllm-node-1", "/run/spark-vllm/vllm.log")
    assert "/workers" not in vllm_log and "sk-leaked-in-a-query" not in vllm_log  # nothing keyless reached vLLM
    edge_log = sim_cluster.docker(head, "logs", "spark-vllm.edge").stdout
    assert "sk-leaked-in-a-query" not in edge_log


def test_a_second_preview_and_up_with_nothing_changed_change_nothing(sim_cluster, deployed):
    stack = deployed["stack"]
    before = container_ids(sim_cluster)
    preview = stack.preview()
    assert preview.changed == {}, preview.changed
    assert set(preview.change_summary) == {"same"}
    run = stack.up()
    assert run.changed == {}, run.changed
    # what the providers read back from the nodes (the docker provider's computed fields and defaults included)
    # is what the state holds: a refresh finds no drift, and the preview after it changes nothing
    refreshed = stack.refresh()
    assert refreshed.changed == {}, refreshed.changed
    assert stack.preview().changed == {}
    assert container_ids(sim_cluster) == before


def test_a_max_model_len_edit_previews_exactly_the_serve_steps_and_keeps_every_ray_container(sim_cluster, deployed):
    stack = deployed["stack"]
    before = container_ids(sim_cluster)
    stack.configure({**deployed["config"], "maxModelLen": 2048}, deployed["secrets"])
    preview = stack.preview()
    assert preview.changed == {
        "spark-vllm-serve": "update",
        "spark-vllm-ready": "replace",
        "spark-vllm-smoke": "replace",
        "spark-vllm-benchmark": "replace",
        "spark-vllm-endpoint-smoke": "replace",  # `up` ends once the edge serves the new vLLM: no 503 after it
    }  # no container, and not the Prometheus either
    run = stack.up()
    assert run.changed == preview.changed
    assert container_ids(sim_cluster) == before
    status, models = request(f"{run.outputs['endpoint']}/models", deployed["secrets"]["apiKey"])
    assert status == 200 and models["data"][0]["max_model_len"] == 2048
    deployed["config"]["maxModelLen"] = 2048


def test_another_model_directory_replaces_the_containers_and_the_new_one_is_served(sim_cluster, deployed, model_dir):
    """The bind mount of the model is part of what a container is: a changed path makes new containers."""
    stack = deployed["stack"]
    moved = model_dir.parent / f"{model_dir.name}-moved"
    shutil.copytree(model_dir, moved, dirs_exist_ok=True)
    before = container_ids(sim_cluster)
    for node in sim_cluster.nodes:  # what FlashInfer's JIT leaves (the stand-in has none of its own)
        sim_cluster.docker(
            node, "exec", f"spark-vllm-{node.name}", "sh", "-c", "echo built > /root/.cache/flashinfer/kernel"
        )
    keys = {node.name: compile_cache_keys(sim_cluster, node) for node in sim_cluster.nodes}
    assert all(keys.values()), keys  # each node's Ray worker compiled its graph
    stack.configure({**deployed["config"], "model": str(moved)}, deployed["secrets"])
    preview = stack.preview()
    assert preview.changed["node-1-container"] == "replace" and preview.changed["node-2-container"] == "replace"
    assert not any(name.endswith(("-image", "-docker", "-pull")) for name in preview.changed)
    run = stack.up()
    after = container_ids(sim_cluster)
    assert all(after[node] != before[node] for node in before)
    for node in sim_cluster.nodes:
        mounts = sim_cluster.docker(node, "inspect", "-f", "{{json .Mounts}}", f"spark-vllm-{node.name}").stdout
        assert str(moved) in mounts and f'"{model_dir}"' not in mounts
        # container.compileCache: the new container has the caches the old one left. The model is part of
        # vLLM's cache key, so its graph is compiled anew beside the old one; FlashInfer's kernels are kept.
        after = compile_cache_keys(sim_cluster, node)
        assert keys[node.name] < after and len(after) == len(keys[node.name]) + 1, (node.name, after)
        kept = sim_cluster.docker(node, "exec", f"spark-vllm-{node.name}", "cat", "/root/.cache/flashinfer/kernel")
        assert kept.stdout.strip() == "built", node.name
    started = last_vllm_start(sim_cluster, sim_cluster.nodes[0])
    assert started.count("Compiling a graph for compile range (1, 8192)") == 2, started  # one per node's worker
    status, models = request(f"{run.outputs['endpoint']}/models", deployed["secrets"]["apiKey"])
    assert status == 200 and models["data"][0]["root"] == str(moved)
    assert run.outputs["release"]["model"] == str(moved)
    deployed["config"]["model"] = str(moved)


def test_refresh_shows_a_container_removed_by_hand_and_the_next_up_repairs_it(sim_cluster, deployed):
    stack = deployed["stack"]
    worker = sim_cluster.nodes[1]
    sim_cluster.docker(worker, "rm", "-f", "spark-vllm-node-2")
    refreshed = stack.refresh()
    assert refreshed.changed.get("node-2-container") == "delete", refreshed.changed  # gone from the state
    assert "node-2-container" not in stack.export()
    preview = stack.preview()
    assert preview.changed.get("node-2-container") == "create"
    assert "node-1-container" not in preview.changed  # the head stays
    run = stack.up()
    assert run.changed.get("node-2-container") == "create"
    assert run.changed.get("spark-vllm-serve") == "replace"  # its Ray workers died with the container
    assert container_ids(sim_cluster)["node-2"]
    chat(run.outputs["endpoint"], deployed["secrets"]["apiKey"], run.outputs["servedModelName"])
    # container.compileCache: the new container's Ray worker found its graph in the node's volume
    started = last_vllm_start(sim_cluster, sim_cluster.nodes[0])
    assert started.count("Directly load the compiled graph(s) for compile range (1, 8192) from the cache") == 2, started
    assert "Compiling a graph" not in started, started


def test_destroy_from_a_fresh_clone_leaves_no_container_or_process(sim_cluster, deployed, tmp_path):
    """Another machine: the repository and the stack's config file, the same backend and passphrase,
    and none of the files the program wrote where it ran (gone here, as on any other machine). The
    SSH key is the sshPrivateKey secret, so `--run-program` writes its file first (README)."""
    stack = deployed["stack"]
    shutil.rmtree(stack.spark_vllm_home)
    clone = stack.fresh_clone(tmp_path / "other-machine")
    assert stack.holds_resources() and clone.holds_resources()  # one backend, read by both machines
    destroyed = clone.destroy(run_program=True)
    names = sorted(destroyed.changed, key=lambda name: destroyed.resources[name].finished or 0)
    # vLLM first, then the worker, then the head
    assert names.index("spark-vllm-serve") < names.index("node-2-container") < names.index("node-1-container")
    assert no_containers(sim_cluster)
    assert netns_processes(sim_cluster) == []
    assert clone.destroy().changed == {}  # a second destroy is safe and does nothing
    assert not stack.holds_resources()  # the one backend holds nothing any more
